"""The checkpoint format: folder layout, manifest, completion marker, finding the newest.

[Note: checkpoint layout]
A checkpoint root holds one folder per saved checkpoint and a ``latest`` pointer::

    root/
      latest                                 name of the checkpoint saved last
      step-00000010/
        rank-00000-of-00002.safetensors      rank 0's slices: u{i}.master, u{i}.exp_avg,
        rank-00001-of-00002.safetensors      u{i}.exp_avg_sq per unit, rng.torch; metadata:
                                             python/numpy RNG states (JSON)
        buffers.safetensors                  persistent module buffers (when the model has any)
        config.json, generation_config.json, tokenizer files (when given)
        manifest.json                        everything else, and a sha256 of every file above
        COMPLETE                             written last: the sha256 of manifest.json

Per parameter the manifest holds its name (and tied aliases), shape, unit, flat offset and
numel, its optimizer step count, and ``ranges``: which rank file holds which part of it, as
``[rank, param_start, param_stop, slice_offset]`` (elements ``[param_start, param_stop)`` of
the flattened parameter are elements ``[slice_offset, ...)`` of that rank's ``u{unit}.*``
tensors). Loading at any world size reads, for each parameter part in its new slice, just
those ranges (see load.py). Tiles of a tiled linear (sharding/tiling.py) are parameters of
their own; ``tiled`` lists each tiled weight's name, shape and tile blocks, so that export
writes the untiled weight and loading refuses a model tiled otherwise. A folder without
``COMPLETE`` (or whose ``COMPLETE`` does not match its manifest) is not a checkpoint: a save
was interrupted or the files were changed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

from .. import dist as zdist

__all__ = [
    "FORMAT",
    "LATEST",
    "MANIFEST",
    "MARKER",
    "VERSION",
    "CheckpointError",
    "find_checkpoints",
    "latest_checkpoint",
    "param_ranges",
    "rank_file_name",
    "read_manifest",
    "resolve_checkpoint",
    "trainer_checkpoints",
]

log = logging.getLogger(__name__)
log.addFilter(zdist.RankFilter())

FORMAT = "zerotune-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
MARKER = "COMPLETE"
LATEST = "latest"
BUFFERS = "buffers.safetensors"
_RANK_FILE = re.compile(r"rank-(\d+)-of-(\d+)\.safetensors")


# What a manifest must hold for resume, export and resharding to read it (checked on read,
# after its checksum: a manifest of this version that lacks a field or holds the wrong kind
# of value is refused in one line instead of failing deep inside a load).
_COUNT = {"type": "integer", "minimum": 0}
_OBJECT_OR_NULL = {"type": ["object", "null"]}
MANIFEST_SCHEMA = {
    "type": "object",
    "required": ["format", "version", "step", "world_size", "config", "units", "params", "files"],
    "properties": {
        "format": {"const": FORMAT},
        "version": {"type": "integer", "minimum": 1},
        "step": _COUNT,
        "world_size": {"type": "integer", "minimum": 1},
        "stage": {"enum": [1, 2, 3]},
        "config": {"type": "object"},
        "units": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["index", "name", "numel", "padded_numel", "shard_numel"],
                "properties": {
                    "index": _COUNT,
                    "name": {"type": "string"},
                    "numel": _COUNT,
                    "padded_numel": _COUNT,
                    "shard_numel": _COUNT,
                },
            },
        },
        "params": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "shape", "unit", "offset", "numel", "step", "ranges"],
                "properties": {
                    "name": {"type": "string"},
                    "aliases": {"type": "array", "items": {"type": "string"}},
                    "shape": {"type": "array", "items": _COUNT},
                    "unit": _COUNT,
                    "offset": _COUNT,
                    "numel": _COUNT,
                    "trainable": {"type": "boolean"},
                    "step": {"type": "integer", "minimum": -1},  # -1: saved without its optimizer
                    "ranges": {
                        "type": "array",
                        "items": {"type": "array", "items": _COUNT, "minItems": 4, "maxItems": 4},
                    },
                },
            },
        },
        "files": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "required": ["sha256", "bytes"],
                "properties": {"sha256": {"type": "string"}, "bytes": _COUNT},
            },
        },
        "buffers": {"type": ["array", "null"], "items": {"type": "string"}},
        "tiled": {"type": ["array", "null"]},
        "hub_layout": {"type": "boolean"},
        "optimizer": _OBJECT_OR_NULL,
        "scheduler": _OBJECT_OR_NULL,
        "scaler": _OBJECT_OR_NULL,
    },
}


class CheckpointError(ValueError):
    """A checkpoint cannot be saved or used; the message names the file and says why."""


def rank_file_name(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def param_ranges(offset: int, numel: int, shard_numel: int) -> list[list[int]]:
    """Where a parameter at flat ``offset`` of a unit lives across rank slices of
    ``shard_numel`` elements: ``[rank, param_start, param_stop, slice_offset]`` per piece."""
    out = []
    if numel == 0 or shard_numel == 0:
        return out
    for r in range(offset // shard_numel, (offset + numel - 1) // shard_numel + 1):
        lo = max(offset, r * shard_numel)
        hi = min(offset + numel, (r + 1) * shard_numel)
        out.append([r, lo - offset, hi - offset, lo - r * shard_numel])
    return out


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _marker(folder: Path) -> dict | None:
    try:
        data = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_complete(folder: Path) -> bool:
    """The folder has a completion marker (the manifest is checked when it is read). The
    marker is written last, whole, by a rename: one that is there but unreadable is damage
    after the save, which ``read_manifest`` refuses, not a save cut short to fall back from."""
    return (folder / MARKER).is_file()


def looks_like_checkpoint(folder: Path) -> bool:
    if not folder.is_dir():
        return False
    if (folder / MANIFEST).exists() or (folder / MARKER).exists():
        return True
    return any(_RANK_FILE.fullmatch(p.name) for p in folder.iterdir())


def _step_of(folder: Path) -> int:
    marker = _marker(folder)
    if marker is not None and isinstance(marker.get("step"), int):
        return marker["step"]
    m = re.search(r"(\d+)$", folder.name)
    return int(m.group(1)) if m else -1


def find_checkpoints(root: str | Path) -> list[tuple[Path, bool]]:
    """Checkpoint folders under ``root``, oldest first, each with whether it is complete."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if not p.name.startswith(".") and looks_like_checkpoint(p)]
    found.sort(key=lambda p: (_step_of(p), p.stat().st_mtime_ns, p.name))
    return [(p, is_complete(p)) for p in found]


def _choose(root: Path, warn: bool) -> Path | None:
    """The checkpoint under ``root`` that ``latest`` names, if complete; else the newest
    complete one (None if there is none). ``warn``: log why when it is not the newest."""
    found = find_checkpoints(root)
    complete = [p for p, ok in found if ok]
    if not complete:
        return None
    pointer = root / LATEST
    named = pointer.read_text().strip() if pointer.is_file() else None
    chosen = next((p for p in complete if p.name == named), None)
    if chosen is None:
        chosen = complete[-1]
        if warn and named is not None:
            log.warning(
                "zerotune: %s names %r, which is not a complete checkpoint; loading the newest "
                "complete one, %s",
                pointer,
                named,
                chosen,
            )
    at = [p for p, _ in found].index(chosen)
    newer = [p for p, _ in found[at + 1 :]]
    if warn and newer:
        if any(p in complete for p in newer):
            # Killed between a completion marker and the pointer update: either is whole.
            log.info("zerotune: %s is newer than %s but was never pointed at", newer[-1], pointer)
        else:
            log.warning(
                "zerotune: checkpoint %s is incomplete (its save was interrupted); loading the "
                "previous complete one, %s",
                newer[-1],
                chosen,
            )
    return chosen


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint ``load_checkpoint(root)`` would load (``root`` itself if it is a complete
    checkpoint), or None when there is none."""
    root = Path(root)
    if root.name == LATEST and root.is_file():
        root = root.parent
    if looks_like_checkpoint(root):
        return root if is_complete(root) else None
    return _choose(root, warn=False) if root.is_dir() else None


_TRAINER_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def trainer_checkpoints(root: str | Path) -> list[Path]:
    """The Trainer's ``checkpoint-N`` folders under ``root`` (each may hold a zerotune
    checkpoint in ``zero/``), oldest first by N; none when ``root`` is not a folder."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _TRAINER_CHECKPOINT.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint folder to load from ``path``: a checkpoint folder; or a folder of
    checkpoints, where ``latest`` names the one to load (when it names no complete checkpoint,
    the newest complete one is loaded with a warning; an interrupted newer save is skipped with
    a warning); or that folder's ``latest`` file; or a Trainer's output folder, whose newest
    ``checkpoint-N`` with a complete zerotune checkpoint is taken. Raises CheckpointError when
    there is none."""
    path = Path(path)
    if path.name == LATEST and path.is_file():
        path = path.parent
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a folder; give a checkpoint folder or its parent")
    if looks_like_checkpoint(path):
        if not is_complete(path):
            raise CheckpointError(
                f"{path}: incomplete checkpoint (no {MARKER} marker: the save was interrupted); "
                f"load its parent folder to get the newest complete checkpoint"
            )
        return path
    chosen = _choose(path, warn=True)
    if chosen is None:
        # A ZeroTrainer / zerotune finetune output folder: the zerotune checkpoint of its
        # newest Trainer checkpoint whose zerotune files are complete.
        trainer = trainer_checkpoints(path)
        for trainer_checkpoint in reversed(trainer):
            inner = _choose(trainer_checkpoint, warn=False)
            if inner is not None:
                log.info("zerotune: %s is a run folder: using %s", path, trainer_checkpoint)
                return inner
            log.warning("zerotune: skipping %s (its save was interrupted)", trainer_checkpoint)
        found = find_checkpoints(path)
        what = f" ({len(found)} incomplete: interrupted saves)" if found else ""
        if trainer:
            what += f"; none of its Trainer checkpoints (newest: {trainer[-1].name}) is complete"
        elif any(path.glob("*.safetensors")):
            what += "; it holds model weights already (a Hugging Face folder, not a checkpoint)"
        raise CheckpointError(f"{path}: no complete checkpoint in this folder{what}")
    return chosen


def read_manifest(folder: Path) -> dict:
    """The manifest of a complete checkpoint, checked against its marker and format."""
    if not (folder / MARKER).is_file():
        raise CheckpointError(
            f"{folder / MARKER}: missing: the checkpoint is incomplete (its save was interrupted)"
        )
    marker = _marker(folder)
    if marker is None:
        raise CheckpointError(
            f"{folder / MARKER}: unreadable (not a JSON object): the checkpoint was damaged "
            "after its save"
        )
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (the checkpoint folder was changed)")
    if marker.get("manifest_sha256") != _sha256(path):
        raise CheckpointError(
            f"{path}: does not match its {MARKER} marker (the manifest was changed after the save)"
        )
    try:
        manifest = json.loads(path.read_text())
    except ValueError:
        raise CheckpointError(f"{path}: not JSON") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a zerotune checkpoint manifest")
    version = manifest.get("version", 0)
    if isinstance(version, int) and version > VERSION:
        raise CheckpointError(
            f"{path}: format version {version} is newer than this zerotune reads ({VERSION}); "
            "upgrade zerotune"
        )
    _check_schema(path, manifest)
    return manifest


def _check_schema(path: Path, manifest: dict) -> None:
    import jsonschema

    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(MANIFEST_SCHEMA).iter_errors(manifest)
    )
    if error is not None:
        where = "".join(f"[{p!r}]" for p in error.absolute_path) or "the top level"
        what = error.message if len(error.message) <= 120 else error.message[:117] + "..."
        raise CheckpointError(f"{path}: malformed manifest at {where}: {what}")


def check_files(folder: Path, manifest: dict) -> None:
    """Every file the manifest lists exists with its recorded size (cheap; checksums are
    verified separately)."""
    for name, meta in manifest["files"].items():
        p = folder / name
        if not p.is_file():
            raise CheckpointError(f"{p}: missing (the checkpoint lists it)")
        size = p.stat().st_size
        if size != meta["bytes"]:
            raise CheckpointError(
                f"{p}: {size} bytes, the manifest says {meta['bytes']} (truncated or changed)"
            )
