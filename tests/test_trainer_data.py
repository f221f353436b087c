"""The finetune data pipeline: file formats, column choice, packing, prompt masking, and the
byte-level tokenizer."""

from __future__ import annotations

import json

import pytest

from zerotune.hf.data import (
    BYTE_VOCAB_SIZE,
    DataError,
    byte_tokenizer,
    choose_columns,
    load_raw_dataset,
    prepare_datasets,
)


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def test_byte_tokenizer_is_utf8_bytes_and_reloads(tok, tmp_path):
    from transformers import AutoTokenizer

    text = "héllo wörld\n\t¡ok! 中"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert len(tok) == BYTE_VOCAB_SIZE
    assert (tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (256, 257, 258)
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)  # no custom code, no download
    assert again(text, add_special_tokens=False)["input_ids"] == ids
    assert again.eos_token_id == 256


@pytest.mark.parametrize("kind", ["jsonl", "csv", "parquet", "txt-folder"])
def test_formats_and_packing(tok, tmp_path, kind):
    import pandas as pd

    texts = [f"row {i}: " + "abc" * (i % 5) for i in range(40)]
    if kind == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    elif kind == "csv":
        path = tmp_path / "d.csv"
        pd.DataFrame({"text": texts}).to_csv(path, index=False)
    elif kind == "parquet":
        path = tmp_path / "d.parquet"
        pd.DataFrame({"text": texts}).to_parquet(path)
    else:
        path = tmp_path / "docs"
        path.mkdir()
        for i in range(4):  # each file is one document
            (path / f"{i}.txt").write_text("\n".join(texts[i * 10 : (i + 1) * 10]))
    train, evaluation, columns = prepare_datasets(path, tok, 16, eval_split=0.25, seed=0)
    assert columns.text == "text" and evaluation is not None
    stream = []
    for block in (*train, *evaluation):
        assert len(block["input_ids"]) == 16 and block["labels"] == block["input_ids"]
        stream += block["input_ids"]
    assert stream.count(256) >= 3  # documents end with <|endoftext|>
    assert len(evaluation) == round((len(train) + len(evaluation)) * 0.25)


def test_prompt_response_masks_the_prompt(tok, tmp_path):
    path = tmp_path / "qa.jsonl"
    rows = [{"question": "Q?", "answer": "A!"}, {"question": "R?", "answer": "B!"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, _, columns = prepare_datasets(path, tok, 4)
    assert (columns.prompt, columns.response) == ("question", "answer")
    ids = [t for b in train for t in b["input_ids"]]
    labels = [t for b in train for t in b["labels"]]
    assert ids[:5] == [ord("Q"), ord("?"), ord("A"), ord("!"), 256]
    assert labels[:5] == [-100, -100, ord("A"), ord("!"), 256]
    train, _, _ = prepare_datasets(path, tok, 4, train_on_prompt=True)
    assert [t for b in train for t in b["labels"]][:2] == [ord("Q"), ord("?")]


def test_packed_prompt_response_pairs_keep_each_pair_whole_and_alone(tok, tmp_path):
    """With ``pack`` a pair is not run together with the ones around it: each is whole in
    one block (prompt, response, end of text), its prompt without loss and its first label
    -100, positions restarting at each pair and at the padding; pairs too long for a block
    are cut, and one whose response lies past the cut is left out."""
    path = tmp_path / "qa.jsonl"
    rows = [{"question": "Q" * (i % 7 + 1) + "?", "answer": "A" * (i % 5 + 1)} for i in range(30)]
    rows.append({"question": "L" * 40, "answer": "late"})  # its answer past a 32-token block
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    packed, _, _ = prepare_datasets(path, tok, 32, pack=True)
    assert packed.column_names == ["input_ids", "labels", "position_ids"]
    pairs = []
    for b in packed:
        pos = b["position_ids"]
        starts = [i for i, p in enumerate(pos) if p == 0] + [32]
        for a, z in zip(starts, starts[1:]):
            assert pos[a:z] == list(range(z - a))
            pairs.append((b["input_ids"][a:z], b["labels"][a:z]))
        if set(pairs[-1][0]) == {tok.pad_token_id}:
            assert set(pairs.pop()[1]) == {-100}
    assert len(pairs) == 30
    for (ids, labels), row in zip(pairs, rows):
        q, a = list(row["question"].encode()), list(row["answer"].encode())
        assert ids == q + a + [tok.eos_token_id]
        assert labels == [-100] * len(q) + a + [tok.eos_token_id]
    lengths = [len(r["question"]) + len(r["answer"]) + 1 for r in rows[:30]]
    fill, expected = 32, 0
    for n in lengths:
        if fill + n > 32:
            fill, expected = 0, expected + 1
        fill += n
    assert len(packed) == expected


def test_column_choice():
    assert choose_columns(["id", "content"]).text == "content"
    pair = choose_columns(["prompt", "completion", "x"])
    assert (pair.prompt, pair.response) == ("prompt", "completion")
    named = choose_columns(["a", "b"], prompt_column="a", response_column="b")
    assert (named.prompt, named.response) == ("a", "b")
    with pytest.raises(DataError, match="no text column"):
        choose_columns(["a", "b"])
    with pytest.raises(DataError, match="has no column 'body'"):
        choose_columns(["text"], text_column="body")
    with pytest.raises(DataError, match="either a text column or a prompt/response pair"):
        choose_columns(["text", "prompt"], text_column="text", prompt_column="prompt")


def test_bad_data(tok, tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "x"\n')
    expected = r"broken.jsonl, line 1, column 13: not valid JSON \(Expecting ',' delimiter\)"
    with pytest.raises(DataError, match=expected):
        load_raw_dataset(broken)
    # Lines counted from 1, blank ones too (the reader says "row 2" and skips blanks).
    third = tmp_path / "third.jsonl"
    third.write_text('{"text": "a"}\n\n{"text": bad}\n{"text": "b"}\n')
    expected = r"third.jsonl, line 3, column 10: not valid JSON \(Expecting value\)"
    with pytest.raises(DataError, match=expected):
        load_raw_dataset(third)
    # In a folder, an empty file next to a broken one is not what failed.
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.jsonl").write_text("")
    (folder / "b.jsonl").write_text('{"text": "a"}\n{"text": "b\rc"}\n')  # a raw CR
    expected = r"b.jsonl, line 2, column 12: not valid JSON \(Invalid control"
    with pytest.raises(DataError, match=expected):
        load_raw_dataset(folder)
    (folder / "b.jsonl").write_text("\n")
    with pytest.raises(DataError, match=f"dataset {folder} is empty"):
        load_raw_dataset(folder)
    for name, text in (("empty.jsonl", ""), ("blank.jsonl", "\n  \n"), ("empty.json", "")):
        (tmp_path / name).write_text(text)
        with pytest.raises(DataError, match=f"dataset .*{name} is empty"):
            load_raw_dataset(tmp_path / name)
    (tmp_path / "header.csv").write_text("text\n")
    with pytest.raises(DataError, match=r"header.csv is empty \(no rows\)"):
        load_raw_dataset(tmp_path / "header.csv")
    import pandas as pd

    pd.DataFrame({"text": pd.Series([], dtype=str)}).to_parquet(tmp_path / "none.parquet")
    with pytest.raises(DataError, match=r"none.parquet is empty \(no rows\)"):
        load_raw_dataset(tmp_path / "none.parquet")
    odd = tmp_path / "data.xlsx"
    odd.write_text("x")
    with pytest.raises(DataError, match="unknown file type"):
        load_raw_dataset(odd)
    with pytest.raises(DataError, match="no such file"):
        load_raw_dataset(tmp_path / "missing.jsonl")
    expected = r"could not be loaded from the local cache \(HF_HUB_OFFLINE is set\): it is not in"
    with pytest.raises(DataError, match=expected):
        load_raw_dataset("someone/no-such-dataset")  # a hub id, offline: datasets' None dropped
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(DataError, match="no block of 64 tokens"):
        prepare_datasets(short, tok, 64)
    with pytest.raises(DataError, match="too few to hold out"):
        prepare_datasets(short, tok, 4, eval_split=0.5)


def test_values_that_are_not_text(tok, tmp_path):
    """Strings, numbers and UTF-8 bytes are text; null is empty; lists and records (chat
    messages) are refused by name, not trained on as their Python repr."""
    import pandas as pd

    mixed = tmp_path / "mixed.jsonl"
    rows = [{"text": "ab"}, {"text": 12}, {"text": None}, {"text": 1.5}]
    mixed.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, _, _ = prepare_datasets(mixed, tok, 2)
    ids = [t for b in train for t in b["input_ids"]]
    eos = tok.eos_token_id
    # "ab" eos "12" eos (null:) eos "1.5" eos = 11 tokens: five blocks of 2
    assert ids == [*b"ab", eos, *b"12", eos, eos, *b"1.5"]
    raw = tmp_path / "bytes.parquet"
    pd.DataFrame({"text": [b"h\xc3\xa9", b"xy"]}).to_parquet(raw)
    train, _, _ = prepare_datasets(raw, tok, 3)
    assert [t for b in train for t in b["input_ids"]] == [*"hé".encode(), eos, *b"xy"]
    pd.DataFrame({"text": [b"\xe9t\xe9"]}).to_parquet(raw)
    with pytest.raises(DataError, match=r"column 'text' holds bytes that are not UTF-8 text"):
        prepare_datasets(raw, tok, 2)
    chat = tmp_path / "chat.jsonl"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    chat.write_text(json.dumps({"messages": messages}) + "\n")
    expected = rf"dataset {chat}: column 'messages' holds list values, not text \(chat"
    with pytest.raises(DataError, match=expected):
        prepare_datasets(chat, tok, 2, text_column="messages")
    record = tmp_path / "record.jsonl"
    record.write_text(json.dumps({"text": {"a": "b"}}) + "\n")
    with pytest.raises(DataError, match="column 'text' holds dict values"):
        prepare_datasets(record, tok, 2)


def test_data_that_gives_no_tokens_or_is_not_utf8(tok, tmp_path):
    nulls = tmp_path / "nulls.jsonl"
    nulls.write_text('{"text": null}\n{"text": ""}\n' * 50)  # 100 end-of-text tokens
    with pytest.raises(DataError, match=r"nulls.jsonl gives no tokens from its text column"):
        prepare_datasets(nulls, tok, 4)
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"text": "caf\xe9"}\n')  # the json reader lets the byte through
    with pytest.raises(DataError, match=r"latin1.jsonl is not UTF-8 text \('utf-8' codec"):
        prepare_datasets(latin1, tok, 2)
    # A folder named like a data file inside a dataset folder is not read as one.
    folder = tmp_path / "docs"
    (folder / "more.jsonl").mkdir(parents=True)
    (folder / "a.jsonl").write_text('{"text": "abcd"}\n')
    train, _, _ = prepare_datasets(folder, tok, 5)
    assert len(train) == 1


def test_blocks_without_a_response_token_are_left_out(tok, tmp_path):
    """A prompt longer than a block leaves blocks with no label to learn: they would be
    steps of zero loss and zero gradient."""
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"prompt": "p" * 10, "response": "r"}) + "\n")
    train, _, _ = prepare_datasets(path, tok, 4)  # 12 tokens: pppp pppp pprE
    assert [b["input_ids"] for b in train] == [[*b"pp", ord("r"), tok.eos_token_id]]
    assert [b["labels"] for b in train] == [[-100, -100, ord("r"), tok.eos_token_id]]
    train, _, _ = prepare_datasets(path, tok, 4, train_on_prompt=True)
    assert len(train) == 3
    with pytest.raises(DataError, match="no block of 8 tokens with a response token in it"):
        prepare_datasets(path, tok, 8)


def test_a_folder_written_by_save_to_disk(tok, tmp_path):
    import datasets

    rows = {"text": ["abcd", "efgh"], "id": [1, 2]}
    datasets.Dataset.from_dict(rows).save_to_disk(tmp_path / "one")
    train, _, columns = prepare_datasets(tmp_path / "one", tok, 5)
    assert columns.text == "text"
    assert [b["input_ids"] for b in train] == [[*b"abcd", 256], [*b"efgh", 256]]
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)})
    splits.save_to_disk(tmp_path / "dict")
    assert len(prepare_datasets(tmp_path / "dict", tok, 5)[0]) == 2
    datasets.DatasetDict({"test": datasets.Dataset.from_dict(rows)}).save_to_disk(tmp_path / "t")
    with pytest.raises(DataError, match=r"has no train split \(its splits: test\)"):
        load_raw_dataset(tmp_path / "t")


# ------------------------------------------------------------------------------ chat data
CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "and?"},
    {"role": "assistant", "content": "ok"},
]


def _chat_tok():
    tok = byte_tokenizer()  # no template of its own: zerotune's default
    from zerotune.hf.data import DEFAULT_CHAT_TEMPLATE

    tok.chat_template = DEFAULT_CHAT_TEMPLATE
    return tok


def test_chat_loss_is_on_the_assistant_turns_only():
    """The known example: with the default template only 'yo', 'ok', each followed by the
    end-of-turn token and its newline, carry loss; with train_on_prompt every token."""
    from zerotune.hf.data import chat_loss_mask

    tok = _chat_tok()
    ids, labels = chat_loss_mask(tok, CHAT)
    assert tok.decode(ids) == (
        "<|system|>\nbe brief<|endoftext|>\n<|user|>\nhi<|endoftext|>\n"
        "<|assistant|>\nyo<|endoftext|>\n<|user|>\nand?<|endoftext|>\n"
        "<|assistant|>\nok<|endoftext|>\n"
    )
    eos = tok.eos_token_id
    learned = [(i, t) for i, (t, label) in enumerate(zip(ids, labels)) if label != -100]
    assert [t for _, t in learned] == [*b"yo", eos, 10, *b"ok", eos, 10]
    assert all(labels[i] == t for i, t in learned)  # labels are the ids themselves
    # The positions: right after each "<|assistant|>\n".
    text = tok.decode(ids)
    before = text[: text.index("yo")]  # one token a byte, but <|endoftext|> is one token
    assert learned[0][0] == len(before.encode()) - 2 * (len("<|endoftext|>") - 1)
    _, everything = chat_loss_mask(tok, CHAT, train_on_prompt=True)
    assert everything == ids


def test_chat_shapes_and_blocks(tmp_path):
    """messages and ShareGPT conversations give the same blocks; each block is one
    conversation, cut at the block size and padded (attention 0, labels -100); one whose
    answer lies past the block size is left out."""
    from zerotune.hf.data import chat_loss_mask

    tok = _chat_tok()
    short = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    late = [{"role": "user", "content": "x" * 80}, {"role": "assistant", "content": "y"}]
    rows = [{"messages": CHAT}, {"messages": short}, {"messages": late}]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    shared = [
        {
            "conversations": [
                {"from": names[m["role"]], "value": m["content"]} for m in r["messages"]
            ]
        }
        for r in rows
    ]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in shared))
    block = 64
    results = []
    for name in ("m.jsonl", "s.jsonl"):
        train, _, columns = prepare_datasets(tmp_path / name, tok, block)
        assert columns.chat == ("messages" if name == "m.jsonl" else "conversations")
        results.append([dict(b) for b in train])
    assert results[0] == results[1]
    blocks = results[0]
    assert len(blocks) == 2  # `late` has its answer past 64 tokens
    for b, messages in zip(blocks, (CHAT, short)):
        ids, labels = chat_loss_mask(tok, messages)
        n = min(len(ids), block)
        assert b["input_ids"][:n] == ids[:n] and b["labels"][:n] == labels[:n]
        assert b["attention_mask"] == [1] * n + [0] * (block - n)
        assert set(b["input_ids"][n:]) <= {tok.pad_token_id}
        assert set(b["labels"][n:]) <= {-100}
    # CHAT is longer than 64 tokens: cut; its second answer is past the cut.
    assert len(chat_loss_mask(tok, CHAT)[0]) > block
    assert sum(t != -100 for t in blocks[0]["labels"]) == 4  # "yo", end-of-turn, newline
    assert sum(t != -100 for t in blocks[1]["labels"]) == 3


def test_chat_refusals(tmp_path):
    tok = _chat_tok()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"speaker": "me", "text": "hi"}]}) + "\n")
    with pytest.raises(DataError, match="messages are \\{'role', 'content'\\}"):
        prepare_datasets(bad, tok, 16)
    bad.write_text(json.dumps({"messages": "hi"}) + "\n")
    with pytest.raises(DataError, match="holds str values, not lists of messages"):
        prepare_datasets(bad, tok, 16)
    # Content parts (a list) are not text: said as such, not "name the column".
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    bad.write_text(json.dumps({"messages": parts}) + "\n")
    with pytest.raises(DataError, match="a message's content must be text"):
        prepare_datasets(bad, tok, 16)
    # A template that refuses a conversation (raise_exception, as Gemma's does for a
    # system turn) or does not parse: a DataError, not jinja2's traceback.
    strict = byte_tokenizer()
    strict.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    with_system = tmp_path / "system.jsonl"
    with_system.write_text(json.dumps({"messages": CHAT}) + "\n")
    with pytest.raises(DataError, match="cannot render a conversation \\(System role"):
        prepare_datasets(with_system, strict, 64)
    strict.chat_template = "{% for m in messages %}{{ m.content "
    with pytest.raises(DataError, match="cannot render a conversation"):
        prepare_datasets(with_system, strict, 64)
    # A template that renders the turns backwards cannot be split into turns.
    tok.chat_template = (
        "{% for m in messages|reverse %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"messages": CHAT[1:3]}) + "\n")
    with pytest.raises(DataError, match="--chat-template"):
        prepare_datasets(good, tok, 64)
    train, _, _ = prepare_datasets(good, tok, 64, train_on_prompt=True)  # every token
    assert sum(t != -100 for t in train[0]["labels"]) == sum(train[0]["attention_mask"])
    # Without a template: zerotune's default, set on the tokenizer (saved with it).
    plain = byte_tokenizer()
    prepare_datasets(good, plain, 64)
    from zerotune.hf.data import DEFAULT_CHAT_TEMPLATE

    assert plain.chat_template == DEFAULT_CHAT_TEMPLATE


def test_conversational_prompt_completion_trains_on_the_completion_only(tmp_path):
    """TRL's conversational prompt/completion: message lists in both columns; an assistant
    turn inside the prompt carries no loss, the completion's does."""
    from zerotune.hf.data import chat_loss_mask

    tok = _chat_tok()
    prompt, completion = CHAT[:4], CHAT[4:]  # the prompt holds an earlier assistant turn
    path = tmp_path / "pc.jsonl"
    path.write_text(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    train, _, columns = prepare_datasets(path, tok, 128)
    assert (columns.prompt, columns.response) == ("prompt", "completion")
    (block,) = list(train)
    learned = [t for t in block["labels"] if t != -100]
    assert learned == [*b"ok", tok.eos_token_id, 10]  # "yo" is in the prompt: no loss
    ids, _ = chat_loss_mask(tok, CHAT)
    assert block["input_ids"][: len(ids)] == ids


# ------------------------------------------------------------------- packed conversations
def _conversations(n: int):
    """``n`` short conversations of different lengths (seeded)."""
    import random

    rng = random.Random(3)
    words = ["yes", "no", "maybe", "hello there", "fine", "why not", "ok then"]
    out = []
    for i in range(n):
        turns = [{"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(1, 4)))}]
        turns.append({"role": "assistant", "content": " ".join(rng.choices(words, k=i % 5 + 1))})
        out.append({"messages": turns})
    return out


def test_packed_conversations_share_blocks_and_restart_their_positions(tmp_path):
    """With ``pack`` consecutive conversations fill a block while they fit: the blocks hold
    the same conversations in the same order as the padded ones, with positions restarting
    at each conversation (and the padding), no attention mask, and each conversation's
    first label -100."""
    tok = _chat_tok()
    rows = _conversations(40)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    block = 256
    alone, _, _ = prepare_datasets(tmp_path / "c.jsonl", tok, block)
    packed, _, _ = prepare_datasets(tmp_path / "c.jsonl", tok, block, pack=True)
    assert packed.column_names == ["input_ids", "labels", "position_ids"]
    # Next fit: a block is closed when the next conversation does not fit in it.
    lengths = [sum(b["attention_mask"]) for b in alone]
    fill, expected = block, 0
    for n in lengths:
        if fill + n > block:
            fill, expected = 0, expected + 1
        fill += n
    assert len(alone) == 40 and len(packed) == expected < 20, (len(packed), expected)
    conversations = []  # (ids, labels) back out of the packed blocks, by their positions
    pad = tok.pad_token_id
    for b in packed:
        ids, labels, pos = b["input_ids"], b["labels"], b["position_ids"]
        assert len(ids) == len(labels) == len(pos) == block
        starts = [i for i, p in enumerate(pos) if p == 0] + [block]
        for a, z in zip(starts, starts[1:]):
            assert pos[a:z] == list(range(z - a))
            conversations.append((ids[a:z], labels[a:z]))
        if set(conversations[-1][0]) == {pad}:  # the padding: no loss
            assert set(conversations.pop()[1]) == {-100}
    # Every conversation, whole and in order.
    real = conversations
    for (ids, labels), b in zip(real, alone):
        n = sum(b["attention_mask"])
        assert ids == b["input_ids"][:n]
        assert labels[0] == -100 and labels[1:] == b["labels"][1:n]


def _tiny_configs():
    """One tiny config per model family: those in PACKABLE, and three whose packed
    conversations would see each other (OPT and Bloom take their positions from the
    attention mask; GPT-OSS)."""
    import transformers as T

    h = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=300)
    moe = dict(num_local_experts=2, num_experts_per_tok=1)
    return {
        "gpt2": T.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=300),
        "llama": T.LlamaConfig(**h, intermediate_size=64, num_key_value_heads=2),
        "mistral": T.MistralConfig(**h, intermediate_size=64, num_key_value_heads=2),
        "mixtral": T.MixtralConfig(**h, intermediate_size=64, num_key_value_heads=2, **moe),
        "qwen2": T.Qwen2Config(**h, intermediate_size=64, num_key_value_heads=2),
        "qwen3": T.Qwen3Config(**h, intermediate_size=64, num_key_value_heads=2, head_dim=8),
        "gemma2": T.Gemma2Config(**h, intermediate_size=64, num_key_value_heads=2, head_dim=8),
        "phi3": T.Phi3Config(**h, intermediate_size=64, num_key_value_heads=2, pad_token_id=0),
        "gpt_neox": T.GPTNeoXConfig(**h, intermediate_size=64),
        "falcon": T.FalconConfig(**h),
        "gptj": T.GPTJConfig(n_embd=32, n_layer=2, n_head=4, vocab_size=300, rotary_dim=4),
        "olmo2": T.Olmo2Config(**h, intermediate_size=64),
        "qwen2_moe": T.Qwen2MoeConfig(
            **h,
            intermediate_size=64,
            num_key_value_heads=2,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            shared_expert_intermediate_size=16,
        ),
        "qwen3_moe": T.Qwen3MoeConfig(
            **h,
            intermediate_size=64,
            num_key_value_heads=2,
            head_dim=8,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
        ),
        "olmoe": T.OlmoeConfig(
            **h, intermediate_size=64, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2
        ),
        "deepseek_v3": T.DeepseekV3Config(
            **h,
            intermediate_size=64,
            num_key_value_heads=4,
            moe_intermediate_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
        ),
        "gemma3_text": T.Gemma3TextConfig(
            **h, intermediate_size=64, num_key_value_heads=2, head_dim=8
        ),
        "granite": T.GraniteConfig(**h, intermediate_size=64, num_key_value_heads=2),
        "olmo3": T.Olmo3Config(**h, intermediate_size=64, num_key_value_heads=2),
        "glm4_moe": T.Glm4MoeConfig(
            **h,
            intermediate_size=64,
            num_key_value_heads=2,
            moe_intermediate_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            head_dim=8,
        ),
        "opt": T.OPTConfig(**h, ffn_dim=64, word_embed_proj_dim=32),
        "bloom": T.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=300),
        "gpt_oss": T.GptOssConfig(
            **h,
            intermediate_size=64,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            head_dim=8,
        ),
    }


def test_a_packed_block_gives_each_conversation_its_own_logits(tmp_path):
    """For every model type ``--packing`` takes, the logits of each conversation in a packed
    block (training mode, dropout off, the collator's batch) equal those of the conversation
    run alone; for OPT, Bloom and GPT-OSS, which ``--packing`` refuses, they do not."""
    import torch
    from transformers import AutoModelForCausalLM

    from zerotune.hf.data import PACKABLE, packed_collator

    tok = _chat_tok()
    rows = _conversations(12)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    packed, _, _ = prepare_datasets(tmp_path / "c.jsonl", tok, 96, pack=True)
    batch = packed_collator([packed[0], packed[1]])
    assert batch["use_cache"] is False and "attention_mask" not in batch
    configs = _tiny_configs()
    assert set(configs) - {"opt", "bloom", "gpt_oss"} == PACKABLE
    for name, config in configs.items():
        for key in ("dropout", "attention_dropout", "hidden_dropout", "resid_pdrop",
                    "embd_pdrop", "attn_pdrop"):  # fmt: skip
            if hasattr(config, key):
                setattr(config, key, 0.0)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).train()
        with torch.no_grad():
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
            worst = 0.0
            for row in range(2):
                pos = batch["position_ids"][row].tolist()
                starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
                for a, z in zip(starts, starts[1:]):
                    alone = model(input_ids=batch["input_ids"][row : row + 1, a:z]).logits
                    worst = max(worst, (logits[row, a:z] - alone[0]).abs().max().item())
        assert (worst < 1e-4) == (name in PACKABLE), (name, worst)


def test_packed_blocks_reach_the_model_with_their_positions(tmp_path):
    """ZeroTrainer's data loader keeps ``position_ids`` (the Trainer drops the columns the
    model's forward does not take) and the collator turns the cache off."""
    from conftest import tiny_gpt2

    from zerotune.hf import ZeroTrainer, ZeroTrainingArguments
    from zerotune.hf.data import packed_collator

    tok = _chat_tok()
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _conversations(12)))
    packed, _, _ = prepare_datasets(tmp_path / "c.jsonl", tok, 96, pack=True)
    args = ZeroTrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, report_to="none",
        use_cpu=True, zero_stage=3,
    )  # fmt: skip
    trainer = ZeroTrainer(
        model=tiny_gpt2(seed=0, vocab_size=300),
        args=args,
        train_dataset=packed,
        data_collator=packed_collator,
    )
    batch = next(iter(trainer.get_train_dataloader()))
    assert sorted(batch) == ["input_ids", "labels", "position_ids", "use_cache"]
    assert batch["position_ids"].shape == (2, 96) and batch["use_cache"] is False
    rows = {tuple(packed[i]["position_ids"]) for i in range(len(packed))}
    assert all(tuple(r) in rows for r in batch["position_ids"].tolist())
    trainer.close()
