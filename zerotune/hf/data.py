"""Training data for causal LM fine-tuning: loading, tokenization, packing into blocks.

[Note: data pipeline]
1. ``load_raw_dataset``: a local file or folder (json / jsonl / csv / parquet / txt) through
   ``datasets``' packaged builders, a folder ``save_to_disk`` wrote, or a hub dataset name
   (from the local cache when HF_HUB_OFFLINE is set). A .txt file is one document (not one
   row per line).
2. ``choose_columns``: a chat column (``messages``: ``{"role", "content"}`` lists;
   ``conversations``: ShareGPT's ``{"from", "value"}``), a text column (``text``,
   ``content``) or a prompt/response pair (``prompt``/``response``, ``prompt``/``completion``,
   ``instruction``/``output``, ``question``/``answer``; of text, or of message lists as in
   TRL's conversational prompt/completion), unless named explicitly.
3. ``tokenize_and_pack``: each example becomes token ids followed by the end-of-sequence
   token; for a pair, the prompt's tokens get label -100 (no loss on the prompt) unless
   ``train_on_prompt``. Examples are concatenated (1,000 at a time) and cut into blocks of
   ``block_size`` tokens (each group's tail shorter than a block is dropped), so every batch
   is full and needs no padding or attention mask (with ``pack``, pairs are packed whole
   instead: [Note: packed conversations]). A block whose labels are all -100 (inside
   a long prompt) is left out: it would be a step of zero loss. Column values are strings,
   numbers or UTF-8 bytes (null is empty); lists and records are refused outside a chat
   column, and so is data that gives no token at all. Chat data goes its own way: see
   [Note: chat data].
A model without a tokenizer gets ``byte_tokenizer()``: ids 0-255 are the bytes of the UTF-8
text, then ``<|endoftext|>`` (256), ``<|pad|>`` (257) and ``<|unk|>`` (258); it needs no
download and ``save_pretrained`` writes a ``tokenizer.json`` that ``AutoTokenizer`` loads.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "BYTE_VOCAB_SIZE",
    "DEFAULT_CHAT_TEMPLATE",
    "Columns",
    "DataError",
    "PACKABLE",
    "byte_tokenizer",
    "chat_loss_mask",
    "choose_columns",
    "load_raw_dataset",
    "packed_collator",
    "prepare_datasets",
    "tokenize_and_pack",
]

BYTE_VOCAB_SIZE = 259
_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".txt": "text",
    ".text": "text",
    ".md": "text",
}
_TEXT_COLUMNS = ("text", "content")
_PAIRS = (
    ("prompt", "response"),
    ("prompt", "completion"),
    ("instruction", "output"),
    ("question", "answer"),
    ("input", "output"),
)


_CHAT_COLUMNS = ("messages", "conversations")
# ShareGPT speakers as chat roles.
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system", "tool": "tool"}  # fmt: skip
# [Note: chat data]
# A conversation is rendered whole with the tokenizer's chat template, and tokenized once
# with character offsets. The assistant's turns are found by rendering the conversation
# up to each assistant message: the text the message adds after the generation prompt of
# the turns before it is that turn (its content and the template's end-of-turn), and the
# tokens starting inside it carry loss; every other token is -100 unless
# ``train_on_prompt``. A template whose render of the first turns is not a prefix of the
# whole render cannot be split this way and is refused. A tokenizer without a template
# gets ``DEFAULT_CHAT_TEMPLATE`` (saved with it, so inference uses the same format).
# By default each conversation is one block, cut at ``block_size`` tokens and padded to
# it (attention mask 0, labels -100). With ``pack`` (``--packing``) see [Note: packed
# conversations].
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


# [Note: packed conversations]
# Short conversations padded to long blocks spend most of each step on padding. With
# ``pack``, consecutive conversations (each cut at ``block_size``) share a block while they
# fit, 1,000 at a time; the rest of a block is padding. Prompt/response pairs of text,
# otherwise concatenated across examples, are packed the same way. A block has no attention
# mask but ``position_ids`` that start at 0 with every conversation (and with the padding),
# and transformers' mask code (``find_packed_sequence_indices``) then builds a
# block-diagonal causal mask from them: no token attends to another conversation, and each
# token gets the position it has alone, so every logit is what the conversation alone would
# give. The label of each conversation's first token is -100 (the token before it belongs to
# the conversation before). The mask is built only without a cache: batches carry
# ``use_cache=False`` (``packed_collator``). Models whose positions come from the attention
# mask (OPT's learned positions, Bloom's ALiBi) would mix conversations, and so does GPT-OSS:
# ``--packing`` takes only the model types in ``PACKABLE``, each checked against the
# conversations run alone (tests/test_trainer_data.py). What changes is the batch: a step
# averages the loss over the tokens of more conversations.
PACKABLE = frozenset(
    {"gpt2", "llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma2", "phi3", "gpt_neox",
     "falcon", "gptj", "olmo2", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3",
     "gemma3_text", "granite", "olmo3", "glm4_moe"}
)  # fmt: skip


def packed_collator(features):
    """``default_data_collator`` for packed blocks: the model is told not to build a cache
    (with one, transformers would not read the conversations' bounds from the positions)."""
    from transformers import default_data_collator

    batch = default_data_collator(features)
    batch["use_cache"] = False
    return batch


class DataError(ValueError):
    """The training data cannot be used as given; the message says why and what to do."""


# ------------------------------------------------------------------------- tokenizer
def _byte_to_char() -> dict[int, str]:
    """A printable character per byte (BPE byte-level convention): printable Latin-1 bytes
    stand for themselves, the rest are moved above 255."""
    printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    out, shift = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + shift)
            shift += 1
    return out


def byte_tokenizer():
    """A byte-level tokenizer needing no download: token id = byte value (0-255), then
    ``<|endoftext|>`` = 256 (bos/eos), ``<|pad|>`` = 257, ``<|unk|>`` = 258."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = _byte_to_char()
    core = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(["<|endoftext|>", "<|pad|>", "<|unk|>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        unk_token="<|unk|>",
    )


# ----------------------------------------------------------------------------- loading
def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause).strip():
        text = str(cause).strip()  # datasets wraps the reader's error in a generic one
    return text.splitlines()[0] if text else type(exc).__name__


def load_raw_dataset(source: str | os.PathLike):
    """The ``train`` split of a local file / folder or a hub dataset (see [Note: data pipeline])."""
    import datasets

    path = Path(source)
    saved = ("state.json", "dataset_dict.json")  # what save_to_disk writes
    if path.is_dir() and any((path / name).is_file() for name in saved):
        return _load_saved_dataset(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in _BUILDERS and p.is_file())
        kinds = {_BUILDERS[p.suffix.lower()] for p in files}
        if not files:
            raise DataError(f"dataset folder {path} has no {'/'.join(sorted(_BUILDERS))} files")
        if len(kinds) > 1:
            raise DataError(f"dataset folder {path} mixes file types ({', '.join(sorted(kinds))})")
        builder = kinds.pop()
    elif path.is_file():
        files = [path]
        builder = _BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise DataError(
                f"dataset {path}: unknown file type {path.suffix or '(none)'}; use one of "
                + ", ".join(sorted(_BUILDERS))
            )
        if not os.access(path, os.R_OK):
            raise DataError(f"dataset {path} is not readable")
    else:
        if path.suffix.lower() in _BUILDERS or str(source).startswith((".", "/", "~")):
            raise DataError(f"dataset {source}: no such file or folder")
        return _load_hub_dataset(str(source))

    kwargs = {"sample_by": "document"} if builder == "text" else {}
    try:
        with _quiet_datasets():
            ds = datasets.load_dataset(
                builder, data_files=[str(f) for f in files], split="train", **kwargs
            )
    except Exception as exc:  # noqa: BLE001 - a parse error of any reader becomes one line
        found = _json_problem(files) if builder == "json" else _no_rows(files, builder)
        raise DataError(
            found or f"cannot read dataset {path} as {builder}: {_first_line(exc)}"
        ) from None
    if len(ds) == 0:
        raise DataError(f"dataset {path} is empty")
    return ds


def _load_saved_dataset(path: Path):
    """A folder written by ``Dataset.save_to_disk`` (or a ``DatasetDict``'s: its train split)."""
    import datasets

    try:
        with _quiet_datasets():
            ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # noqa: BLE001
        raise DataError(
            f"cannot read dataset {path} (saved by datasets): {_first_line(exc)}"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"dataset {path} has no train split (its splits: {', '.join(ds)})")
        ds = ds["train"]
    if len(ds) == 0:
        raise DataError(f"dataset {path} is empty")
    return ds


def _no_rows(files: list[Path], builder: str) -> str | None:
    """After the csv or parquet reader failed: whether the files hold no rows (the readers
    say 'corresponds to no data' or 'BatchSize must be greater than 0')."""
    try:
        if builder == "parquet":
            import pyarrow.parquet as pq

            rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
        elif builder == "csv":
            rows = 0
            for f in files:
                with open(f, encoding="utf-8", errors="replace") as lines:
                    rows += max(0, sum(1 for line in lines if line.strip()) - 1)  # the header
        else:
            return None
    except Exception:  # noqa: BLE001 - not readable as that format: the reader's error stands
        return None
    if rows:
        return None
    where = files[0] if len(files) == 1 else files[0].parent
    return f"dataset {where} is empty (no rows)"


def _json_problem(files: list[Path]) -> str | None:
    """After the json reader failed: what is wrong, in the user's terms (its own messages
    say 'StopIteration' for an empty file and count rows from 0): the first line of a
    .jsonl file that is not JSON, counted from 1, or files that are all empty."""
    empty = []
    for f in files:
        blank = True
        with open(f, encoding="utf-8", errors="replace", newline="\n") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                blank = False
                if f.suffix.lower() != ".jsonl":
                    break
                try:
                    json.loads(line.rstrip("\r\n"))
                except json.JSONDecodeError as exc:
                    return (
                        f"dataset {f}, line {number}, column {exc.colno}: not valid JSON "
                        f"({exc.msg})"
                    )
        if blank:
            empty.append(f)
    if len(empty) == len(files):  # one empty file among others is not what failed
        return f"dataset {empty[0] if len(files) == 1 else empty[0].parent} is empty"
    return None


def _load_hub_dataset(name: str):
    import datasets

    try:
        with _quiet_datasets():
            return datasets.load_dataset(name, split="train")
    except Exception as exc:  # noqa: BLE001
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        where = "the local cache (HF_HUB_OFFLINE is set)" if offline else "the hub"
        raise DataError(
            f"dataset {name!r} is not a local file and could not be loaded from {where}: "
            f"{_dataset_reason(exc, name)}"
        ) from None


def _dataset_reason(exc: Exception, name: str) -> str:
    """datasets' own reason, without its "not cached in None" (no cache folder was given)."""
    reason = _first_line(exc)
    if re.fullmatch(rf"Dataset '?{re.escape(name)}'? is not cached in None\.?", reason):
        return "it is not in the datasets cache"
    return reason


@contextlib.contextmanager
def _quiet_datasets():
    """No progress bars or log lines while reading raw files: a failure is reported once,
    by the DataError raised."""
    import datasets

    level = datasets.logging.get_verbosity()
    bars = datasets.is_progress_bar_enabled()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


# ----------------------------------------------------------------------------- columns
@dataclass
class Columns:
    """Which columns feed the model: ``chat`` (conversations), ``text`` alone, or ``prompt``
    and ``response``."""

    text: str | None = None
    prompt: str | None = None
    response: str | None = None
    chat: str | None = None

    def describe(self) -> str:
        if self.chat is not None:
            return f"chat column {self.chat!r}"
        if self.text is not None:
            return f"text column {self.text!r}"
        return f"prompt column {self.prompt!r}, response column {self.response!r}"

    def conversational(self, ds) -> bool:
        """Whether ``ds`` holds conversations: a chat column, or a prompt/response pair of
        message lists (TRL's conversational prompt/completion)."""
        if self.chat is not None:
            return True
        return self.prompt is not None and len(ds) > 0 and isinstance(ds[0][self.prompt], list)


def choose_columns(
    names: list[str],
    *,
    text_column: str | None = None,
    prompt_column: str | None = None,
    response_column: str | None = None,
    chat_column: str | None = None,
    source: str = "the dataset",
) -> Columns:
    """Pick the columns to train on: the ones named, or the first known name present."""
    have = ", ".join(names)
    for given in (text_column, prompt_column, response_column, chat_column):
        if given is not None and given not in names:
            raise DataError(f"{source} has no column {given!r} (its columns: {have})")
    if chat_column is not None:
        if text_column or prompt_column or response_column:
            raise DataError("give either a chat column or text / prompt-response columns")
        return Columns(chat=chat_column)
    if text_column is not None:
        if prompt_column or response_column:
            raise DataError("give either a text column or a prompt/response pair, not both")
        return Columns(text=text_column)
    if (prompt_column is None) != (response_column is None):
        # One of the pair given: find its partner among the known pairs.
        for p, r in _PAIRS:
            if prompt_column in (None, p) and response_column in (None, r):
                if (prompt_column or p) in names and (response_column or r) in names:
                    return Columns(prompt=prompt_column or p, response=response_column or r)
        raise DataError(
            f"{source}: name both --prompt-column and --response-column (its columns: {have})"
        )
    if prompt_column is not None:
        return Columns(prompt=prompt_column, response=response_column)
    for name in _CHAT_COLUMNS:
        if name in names:
            return Columns(chat=name)
    for name in _TEXT_COLUMNS:
        if name in names:
            return Columns(text=name)
    for p, r in _PAIRS:
        if p in names and r in names:
            return Columns(prompt=p, response=r)
    raise DataError(
        f"{source} has no chat column ({', '.join(_CHAT_COLUMNS)}), no text column "
        f"({', '.join(_TEXT_COLUMNS)}) and no prompt/response pair (its columns: {have}); "
        "name one with --chat-column, --text-column or --prompt-column/--response-column"
    )


# -------------------------------------------------------------------- tokenize, pack
def tokenize_and_pack(
    ds,
    tokenizer,
    columns: Columns,
    block_size: int,
    *,
    train_on_prompt: bool = False,
    num_proc: int | None = None,
    source: str = "the dataset",
    pack: bool = False,
):
    """A dataset of ``input_ids`` and ``labels`` blocks of ``block_size`` tokens. Values
    of a column are text: strings, numbers (as written) or UTF-8 bytes; null is empty;
    anything else (chat message lists, records) is refused. ``source`` names the dataset
    in messages. ``pack``: conversations, or prompt/response pairs, share blocks each alone
    in its mask ([Note: packed conversations]); text is cut into full blocks always."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("the tokenizer has no end-of-sequence token; give one that does")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    if columns.conversational(ds):
        return _chat_blocks(ds, tokenizer, columns, block_size, train_on_prompt, source, pad, pack)

    def ids_of(batch, column):
        texts = [_as_text(t, column, source) for t in batch[column]]
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    def tokenize(batch):
        if columns.text is not None:
            ids = [x + [eos] for x in ids_of(batch, columns.text)]
            return {
                "input_ids": ids,
                "labels": [list(x) for x in ids],
                "text_tokens": [len(x) - 1 for x in ids],
            }
        prompts = ids_of(batch, columns.prompt)
        responses = ids_of(batch, columns.response)
        ids, labels = [], []
        for p, r in zip(prompts, responses):
            ids.append(p + r + [eos])
            labels.append((p if train_on_prompt else [-100] * len(p)) + r + [eos])
        counts = [len(p) + len(r) for p, r in zip(prompts, responses)]
        return {"input_ids": ids, "labels": labels, "text_tokens": counts}

    def pack_pairs(batch):
        """With ``pack``, for prompt/response pairs: each pair whole (cut at
        ``block_size``) and alone in its mask, as conversations are."""
        pairs = zip(batch["input_ids"], batch["labels"])
        return pack_sequences(_learnable(pairs, block_size), block_size, pad)

    def concatenate(batch):
        ids = [t for x in batch["input_ids"] for t in x]
        labels = [t for x in batch["labels"] for t in x]
        n = len(ids) // block_size * block_size
        # A block with no label to learn (the middle of a long prompt) would add a step of
        # zero loss and zero gradient: left out.
        starts = [
            i for i in range(0, n, block_size) if any(t != -100 for t in labels[i : i + block_size])
        ]
        return {
            "input_ids": [ids[i : i + block_size] for i in starts],
            "labels": [labels[i : i + block_size] for i in starts],
        }

    try:
        tokenized = ds.map(
            tokenize,
            batched=True,
            remove_columns=ds.column_names,
            num_proc=num_proc,
            desc="Tokenizing",
        )
    except UnicodeDecodeError as exc:  # the json reader passes invalid bytes through
        raise DataError(f"{source} is not UTF-8 text ({_first_line(exc)})") from None
    import pyarrow.compute as pc

    if not pc.sum(tokenized.data.column("text_tokens")).as_py():
        raise DataError(
            f"{source} gives no tokens from its {columns.describe()}: every row is empty or "
            "null, or the tokenizer encodes nothing (is its folder complete?)"
        )
    # Packing goes 1,000 examples at a time (bounded memory); blocks cross example
    # boundaries within a batch, and each batch drops its last partial block (with
    # ``pack``, pairs are packed whole instead, each alone in its mask).
    blocks = tokenized.map(
        pack_pairs if pack and columns.text is None else concatenate,
        batched=True,
        batch_size=1000,
        remove_columns=tokenized.column_names,
        desc="Packing",
    )
    if len(blocks) == 0:
        learned = " with a response token in it" if columns.text is None else ""
        raise DataError(
            f"{source} makes no block of {block_size} tokens{learned}; use a smaller "
            "--block-size or more data"
        )
    return blocks


def _conversation(value, column: str, source: str) -> list[dict]:
    """One row of a chat column as ``[{"role", "content"}, ...]`` (ShareGPT's
    ``{"from", "value"}`` turns mapped to roles)."""
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise DataError(
            f"{source}: column {column!r} holds {type(value).__name__} values, not lists of "
            "messages ({'role': ..., 'content': ...})"
        )
    out = []
    for m in value:
        if "role" in m and "content" in m:
            if isinstance(m["content"], (list, dict)):
                raise DataError(
                    f"{source}: column {column!r} has a message whose content is a "
                    f"{type(m['content']).__name__} ({str(m['content'])[:60]}...); a message's "
                    "content must be text (join the text of content parts into one string)"
                )
            out.append({"role": m["role"], "content": _as_text(m["content"], column, source)})
        elif "from" in m and "value" in m and m["from"] in _SHAREGPT_ROLES:
            role = _SHAREGPT_ROLES[m["from"]]
            out.append({"role": role, "content": _as_text(m["value"], column, source)})
        else:
            raise DataError(
                f"{source}: column {column!r} has a message {dict(m)!r}: messages are "
                "{'role', 'content'} (or ShareGPT's {'from': human|gpt|system, 'value'})"
            )
    if not out:
        raise DataError(f"{source}: column {column!r} has an empty conversation")
    return out


def chat_loss_mask(tokenizer, messages: list[dict], train_on_prompt: bool = False, first: int = 0):
    """(token ids, labels) of one conversation: see [Note: chat data]. Only assistant turns
    from message ``first`` on carry loss (a conversational prompt/completion pair: the
    completion's)."""

    def render(turns, prompt=False):
        from jinja2 import TemplateError

        try:
            return tokenizer.apply_chat_template(
                turns, tokenize=False, add_generation_prompt=prompt
            )
        except TemplateError as exc:  # a syntax error, or the template's raise_exception
            raise DataError(
                f"the chat template cannot render a conversation ({_first_line(exc)}); fix "
                "the data (roles, their order) or give another template with --chat-template"
            ) from None

    full = render(messages)
    if train_on_prompt:
        ids = list(tokenizer(full, add_special_tokens=False)["input_ids"])
        return ids, list(ids)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < first:
            continue
        earlier = render(messages[:i]) if i else ""
        before, after = render(messages[:i], prompt=True) if i else "", render(messages[: i + 1])
        if not (after.startswith(earlier) and full.startswith(after)):
            raise DataError(
                "the chat template does not render a conversation's first turns as the start "
                "of the whole (the assistant's turns cannot be found); give another with "
                "--chat-template, or train on every token with --train-on-prompt"
            )
        # The generation prompt of the template may differ from what an assistant turn
        # starts with: the turn is what follows their common start.
        start = len(os.path.commonprefix([before, after]))
        spans.append((start, len(after)))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    labels = [
        t if any(a <= begin < b for a, b in spans) else -100
        for t, (begin, _) in zip(ids, enc["offset_mapping"])
    ]
    return ids, labels


def _learnable(sequences, block_size: int):
    """``(ids, labels)`` sequences cut at ``block_size``, without those left with nothing to
    learn (no label past the first token, which nothing predicts: all prompt, or the
    answers past the cut)."""
    for ids, labels in sequences:
        ids, labels = ids[:block_size], labels[:block_size]
        if any(t != -100 for t in labels[1:]):
            yield ids, labels


def pack_sequences(sequences, block_size: int, pad: int) -> dict[str, list]:
    """Blocks of ``block_size`` from ``(ids, labels)`` sequences of at most ``block_size``
    tokens each, next fit, with position ids restarting at each sequence and at the padding
    ([Note: packed conversations])."""
    out = {"input_ids": [], "labels": [], "position_ids": []}
    ids, labels, positions = [], [], []

    def close():
        fill = block_size - len(ids)
        out["input_ids"].append(ids + [pad] * fill)
        out["labels"].append(labels + [-100] * fill)
        out["position_ids"].append(positions + list(range(fill)))

    for seq_ids, seq_labels in sequences:
        if len(ids) + len(seq_ids) > block_size:
            close()
            ids, labels, positions = [], [], []
        ids += seq_ids
        labels += [-100] + seq_labels[1:]  # not predicted from the sequence before
        positions += range(len(seq_ids))
    if ids:
        close()
    return out


def _chat_blocks(
    ds, tokenizer, columns: Columns, block_size: int, train_on_prompt, source, pad: int, pack
):
    """One padded block per conversation (see [Note: chat data]), or with ``pack`` several
    ([Note: packed conversations]): a chat column's, or a prompt/completion pair of message
    lists (TRL's conversational shape: the loss on the completion's assistant turns)."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE

    def conversations(batch):
        if columns.chat is not None:
            for value in batch[columns.chat]:
                yield _conversation(value, columns.chat, source), 0
            return
        for p, r in zip(batch[columns.prompt], batch[columns.response]):
            prompt = _conversation(p, columns.prompt, source)
            yield prompt + _conversation(r, columns.response, source), len(prompt)

    def learned(batch):
        masked = (chat_loss_mask(tokenizer, m, train_on_prompt, f) for m, f in conversations(batch))
        return _learnable(masked, block_size)

    def block(batch):
        out = {"input_ids": [], "labels": [], "attention_mask": []}
        for ids, labels in learned(batch):
            fill = block_size - len(ids)
            out["input_ids"].append(ids + [pad] * fill)
            out["labels"].append(labels + [-100] * fill)
            out["attention_mask"].append([1] * len(ids) + [0] * fill)
        return out

    def packed(batch):
        return pack_sequences(learned(batch), block_size, pad)

    blocks = ds.map(
        packed if pack else block, batched=True, remove_columns=ds.column_names, desc="Tokenizing"
    )
    if len(blocks) == 0:
        raise DataError(
            f"{source} has no conversation with an assistant token within the first "
            f"{block_size} tokens; use a larger --block-size, or check its roles"
        )
    return blocks


def _as_text(value, column: str, source: str) -> str:
    """One value of a text, prompt or response column as the text to tokenize."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(
                f"{source}: column {column!r} holds bytes that are not UTF-8 text "
                f"({exc.reason} at byte {exc.start})"
            ) from None
    if isinstance(value, (bool, int, float)):
        return str(value)
    hint = ""
    if isinstance(value, (list, dict)):
        hint = " (chat messages: name the column with --chat-column)"
    raise DataError(
        f"{source}: column {column!r} holds {type(value).__name__} values, not text{hint}"
    )


def prepare_datasets(
    source,
    tokenizer,
    block_size: int,
    *,
    eval_split: float = 0.0,
    text_column: str | None = None,
    prompt_column: str | None = None,
    response_column: str | None = None,
    chat_column: str | None = None,
    train_on_prompt: bool = False,
    seed: int = 0,
    name: str | None = None,
    pack: bool = False,
):
    """(train blocks, eval blocks or None, the columns used): see [Note: data pipeline].
    ``source``: what ``load_raw_dataset`` takes, or a ``datasets.Dataset`` it returned;
    ``name``: what messages call the dataset (its path, by default)."""
    if block_size < 2:
        raise DataError(f"--block-size must be at least 2, got {block_size}")
    if not 0.0 <= eval_split < 1.0:
        raise DataError(f"--eval-split must be a fraction in [0, 1), got {eval_split}")
    loaded = hasattr(source, "column_names")  # a Dataset already
    raw = source if loaded else load_raw_dataset(source)
    if name is not None or not loaded:
        name = f"dataset {source if name is None else name}"
    else:
        name = "the dataset"  # a Dataset given without a name
    columns = choose_columns(
        raw.column_names,
        text_column=text_column,
        prompt_column=prompt_column,
        response_column=response_column,
        chat_column=chat_column,
        source=name,
    )
    blocks = tokenize_and_pack(
        raw, tokenizer, columns, block_size, train_on_prompt=train_on_prompt, source=name, pack=pack
    )
    if not eval_split:
        return blocks, None, columns
    n_eval = max(1, round(len(blocks) * eval_split))
    if len(blocks) - n_eval < 1:
        raise DataError(
            f"the dataset makes {len(blocks)} block(s) of {block_size} tokens: too few to hold "
            f"out {eval_split:.0%} for evaluation"
        )
    split = blocks.train_test_split(test_size=n_eval, seed=seed, shuffle=True)
    return split["train"], split["test"], columns
