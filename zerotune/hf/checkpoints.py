"""ZeroTrainer's checkpoint folders: the marker a complete one holds, finding the newest
complete one, refusing one that cannot resume, moving a saved model's files into place, and
the RNG states kept between loading a checkpoint and the Trainer's restoring them.

See [Note: ZeroTrainer's checkpoints] in hf/trainer.py for what a checkpoint holds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from .. import dist as zdist
from ..checkpoint import CheckpointError
from ..checkpoint.files import atomic_write_bytes, sha256_file
from ..checkpoint.manifest import MARKER, trainer_checkpoints

__all__ = [
    "TRAINER_MARKER",
    "TRAINER_STATE",
    "ZERO_DIR",
    "capture_rng",
    "check_resumable",
    "latest_complete_checkpoint",
    "mark_complete",
    "move_model_files",
    "restore_rng",
]

log = logging.getLogger(__name__)
log.addFilter(zdist.RankFilter())

TRAINER_STATE = "trainer_state.json"
ZERO_DIR = "zero"  # the zerotune checkpoint inside a Trainer checkpoint folder
# Written last into a Trainer checkpoint folder, once trainer_state.json is on disk: the
# checksums of that file and of the zerotune checkpoint's marker (see check_resumable).
TRAINER_MARKER = "TRAINER_COMPLETE"
# The files of a saved model's weights (replaced by a newer save, or refused as a resume).
_WEIGHT_FILES = re.compile(r"^model(-\d+-of-\d+)?\.safetensors$|^model\.safetensors\.index\.json$")


def latest_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest ``checkpoint-N`` under ``output_dir`` whose save finished. One cut short
    (no marker) is skipped with a warning; one whose files no longer match its marker was
    complete once and has been changed since: an error, not a silent step back (as for
    zerotune checkpoints, see checkpoint/manifest.py)."""
    for p in reversed(trainer_checkpoints(output_dir)):
        why = _incomplete(p)
        if why is None:
            return str(p)
        if (p / TRAINER_MARKER).is_file():
            raise CheckpointError(
                f"{p} was changed after its save ({why}); resume from an earlier checkpoint "
                "by naming it"
            )
        log.warning("zerotune: skipping %s: %s", p, why)
    return None


def mark_complete(folder: Path, step: int) -> None:
    """Write ``TRAINER_MARKER`` into a Trainer checkpoint whose files are all written."""
    state = folder / TRAINER_STATE
    with open(state, "rb") as f:
        data = f.read()
        os.fsync(f.fileno())  # the marker must never outlive the state it covers
    json.loads(data)
    zero = folder / ZERO_DIR / MARKER
    record = {
        "step": step,
        "trainer_state_sha256": hashlib.sha256(data).hexdigest(),
        "zero_marker_sha256": sha256_file(zero) if zero.is_file() else None,
    }
    atomic_write_bytes(folder / TRAINER_MARKER, json.dumps(record).encode())


def _incomplete(folder: Path) -> str | None:
    """Why ``folder`` is not a complete ZeroTrainer checkpoint, or None."""
    marker = folder / TRAINER_MARKER
    if not marker.is_file():
        return f"no {TRAINER_MARKER} marker: its save was interrupted"
    try:
        record = json.loads(marker.read_text())
        if not isinstance(record, dict):
            raise ValueError
    except (OSError, ValueError):
        return f"its {TRAINER_MARKER} marker is unreadable (damaged after the save)"
    state = folder / TRAINER_STATE
    if not state.is_file() or sha256_file(state) != record.get("trainer_state_sha256"):
        return f"{TRAINER_STATE} does not match its marker (lost or changed after the save)"
    zero = folder / ZERO_DIR / MARKER
    expected = record.get("zero_marker_sha256")
    if expected is not None and (not zero.is_file() or sha256_file(zero) != expected):
        return f"{ZERO_DIR}/{MARKER} does not match its marker (changed after the save)"
    return None


def check_resumable(folder: Path) -> None:
    """Raise CheckpointError unless ``folder`` is a ZeroTrainer checkpoint that was completed
    (its marker covers ``trainer_state.json`` and the zerotune checkpoint)."""
    if not folder.is_dir():
        raise CheckpointError(f"Can't find a valid checkpoint at {folder}")
    if (folder / ZERO_DIR).is_dir():
        why = _incomplete(folder)
        if why is not None:
            raise CheckpointError(f"{folder} cannot be resumed: {why}")
        return
    weights = any(_WEIGHT_FILES.match(p.name) for p in folder.iterdir())
    if (folder / "latest").is_file() or any(folder.glob("global_step*/*_states.pt")):
        source = "its model.safetensors" if weights else "what DeepSpeed's zero_to_fp32.py writes"
        raise CheckpointError(
            f"{folder} is a DeepSpeed checkpoint: its optimizer state is in DeepSpeed's pickle "
            f"files, which zerotune does not load; train on from {source} as the model"
        )
    if weights:
        raise CheckpointError(
            f"{folder} holds a model but no optimizer state (a saved model, or a "
            "save_only_model checkpoint): train from it as the model instead of resuming"
        )
    raise CheckpointError(f"{folder} is not a ZeroTrainer checkpoint (no {ZERO_DIR}/ folder)")


def move_model_files(staged: Path, output: Path) -> None:
    """Move a finished HF folder's files into ``output``, replacing the weight files of an
    earlier save (one rename per file)."""
    new = {p.name for p in staged.iterdir()}
    for old in output.iterdir():
        if old.is_file() and _WEIGHT_FILES.match(old.name) and old.name not in new:
            old.unlink()
    for p in staged.iterdir():
        dest = output / p.name
        if dest.is_dir():
            shutil.rmtree(dest)
        os.replace(p, dest)
    staged.rmdir()


def capture_rng() -> dict:
    """This process's Python, numpy, torch (and CUDA) RNG states."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    """Set the RNG states ``capture_rng`` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
