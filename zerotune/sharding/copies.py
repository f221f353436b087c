"""What ``pickle`` and ``copy.deepcopy`` make of a sharded model.

[Note: copies of a sharded model]
A unit's flat buffer keeps its shape while its storage comes and goes, so a generic
pickler or deep copy that reaches it reads memory that is not there (``datasets`` hashes a
transform by pickling it, and TRL's ``.map(self.tokenize_row)`` pickles the whole trainer
with its model). Units and engines therefore refuse to be pickled, with one line saying
why; ``datasets`` then falls back to a random fingerprint, as for any unpicklable transform.

``copy.deepcopy(model)`` of a sharded model (TRL's ``create_reference_model``) copies the
modules and their empty parameter placeholders, but not the engine: the copy's
``_zerotune_engine`` is a ``CopyOf`` naming the engine it came from. Forward hooks are
functions, which a deep copy shares, so the copy would run the original's hooks on the
original's units; the pre-forward hook refuses to run on a module other than its unit's.
Where the copy is handed to zerotune (a ZeroTrainer's reference model or teacher, or
``build_engine``), ``copy_sharded`` builds it properly: a fresh skeleton of the same
transformers class and config, sharded by the given config one unit at a time, each
rank's slices filled from the source's (``unit_state``), so the model is never whole.
"""

from __future__ import annotations

COPIED = (
    "this module is a copy (copy.deepcopy) of a model sharded by zerotune: it shares the "
    "original's hooks, not its weights; give it to a ZeroTrainer (as a reference model or "
    "teacher) or to zerotune.copy_sharded(engine) to shard it properly"
)


class NotPickled:
    """Refuses pickling (and a plain deep copy): see [Note: copies of a sharded model]."""

    def __reduce_ex__(self, protocol):
        raise TypeError(
            f"a {type(self).__name__} of a model sharded by zerotune cannot be pickled or "
            "copied: its storage comes and goes; save a checkpoint, or copy the model with "
            "zerotune.copy_sharded"
        )


class CopyOf:
    """What ``copy.deepcopy`` makes of a ``ZeroEngine``: the engine a copied model came
    from (see [Note: copies of a sharded model])."""

    def __init__(self, source) -> None:
        self.source = source

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"{name}: {COPIED}")


class CopiedAsSource(NotPickled):
    """A deep copy of the engine is a ``CopyOf`` it."""

    def __deepcopy__(self, memo) -> CopyOf:
        return CopyOf(self)
