"""eval_extrapolate.py on tiny models and a small generated stream dataset with document offsets."""

import csv
import math
import os
import subprocess
from dataclasses import asdict

import numpy as np
import pytest
import torch

import eval_extrapolate as ee
import provenance
from checkpoint import load_run
from model import GPT, GPTConfig
from prepare.common import BinWriter, write_meta

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VOCAB = 16
LENGTHS = [16, 32, 64]
DOCS = [300, 40, 200, 64, 130]  # document lengths: 40 and 64 are shorter than a chunk of 65 tokens


def exit_code(argv):
    """ee.main's exit status: it returns on success and raises SystemExit(2) on bad input."""
    try:
        ee.main(argv)
    except SystemExit as e:
        return e.code
    return 0


def make_dataset(root, name="toy", docs=DOCS, with_offsets=True):
    """A stream dataset: a periodic pattern with noise, documents of the given lengths."""
    rng = np.random.default_rng(0)
    n = sum(docs)
    tokens = (np.arange(n) * 3 % VOCAB + (rng.random(n) < 0.2) * rng.integers(0, VOCAB, n)) % VOCAB
    out = os.path.join(root, name)
    with BinWriter(os.path.join(out, "test.bin"), np.uint8) as w:
        w.write(tokens)
    meta = {
        "dataset": name,
        "vocab_size": VOCAB,
        "dtype": "uint8",
        "layout": "stream",
        "splits": {"test": {"file": "test.bin", "shape": [n], "tokens": n}},
        "pad_id": None,
        "loss": "all",
        "tokenizer": {"kind": "toy"},
    }
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
    cfg = GPTConfig(
        block_size=block_size, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=16, pos_encoding=pos_encoding, **kw
    )
    model = GPT(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("c_attn.weight"):
                p.mul_(20)
    os.makedirs(path, exist_ok=True)
    torch.save(
        {
            "model": model.state_dict(),
            "model_args": asdict(cfg),
            "config": {"dataset": "toy"},
            "tokenizer": {"dataset": "toy", "vocab_size": VOCAB, "pad_id": None, "tokenizer": {"kind": "toy"}},
        },
        os.path.join(path, "best.pt"),
    )
    return str(path)


@pytest.fixture
def setup(tmp_path):
    tokens = make_dataset(str(tmp_path / "data"))
    runs = [make_run(tmp_path / "run-rope", "rope", seed=1), make_run(tmp_path / "run-pope", "pope", seed=2)]
    common = [
        f"--data_root={tmp_path / 'data'}",
        "--dataset=toy",
        "--lengths=16,32,64",
        "--last_k=8",
        f"--out_dir={tmp_path / 'out'}",
        "--device=cpu",
    ]
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
                    logits, loss = model(t[a0 : a0 + L][None], t[a0 + 1 : a0 + L + 1][None])
                total += loss.item() * L
                if w == 0:
                    last += torch.nn.functional.cross_entropy(logits[0, -8:], t[a0 + L - 7 : a0 + L + 1]).item()
        assert r["ppl"] == pytest.approx(math.exp(total / r["tokens"]), rel=1e-5)
        assert r["last_loss"] == pytest.approx(last / 3, rel=1e-5)

    with open(tmp_path / "out" / "extrapolation.csv") as f:
        got = list(csv.DictReader(f))
    assert list(got[0]) == [
        "run",
        "label",
        "protocol",
        "one_document",
        "length",
        "tokens",
        "ppl",
        "ppl_window_mean",
        "last_loss",
        "commit",
        "libraries",
        "machine",
        "threads",
        "world_size",
        "data_digest",
    ]
    # every row says where it was scored: this checkout's commit, this torch, this CPU, the data's digest
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert {g["commit"].removesuffix("+dirty") for g in got} == {head[:12]}
    assert f"torch {torch.__version__}," in got[0]["libraries"]
    assert got[0]["machine"].startswith(provenance.cpu_model()) and len(got[0]["data_digest"]) == 16
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
    assert [r["label"] for r in rows[::3]] == ["rope+yarn(s=4,code)", "learned", "pope"]
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
    assert [r["label"] for r in old] == ["rope+yarn(s=4,code)"] * 3 and old == new


@pytest.mark.parametrize(
    "case, message",
    [
        ("no_best", "no checkpoint at"),
        ("unknown_dataset", "unknown dataset 'nope'"),
        ("zero_length", "positive"),
        ("negative_length", "positive"),
        ("too_long", "needs a document of at least 301 tokens"),
        ("bad_flag", "unrecognized arguments"),
        ("zero_stride", "--stride must lie in 1 .. the shortest length 16"),
        ("long_stride", "--stride must lie in 1 .. the shortest length 16"),
        ("stride_tiled", "--stride applies to --protocol=sliding only"),
        ("doc_tokens_with_documents", "--doc_tokens must lie in"),
        ("short_documents", "needs a document of at least 301 tokens"),
    ],
)
def test_bad_input_exits_2_with_one_line(setup, case, message, capsys):
    tmp_path, _, runs, common = setup
    args = {
        "no_best": [str(tmp_path), *common],
        "unknown_dataset": [*runs, *common, "--dataset=nope"],
        "zero_length": [*runs, *common, "--lengths=0,16"],
        "negative_length": [*runs, *common, "--lengths=-16"],
        "too_long": [*runs, *common, "--lengths=16,300"],
        "bad_flag": [*runs, *common, "--bogus=1"],
        "zero_stride": [*runs, *common, "--protocol=sliding", "--stride=0"],
        "long_stride": [*runs, *common, "--protocol=sliding", "--stride=17"],
        "stride_tiled": [*runs, *common, "--stride=8"],
        "doc_tokens_with_documents": [*runs, *common, "--doc_tokens=50"],
        "short_documents": [*runs, *common, "--protocol=truncate", "--lengths=16,300"],
    }[case]
    assert exit_code(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "case", ["short_of_the_end", "past_the_end", "not_from_zero", "decreasing", "one_offset", "empty"]
)
def test_document_offsets_that_do_not_cover_the_split_exit_2(setup, case, capsys):
    """test.docs.bin must hold 0 = off[0] <= off[1] <= ... <= off[-1] = len(test.bin) = 734."""
    tmp_path, _, runs, common = setup
    off = np.concatenate([[0], np.cumsum(DOCS)])  # 0 300 340 540 604 734
    bad = {
        "short_of_the_end": np.r_[off[:-1], 700],
        "past_the_end": np.r_[off[:-1], 760],
        "not_from_zero": np.r_[10, off[1:]],
        "decreasing": off[[0, 2, 1, 3, 4, 5]],
        "one_offset": off[:1],
        "empty": off[:0],
    }[case]
    bad.astype(np.int64).tofile(tmp_path / "data" / "toy" / "test.docs.bin")
    assert exit_code([*runs, *common]) == 2
    err = capsys.readouterr().err
    assert "does not hold document offsets 0 .. 734 of test.bin" in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(tmp_path / "out")


def test_one_document_reads_a_split_with_offsets_as_one_and_a_missing_offsets_file_says_what_to_do(setup, capsys):
    """--one_document: a split whose meta.json declares documents is scored as the same tokens prepared without
    offsets (issues 54, 60 and 74 score shakespeare_char so); it reads no offsets file, so it also serves a folder
    whose *.docs.bin was removed. Without it a missing file is one line naming the fix (it was a traceback)."""
    tmp_path, _, runs, common = setup
    make_dataset(str(tmp_path / "data"), name="flat", with_offsets=False)

    def key(rows):
        return [(r["label"], r["length"], r["tokens"], r["ppl"], r["last_loss"]) for r in rows]

    flat = key(ee.run([*runs, *common, "--dataset=flat"]))
    assert key(ee.run([*runs, *common, "--one_document"])) == flat
    with open(tmp_path / "out" / "extrapolation.csv") as f:  # the CSV says how the split was read
        assert {r["one_document"] for r in csv.DictReader(f)} == {"True"}
    assert key(ee.run([*runs, *common])) != flat
    with open(tmp_path / "out" / "extrapolation.csv") as f:
        assert {r["one_document"] for r in csv.DictReader(f)} == {"False"}
    os.remove(tmp_path / "data" / "toy" / "test.docs.bin")
    assert key(ee.run([*runs, *common, "--one_document"])) == flat
    capsys.readouterr()
    assert exit_code([*runs, *common]) == 2
    err = capsys.readouterr().err
    assert "test.docs.bin is missing" in err and "--one_document" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("last_k", [0, 17, 64])
def test_last_k_must_fit_the_shortest_length(setup, last_k, capsys):
    tmp_path, _, runs, common = setup  # lengths 16, 32, 64
    assert exit_code([*runs, *common, f"--last_k={last_k}"]) == 2
    err = capsys.readouterr().err
    assert f"--last_k must lie in 1 .. the shortest length 16, got {last_k}" in err and err.count("\n") == 1, err


def test_last_k_equal_to_the_shortest_length_scores_its_whole_last_window(setup):
    """--last_k=16 at length 16: the last-tokens view is the mean loss of the window that ends at the
    chunk's end, all 16 targets (the one chunk of a 64-token budget)."""
    tmp_path, tokens, runs, common = setup
    rows = ee.run([runs[1], *common, "--max_tokens=64", "--last_k=16"])
    (s,) = ee.chunk_starts(np.concatenate([[0], np.cumsum(DOCS)]), 64, 64)
    t = torch.from_numpy(tokens.astype(np.int64))
    model, _ = load_run(runs[1])
    with torch.no_grad():
        _, loss = model(t[s + 48 : s + 64][None], t[s + 49 : s + 65][None])
    assert rows[0]["length"] == 16 and rows[0]["last_loss"] == pytest.approx(loss.item(), rel=1e-5)


def test_rope_scaling_takes_L_from_the_run_block_size(setup, capsys):
    """--rope_scaling=4 on a RoPE run trained at block_size 16 must equal that run's weights saved as a
    YaRN run with s = 4 and L = 16 (model_args, run as is); L = 64 gives other numbers."""
    tmp_path, _, runs, common = setup
    state = torch.load(os.path.join(runs[0], "best.pt"), weights_only=True)
    assert state["model_args"]["block_size"] == 16
    saved = {}
    for L in (16, 64):
        saved[L] = str(tmp_path / f"run-yarn-{L}")
        os.makedirs(saved[L])
        torch.save(
            {**state, "model_args": {**state["model_args"], "rope_scaling": 4.0, "rope_original_block_size": L}},
            os.path.join(saved[L], "best.pt"),
        )
    rows = ee.run([runs[0], saved[16], saved[64], *common, "--max_tokens=64", "--rope_scaling=4"])
    assert "already YaRN (s=4); --rope_scaling ignored" in capsys.readouterr().out
    ppl = {r: [x["ppl"] for x in rows if x["run"] == r] for r in (runs[0], saved[16], saved[64])}
    assert ppl[runs[0]] == pytest.approx(ppl[saved[16]], rel=1e-6)
    assert max(abs(a / b - 1) for a, b in zip(ppl[saved[64]], ppl[saved[16]])) > 1e-3  # L matters here


def test_a_run_with_another_tokenizer_of_the_same_size_is_refused(char_pretrained, tmp_path, capsys):
    """Runs compared in one table must share the dataset's tokenizer: chars and chars_upper both have
    16 ids (every shape fits), with other symbols. All runs are checked before any is evaluated."""
    pre, data_root = char_pretrained["run"], char_pretrained["data_root"]
    other = tmp_path / "upper"  # the tokenizer a run trained on chars_upper stores
    other.mkdir()
    state = torch.load(os.path.join(pre, "best.pt"), weights_only=True)
    state["tokenizer"] = {
        **state["tokenizer"],
        "dataset": "chars_upper",
        "tokenizer": {"kind": "char", "itos": list(" ,.:ABEHINOQRSTU")},
    }
    torch.save(state, other / "best.pt")
    args = [
        f"--data_root={data_root}",
        "--lengths=8,16",
        "--last_k=4",
        "--max_tokens=32",
        "--device=cpu",
        f"--out_dir={tmp_path / 'out'}",
    ]
    for runs, dataset in (([pre, str(other)], "chars"), ([pre], "chars_upper")):
        assert exit_code([*runs, *args, f"--dataset={dataset}"]) == 2
        err = capsys.readouterr().err
        assert "' ,.:abehinoqrstu'" in err and "' ,.:ABEHINOQRSTU'" in err and err.count("\n") == 1, err
    assert not os.path.exists(tmp_path / "out")
    rows = ee.run([pre, *args, "--dataset=chars_shuffled"])  # another dataset, the same tokenizer: fine
    assert len(rows) == 2 and all(math.isfinite(r["ppl"]) for r in rows)


# ---- protocols: sliding (YaRN / Position Interpolation), truncate ----


def hand_sliding_losses(model, doc, L, S):
    """Reference: the loss of every target t = 1 .. m of doc (m + 1 tokens) from a forward on exactly
    the tokens the sliding protocol promises it: doc[0:t] while t <= L (the first window, never
    before the document's start), else doc[a:t] with a the start of the window whose last S targets
    hold t, a = ceil((t - L) / S) * S, or m - L for the last window, so t - a >= L - S + 1."""
    m = len(doc) - 1
    out = []
    for t in range(1, m + 1):
        a = 0 if t <= L else min(-(-(t - L) // S) * S, m - L)
        assert t - a <= L and (t <= L or t - a >= L - S + 1)
        with torch.no_grad():
            logits, _ = model(doc[a:t][None])
        out.append(-torch.log_softmax(logits[0, -1].double(), -1)[doc[t]].item())
    return torch.tensor(out, dtype=torch.float64)


def test_sliding_windows_score_each_target_once():
    for m, L, S in [(64, 64, 8), (100, 32, 8), (100, 32, 32), (101, 16, 5), (33, 32, 1)]:
        wins = ee.sliding_windows(m, L, S)
        scored = [t for a, n in wins for t in range(a + L - n + 1, a + L + 1)]
        assert scored == list(range(1, m + 1))  # every target once, in order
        assert wins[0] == (0, L) and all(0 <= a and a + L <= m and 0 < n <= S for a, n in wins[1:])
        assert len(wins) == 1 + -(-(m - L) // S)  # L/S forwards per S targets


def test_sliding_stretches_keep_long_documents_and_the_budget():
    off = np.concatenate([[0], np.cumsum(DOCS)])
    whole = dict(ee.sliding_stretches(off, 64))
    assert whole == {0: 299, 340: 199, 604: 129}  # the documents of >= 65 tokens, whole
    for seed in range(10):
        for budget in (1, 100, 140, 300):
            st = ee.sliding_stretches(off, 64, budget, seed)
            assert budget <= sum(m for _, m in st) < budget + 64  # the last one cut, to no fewer than 64
            assert all(a in whole and 64 <= m <= whole[a] for a, m in st)


def test_sliding_equals_hand_loop_of_the_promised_context(tmp_path):
    """A 150-token document, windows of 32 with stride 8 (a last window of 6 targets) and stride 32."""
    tokens = make_dataset(str(tmp_path / "data"), docs=[151])
    model, _ = load_run(make_run(tmp_path / "run", "pope", seed=2))
    doc = torch.from_numpy(tokens.astype(np.int64))
    for L, S in [(32, 8), (32, 32), (16, 5)]:
        ref = hand_sliding_losses(model, doc, L, S)
        got, means = ee.sliding_losses(model, doc, L, S, batch=3)
        assert torch.allclose(got, ref, rtol=0, atol=2e-5), (L, S, (got - ref).abs().max())
        wins = ee.sliding_windows(150, L, S)
        want = [ref[a + L - n : a + L].mean() for a, n in wins]
        assert torch.allclose(means, torch.stack(want), atol=2e-5)
    # the context matters for this model: one token less before each target changes its loss
    with torch.no_grad():
        nll = lambda a, t: -torch.log_softmax(model(doc[a:t][None])[0][0, -1], -1)[doc[t]].item()  # noqa: E731
        assert min(abs(nll(t - 24, t) - nll(t - 23, t)) for t in range(100, 110)) > 1e-3


def test_sliding_run_budget_table_csv(setup, monkeypatch, capsys):
    """run(): the same targets at every length, both perplexities from the hand loop, CSV columns."""
    tmp_path, tokens, runs, common = setup
    rows = ee.run(
        [runs[1], *common, "--lengths=16,32", "--protocol=sliding", "--stride=8", "--max_tokens=200", "--seed=3"]
    )
    captured = capsys.readouterr()
    off = np.concatenate([[0], np.cumsum(DOCS)])
    stretches = ee.sliding_stretches(off, 32, 200, seed=3)
    # documents of >= 33 tokens, shuffled, whole until the budget, the last one cut (to >= 32 targets)
    assert sum(m for _, m in stretches) == 200 and all(a in off[:-1] for a, _ in stretches)
    assert any(ee.sliding_stretches(off, 32, 200, seed=s) != stretches for s in range(4, 10))
    model, _ = load_run(runs[1])
    t = torch.from_numpy(tokens.astype(np.int64))
    n_windows = 0
    for r in rows:
        L = r["length"]
        losses, means = [], []
        for a, m in stretches:
            ref = hand_sliding_losses(model, t[a : a + m + 1], L, 8)
            losses.append(ref)
            means += [ref[b + L - n : b + L].mean().item() for b, n in ee.sliding_windows(m, L, 8)]
        n_windows += len(means)
        assert r["protocol"] == "sliding" and r["tokens"] == 200 and r["last_loss"] is None
        assert r["ppl"] == pytest.approx(math.exp(torch.cat(losses).mean().item()), rel=1e-5)
        assert r["ppl_window_mean"] == pytest.approx(math.exp(np.mean(means)), rel=1e-5)
        assert abs(r["ppl_window_mean"] - r["ppl"]) > 1e-4 * r["ppl"]  # the first window weighs more in YaRN's
    out = captured.out
    assert out.index("token-weighted") < out.index("per-window mean") and "| 32 | 200 |" in out
    assert f"{n_windows}/{n_windows}" in captured.err  # the progress bar counts windows
    with open(tmp_path / "out" / "extrapolation.csv") as f:
        got = list(csv.DictReader(f))
    assert (
        got[1]["protocol"] == "sliding"
        and float(got[1]["ppl_window_mean"]) == pytest.approx(rows[1]["ppl_window_mean"], rel=1e-5)
        and got[1]["last_loss"] == ""
    )


def test_truncate_is_one_forward_on_each_documents_first_tokens(setup, capsys):
    tmp_path, tokens, runs, common = setup
    rows = ee.run([runs[0], *common, "--protocol=truncate", "--max_tokens=128", "--last_k=1000"])  # tiled's only
    model, _ = load_run(runs[0])
    t = torch.from_numpy(tokens.astype(np.int64))
    starts = ee.truncate_starts(np.concatenate([[0], np.cumsum(DOCS)]), 64, 128, seed=1337)
    assert len(starts) == 2 and set(starts.tolist()) <= {0, 340, 604}  # 2 of the documents of >= 65 tokens
    for r in rows:
        L = r["length"]
        total = 0.0
        for s in starts.tolist():
            with torch.no_grad():
                total += model(t[s : s + L][None], t[s + 1 : s + L + 1][None])[1].item() * L
        assert r["tokens"] == 2 * L and r["ppl_window_mean"] is None and r["last_loss"] is None
        assert r["ppl"] == pytest.approx(math.exp(total / (2 * L)), rel=1e-5)
    assert "perplexity over each document's first L tokens" in capsys.readouterr().out

    # a split without document offsets, read as documents of 100 tokens: windows at 0, 100, ..., 600
    make_dataset(str(tmp_path / "data"), name="flat", with_offsets=False)
    flat = ee.run([runs[0], *common, "--dataset=flat", "--protocol=truncate", "--doc_tokens=100", "--lengths=64"])
    total = sum(model(t[s : s + 64][None], t[s + 1 : s + 65][None])[1].item() * 64 for s in range(0, 700, 100))
    assert flat[0]["tokens"] == 7 * 64 and flat[0]["ppl"] == pytest.approx(math.exp(total / (7 * 64)), rel=1e-5)


def test_truncate_budget_below_the_longest_length_scores_one_document_the_seed_picks(setup):
    """--max_tokens smaller than the longest length still scores one document (its first L + 1 tokens),
    and --seed picks which: each seed's perplexity is that of one of the 3 documents of >= 65 tokens,
    computed here by hand, and the seeds do not all pick the same one."""
    tmp_path, tokens, runs, common = setup
    model, _ = load_run(runs[0])
    t = torch.from_numpy(tokens.astype(np.int64))
    with torch.no_grad():
        by_doc = {s: math.exp(model(t[s : s + 16][None], t[s + 1 : s + 17][None])[1].item()) for s in (0, 340, 604)}
    picked = set()
    for seed in (1, 2, 3, 4):
        row = ee.run([runs[0], *common, "--protocol=truncate", "--max_tokens=10", f"--seed={seed}"])[0]
        assert row["length"] == 16 and row["tokens"] == 16
        picked |= {s for s, ppl in by_doc.items() if ppl == pytest.approx(row["ppl"], rel=1e-5)}
    assert len(picked) > 1


def test_stride_equal_to_length_tiles_each_document_from_its_start(tmp_path):
    """Sliding with stride L = tiled with --lengths=L alone (chunks of L + 1 from each document's start)
    where every document holds a whole number of windows; tiled with a longer L_max that L does not
    divide places its windows from each chunk's end instead, so its tokens differ."""
    make_dataset(str(tmp_path / "data"), docs=[73, 121, 145])  # 3, 5 and 6 windows of 24
    run = make_run(tmp_path / "run", "rope", seed=1)
    common = [
        run,
        f"--data_root={tmp_path / 'data'}",
        "--dataset=toy",
        f"--out_dir={tmp_path / 'out'}",
        "--device=cpu",
        "--last_k=8",
    ]
    sliding = ee.run([*common, "--protocol=sliding", "--lengths=24,64", "--stride=24"])[0]
    tiled = ee.run([*common, "--lengths=24"])[0]
    assert sliding["tokens"] == tiled["tokens"] == 72 + 120 + 144
    assert sliding["ppl"] == pytest.approx(tiled["ppl"], rel=1e-6)
    assert sliding["ppl_window_mean"] == pytest.approx(sliding["ppl"], rel=1e-6)  # all windows score 24 targets
    offset = ee.run([*common, "--lengths=24,64"])[0]  # windows at 16 and 40 of 4 chunks of 65
    assert offset["tokens"] == 4 * 2 * 24 and abs(offset["ppl"] - sliding["ppl"]) > 1e-4 * sliding["ppl"]


def test_lengths_in_any_order_score_as_sorted(setup, capsys):
    """--lengths=64,16,32 is --lengths=16,32,64: chunks cut for the longest, --last_k checked against the
    shortest (here 16, so --last_k=24 exits 2 even when 32 comes first)."""
    tmp_path, _, runs, common = setup
    key = lambda rows: [(r["run"], r["length"], r["tokens"], r["ppl"], r["last_loss"]) for r in rows]  # noqa: E731
    assert key(ee.run([runs[1], *common, "--lengths=64,16,32"])) == key(ee.run([runs[1], *common]))
    assert exit_code([runs[1], *common, "--lengths=32,16", "--last_k=24"]) == 2
    assert "--last_k must lie in 1 .. the shortest length 16, got 24" in capsys.readouterr().err


def test_an_empty_document_in_the_offsets_is_accepted_and_changes_nothing(setup):
    """Offsets may repeat (an empty document: 0 <= off[1] <= ...); the chunks are those of the other documents."""
    tmp_path, _, runs, common = setup
    key = lambda rows: [(r["length"], r["chunks"], r["tokens"], r["ppl"]) for r in rows]  # noqa: E731
    want = key(ee.run([runs[1], *common]))
    off = np.concatenate([[0], np.cumsum(DOCS)])  # 0 300 340 540 604 734
    np.r_[off[:2], 300, off[2:]].astype(np.int64).tofile(tmp_path / "data" / "toy" / "test.docs.bin")
    assert key(ee.run([runs[1], *common])) == want


def test_a_gpu_run_names_its_gpus_in_every_csv_row(setup, monkeypatch):
    """--device=cuda (or auto) on a machine with two H100s (mocked: CUDA calls answer as there, the arithmetic
    stays on this CPU): each row's machine column names the GPUs, not the host CPU; --device=cpu names the CPU."""
    tmp_path, tokens, runs, common = setup
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

    def on_cpu(f):  # the device argument "cuda" becomes "cpu"
        return lambda *a: f(*(("cpu" if isinstance(x, str) and x == "cuda" else x) for x in a))

    for name in ("load_checkpoint", "build_model", "_tokens"):
        monkeypatch.setattr(ee, name, on_cpu(getattr(ee, name)))
    argv = [*runs[1:], *[c for c in common if c != "--device=cpu"], "--max_tokens=64", "--dtype=float32"]
    gpus = "2 x NVIDIA H100 80GB HBM3"
    for device, machine in (("cuda", gpus), ("auto", gpus), ("cpu", provenance.cpu_model())):
        rows = ee.run(argv + [f"--device={device}"])
        with open(tmp_path / "out" / "extrapolation.csv") as f:
            got = list(csv.DictReader(f))
        assert len(got) == len(rows) == len(LENGTHS)
        assert all(g["machine"].startswith(machine) for g in got), (device, got[0]["machine"])
