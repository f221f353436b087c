"""Sharded checkpoints that resume at any world size, and streaming export to an HF folder.

See [Note: checkpoint layout] in manifest.py, [Note: saving a checkpoint] in save.py,
[Note: loading at another world size] in load.py, [Note: streaming export] in export.py.
"""

from .export import ExportError, export_hf, save_hf
from .load import CheckpointInfo, load_checkpoint
from .manifest import CheckpointError, latest_checkpoint, resolve_checkpoint
from .save import save_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "ExportError",
    "export_hf",
    "latest_checkpoint",
    "load_checkpoint",
    "resolve_checkpoint",
    "save_checkpoint",
    "save_hf",
]
