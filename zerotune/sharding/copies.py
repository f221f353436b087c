"""What ``pickle``, ``copy.deepcopy`` and ``resize_token_embeddings`` make of a sharded model.

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

[Note: resizing a sharded model's embeddings]
transformers' ``resize_token_embeddings`` builds a new embedding (and output head) from the
old weights and swaps the modules in; TRL's ``clone_chat_template`` calls it, padding the
vocabulary to a multiple of 64. A unit's sizes, swap extents and optimizer state are fixed
when the engine is built, so a sharded model cannot change shape; the class's method would
also read weights that are not there and leave the model half changed. The engine
therefore gives a transformers model an instance attribute ``resize_token_embeddings``
(``FixedEmbeddings``): a call that keeps the row count (TRL's padding when the vocabulary
is already a multiple) does what transformers does then, sets ``vocab_size`` and returns
the input embedding; one that changes it is refused with one line, before anything
changes, naming what works: resizing before the model is sharded.
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


class FixedEmbeddings:
    """``resize_token_embeddings`` of a sharded transformers model (see [Note: resizing a
    sharded model's embeddings]); held by the model, so a deep copy gets its own."""

    def __init__(self, model, engine) -> None:
        self.model, self.engine = model, engine  # a deep copy's: a CopyOf

    def __call__(self, new_num_tokens=None, pad_to_multiple_of=None, mean_resizing=True):
        model = self.model
        embeddings = model.get_input_embeddings()
        if new_num_tokens is None and pad_to_multiple_of is None:
            return embeddings
        rows = _rows(self.engine, embeddings.weight)
        target = rows if new_num_tokens is None else new_num_tokens
        if pad_to_multiple_of is not None:
            if isinstance(pad_to_multiple_of, bool) or not isinstance(pad_to_multiple_of, int):
                raise ValueError(
                    f"pad_to_multiple_of must be an integer, got {pad_to_multiple_of!r}"
                )
            target = -(-target // pad_to_multiple_of) * pad_to_multiple_of
        if target != rows:
            raise RuntimeError(
                f"resize_token_embeddings: this model is sharded by zerotune, and its "
                f"embedding cannot grow or shrink from {rows} to {target} rows; resize it "
                "before it is sharded (load the model, call resize_token_embeddings, or TRL's "
                "clone_chat_template, then give the module to ZeroTrainer), or give TRL's "
                "chat_template_path a .jinja file"
            )
        model.config.get_text_config().vocab_size = rows
        model.vocab_size = rows
        return embeddings


def _rows(engine, weight) -> int:
    """The first dimension of ``weight`` as sharded (a released parameter is empty)."""
    for unit in engine.units:
        for slot in unit.slots:
            if slot.param is weight:
                return slot.shape[0]
    return weight.shape[0]


def guard_resize(model, engine) -> None:
    """Give a transformers model ``engine`` shards its ``FixedEmbeddings``."""
    if callable(getattr(type(model), "resize_token_embeddings", None)):
        model.__dict__["resize_token_embeddings"] = FixedEmbeddings(model, engine)
