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
old weights; TRL's ``clone_chat_template`` calls it, padding the vocabulary to a multiple
of 64. The class's method would read weights that are not there, and a unit's sizes,
extents and optimizer state are fixed when it is built. So the engine gives a transformers
model an instance attribute ``resize_token_embeddings`` (``FixedEmbeddings``). A call that
keeps the row count does what transformers does then: sets ``vocab_size``, returns the
embedding. Another (``init/resize.py``) gathers the fp32 masters of the units holding the
embedding and head, runs transformers' own ``_get_resized_embeddings`` and
``_get_resized_lm_head`` on plain copies of them (a tied head shares the copy's weight), so
the new rows are transformers' (rank 0's, broadcast), and ``ZeroEngine.reshard`` shards the
same model object again, in place, by the same config: every parameter becomes a new
placeholder of its shape, unchanged units copy their slices from the old ones, the others
are cut from the resized tensors, and the old units' files go. A tied head's own bias is
padded and the padding row dropped past the end, as ``tie_weights`` and transformers do. It
needs the model and engine as built: no optimizer yet (as before ``train()``), no tiled
linears, no class resizing more than these (BART's own ``resize_token_embeddings``); the
caller's references to parameter objects go stale (transformers keeps the objects), and
compiled blocks or hand-registered external parameters are the caller's to set up again
(ZeroTrainer compiles again).
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
    sharded model's embeddings]); held by the model, so a deep copy gets its own, which
    refuses as a copy does."""

    def __init__(self, model, engine) -> None:
        self.model, self.engine = model, engine  # a deep copy's: a CopyOf

    def __call__(self, new_num_tokens=None, pad_to_multiple_of=None, mean_resizing=True):
        model = self.model
        embeddings = model.get_input_embeddings()
        if new_num_tokens is None and pad_to_multiple_of is None:
            return embeddings
        rows = _rows(self.engine, embeddings._parameters["weight"])
        target = rows if new_num_tokens is None else new_num_tokens
        if pad_to_multiple_of is not None:
            if isinstance(pad_to_multiple_of, bool) or not isinstance(pad_to_multiple_of, int):
                raise ValueError(
                    f"pad_to_multiple_of must be an integer, got {pad_to_multiple_of!r}"
                )
            target = -(-target // pad_to_multiple_of) * pad_to_multiple_of
        if target != rows:
            from ..init.resize import resize_sharded

            resize_sharded(self.engine, new_num_tokens, pad_to_multiple_of, mean_resizing)
            return model.get_input_embeddings()
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
