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
    odd = tmp_path / "data.xlsx"
    odd.write_text("x")
    with pytest.raises(DataError, match="unknown file type"):
        load_raw_dataset(odd)
    with pytest.raises(DataError, match="no such file"):
        load_raw_dataset(tmp_path / "missing.jsonl")
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(DataError, match="no block of 64 tokens"):
        prepare_datasets(short, tok, 64)
    with pytest.raises(DataError, match="too few to hold out"):
        prepare_datasets(short, tok, 4, eval_split=0.5)
