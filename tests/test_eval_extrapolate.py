"""eval_extrapolate.py on tiny models and a small generated stream dataset with document offsets."""

import csv
import math
import os
from dataclasses import asdict

import numpy as np
import pytest
import torch

import eval_extrapolate as ee
from checkpoint import load_run
from model import GPT, GPTConfig
from prepare.common import BinWriter, write_meta

VOCAB = 16
LENGTHS = [16, 32, 64]
DOCS = [300, 40, 200, 64, 130]  # document lengths: 40 and 64 are shorter than a chunk of 65 tokens


def make_dataset(root, name="toy", docs=DOCS, with_offsets=True):
    """A stream dataset: a periodic pattern with noise, documents of the given lengths."""
    rng = np.random.default_rng(0)
    n = sum(docs)
    tokens = (np.arange(n) * 3 % VOCAB + (rng.random(n) < 0.2) * rng.integers(0, VOCAB, n)) % VOCAB
    out = os.path.join(root, name)
    with BinWriter(os.path.join(out, "test.bin"), np.uint8) as w:
        w.write(tokens)
    meta = {"dataset": name, "vocab_size": VOCAB, "dtype": "uint8", "layout": "stream",
            "splits": {"test": {"file": "test.bin", "shape": [n], "tokens": n}}, "pad_id": None, "loss": "all",
            "tokenizer": {"kind": "toy"}}
    if with_offsets:
        with BinWriter(os.path.join(out, "test.docs.bin"), np.int64) as d:
            d.write(np.concatenate([[0], np.cumsum(docs)]))
        meta["documents"] = {"test": {"file": "test.docs.bin", "dtype": "int64", "n_docs": len(docs)}}
    write_meta(out, meta)
    return tokens


def make_run(path, pos_encoding, block_size=16, seed=0, **kw):
    """A run folder with a tiny random model whose weights are scaled up, so that attention is far from
    uniform and the positions matter."""
    torch.manual_seed(seed)
    cfg = GPTConfig(block_size=block_size, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=16,
                    pos_encoding=pos_encoding, **kw)
    model = GPT(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("c_attn.weight"):
                p.mul_(20)
    os.makedirs(path, exist_ok=True)
    torch.save({"model": model.state_dict(), "model_args": asdict(cfg), "config": {"dataset": "toy"},
                "tokenizer": {"dataset": "toy", "vocab_size": VOCAB, "pad_id": None, "tokenizer": {"kind": "toy"}}},
               os.path.join(path, "best.pt"))
    return str(path)


@pytest.fixture
def setup(tmp_path):
    tokens = make_dataset(str(tmp_path / "data"))
    runs = [make_run(tmp_path / "run-rope", "rope", seed=1), make_run(tmp_path / "run-pope", "pope", seed=2)]
    common = [f"--data_root={tmp_path / 'data'}", "--dataset=toy", "--lengths=16,32,64", "--last_k=8",
              f"--out_dir={tmp_path / 'out'}", "--device=cpu"]
    return tmp_path, tokens, runs, common


def test_windows_stay_inside_documents_and_end_together():
    off = np.concatenate([[0], np.cumsum(DOCS)])
    starts = ee.chunk_starts(off, 64)
    # chunks of 65 tokens stepping by 64 from each document's start; 40 and 64 are too short
    assert starts.tolist() == [0, 64, 128, 192, 340, 404, 468, 604, 668]
    for s in starts:
        doc = np.searchsorted(off, s, side="right") - 1
        assert s + 65 <= off[doc + 1]
    for L in LENGTHS:
        offs = ee.window_offsets(L, 64)
        assert offs[0] + L == 64  # window 0 ends at the chunk's end: same targets at every length
        spans = sorted((o, o + L) for o in offs)  # input spans; targets are shifted by one
        assert spans[0][0] >= 0 and all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and len(spans) == 64 // L
    # a budget draws the same chunks for the same seed, other chunks for another seed
    a, b = ee.chunk_starts(off, 64, 192, seed=3), ee.chunk_starts(off, 64, 192, seed=3)
    assert a.tolist() == b.tolist() and len(a) == 3
    assert any(ee.chunk_starts(off, 64, 192, seed=s).tolist() != a.tolist() for s in range(4, 10))


def test_same_windows_reference_ppl_table_csv_png(setup, monkeypatch, capsys):
    tmp_path, tokens, runs, common = setup
    seen = {}  # encoding -> list of input windows its model received
    real = ee.token_losses

    def spy(model, x, y):
        seen.setdefault(model.config.pos_encoding, []).append(x.clone())
        return real(model, x, y)
    monkeypatch.setattr(ee, "token_losses", spy)
    rows = ee.run([*runs, *common, "--max_tokens=192", "--seed=5"])
    assert len(rows) == 2 * len(LENGTHS)
    out = capsys.readouterr().out
    assert "| 64 | 192 |" in out and "| 16 | 24 |" in out  # tokens: 3 chunks x 64; last-8 view: 3 x 8
    assert "rope (run-rope)" in out and "pope (run-pope)" in out
    for r in rows:
        assert r["tokens"] == 3 * (64 // r["length"]) * r["length"]  # 3 chunks within the 192-token budget
        assert math.isfinite(r["ppl"]) and r["ppl"] > 1 and math.isfinite(r["last_loss"])
    a, b = seen.values()
    assert len(a) == len(b) == 3 * len(LENGTHS) and all(torch.equal(x, y) for x, y in zip(a, b))

    # independent reference: the first chunk chosen, windows cut by hand, the model's own forward loss
    model, _ = load_run(runs[1])
    t = torch.from_numpy(tokens.astype(np.int64))
    for r in [r for r in rows if r["run"] == runs[1]]:
        L = r["length"]
        total, last = 0.0, 0.0
        for s in ee.chunk_starts(np.concatenate([[0], np.cumsum(DOCS)]), 64, 192, seed=5).tolist():
            for w in range(64 // L):
                a0 = s + 64 - (w + 1) * L
                with torch.no_grad():
                    logits, loss = model(t[a0:a0 + L][None], t[a0 + 1:a0 + L + 1][None])
                total += loss.item() * L
                if w == 0:
                    last += torch.nn.functional.cross_entropy(logits[0, -8:], t[a0 + L - 7:a0 + L + 1]).item()
        assert r["ppl"] == pytest.approx(math.exp(total / r["tokens"]), rel=1e-5)
        assert r["last_loss"] == pytest.approx(last / 3, rel=1e-5)

    with open(tmp_path / "out" / "extrapolation.csv") as f:
        got = list(csv.DictReader(f))
    assert list(got[0]) == ["run", "label", "length", "tokens", "ppl", "last_loss"]
    assert [g["label"] for g in got] == ["rope"] * 3 + ["pope"] * 3
    assert float(got[4]["ppl"]) == pytest.approx(rows[4]["ppl"], rel=1e-5)
    png = (tmp_path / "out" / "extrapolation.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_yarn_at_eval_time_and_absolute_encodings_left_empty(setup, capsys):
    tmp_path, _, runs, common = setup
    learned = make_run(tmp_path / "run-learned", "learned", block_size=32, seed=3)
    plain = ee.run([runs[0], *common, "--max_tokens=64"])
    rows = ee.run([runs[0], learned, runs[1], *common, "--max_tokens=64", "--rope_scaling=4"])
    out = capsys.readouterr().out
    assert [r["label"] for r in rows[::3]] == ["rope+yarn(s=4)", "learned", "pope"]
    assert "block_size=32: lengths 64 left empty" in out and "--rope_scaling applies to RoPE only" in out
    for p, y in zip(plain, rows[:3]):  # YaRN's frequencies and temperature change every length
        assert math.isfinite(y["ppl"]) and abs(y["ppl"] - p["ppl"]) > 1e-3 * p["ppl"]
    assert [r["ppl"] is None for r in rows[3:6]] == [False, False, True]
    with open(tmp_path / "out" / "extrapolation.csv") as f:
        got = list(csv.DictReader(f))
    assert got[5]["label"] == "learned" and got[5]["ppl"] == got[5]["last_loss"] == got[5]["tokens"] == ""


def test_old_flag_yarn_scale_still_works_with_a_one_line_note(setup, capsys):
    """--yarn_scale (before the flag took train.py's name, --rope_scaling) gives the same numbers."""
    tmp_path, _, runs, common = setup
    new = ee.run([runs[0], *common, "--max_tokens=64", "--rope_scaling=4"])
    assert capsys.readouterr().err.count("deprecated") == 0
    old = ee.run([runs[0], *common, "--max_tokens=64", "--yarn_scale=4"])
    notes = [line for line in capsys.readouterr().err.splitlines() if "deprecated" in line]
    assert notes == ["note: --yarn_scale is deprecated, use --rope_scaling (same meaning)"]
    assert [r["label"] for r in old] == ["rope+yarn(s=4)"] * 3 and old == new


@pytest.mark.parametrize("case, message", [
    ("no_best", "no checkpoint at"),
    ("unknown_dataset", "unknown dataset 'nope'"),
    ("zero_length", "positive"),
    ("negative_length", "positive"),
    ("too_long", "needs a document of at least 301 tokens"),
    ("bad_flag", "unrecognized arguments"),
])
def test_bad_input_exits_2_with_one_line(setup, case, message, capsys):
    tmp_path, _, runs, common = setup
    args = {"no_best": [str(tmp_path), *common],
            "unknown_dataset": [*runs, *common, "--dataset=nope"],
            "zero_length": [*runs, *common, "--lengths=0,16"],
            "negative_length": [*runs, *common, "--lengths=-16"],
            "too_long": [*runs, *common, "--lengths=16,300"],
            "bad_flag": [*runs, *common, "--bogus=1"]}[case]
    with pytest.raises(SystemExit) as e:
        ee.main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
