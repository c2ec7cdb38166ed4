"""Document boundaries from the prepare scripts to train.py (issue 58): data.py's per-token document ids
against a hand-worked case and a Python loop, positions restarting per document, Shakespeare's works and
the copy mix's moved boundaries, an old dataset without offsets, train.py's settings and a DDP step."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import train
from data import Dataset, positions_in_documents, window_document_ids
from prepare import shakespeare
from prepare import shakespeare_copymix as cm
from prepare.common import BinWriter, document_offsets, write_documents, write_meta

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_window_document_ids_by_hand_and_against_a_loop():
    """Documents [0, 3), [3, 4), [4, 9), [9, 12). Window 2..7: tokens 2 | 3 | 4 5 6 7 -> 0 1 2 2 2 2;
    window 4..9: 4 5 6 7 8 | 9 -> 0 0 0 0 0 1."""
    off = np.array([0, 3, 4, 9, 12])
    got = window_document_ids(off, [2, 4, 0], 6)
    assert got.dtype == torch.int32 and got.tolist() == [[0, 1, 2, 2, 2, 2], [0, 0, 0, 0, 0, 1], [0, 0, 0, 1, 2, 2]]
    rng = np.random.default_rng(0)
    off = document_offsets(rng.integers(1, 9, 200))
    starts = rng.integers(0, off[-1] - 32, 50)
    want = []
    for s in starts:  # the loop: the document of each token, renumbered from the window's first
        doc = [max(i for i in range(len(off) - 1) if off[i] <= t) for t in range(s, s + 32)]
        want.append([d - doc[0] for d in doc])
    assert window_document_ids(off, starts, 32).tolist() == want


def test_positions_restart_at_each_document():
    ids = torch.tensor([[0, 0, 0, 1, 2, 2], [0, 0, 0, 0, 0, 0], [0, 1, 2, 3, 4, 5]], dtype=torch.int32)
    assert positions_in_documents(ids).tolist() == [[0, 1, 2, 0, 0, 1], [0, 1, 2, 3, 4, 5], [0] * 6]


def stream(root, name, n=300, offsets=None):
    """A stream dataset of tokens 0..n-1 in every split (token t at position t), with `offsets` recorded for
    each split (or none)."""
    path = os.path.join(root, name)
    for split in ("train", "val", "test"):
        with BinWriter(os.path.join(path, f"{split}.bin"), np.uint16) as w:
            w.write(np.arange(n))
    meta = {
        "dataset": name,
        "vocab_size": n,
        "dtype": "uint16",
        "layout": "stream",
        "splits": {s: {"file": f"{s}.bin", "shape": [n], "tokens": n} for s in ("train", "val", "test")},
        "pad_id": None,
        "loss": "all",
        "tokenizer": {"kind": "none"},
    }
    if offsets is not None:  # one array for every split, or {split: offsets}
        per_split = offsets if isinstance(offsets, dict) else dict.fromkeys(("train", "val", "test"), offsets)
        meta["documents"] = write_documents(path, per_split)
    write_meta(path, meta)
    return path


def test_dataset_serves_document_ids_beside_every_batch(tmp_path, capsys):
    off = document_offsets([5, 1, 40, 7, 100, 147])
    ds = Dataset(stream(str(tmp_path), "docs", offsets=off), batch_size=4, block_size=32, documents=True)
    x, y, ids = ds.train_batch(3, 0)  # x[b] = tokens start..start + 31, and token t sits at position t
    assert ids.dtype == torch.int32 and torch.equal(ids, window_document_ids(off, x[:, 0].numpy(), 32))
    assert (ids[:, 0] == 0).all() and (ids.diff(dim=1) >= 0).all() and ids.max() > 0
    batches = list(ds.full_split_batches("val"))  # 299 predictions: 9 windows of 32 + a tail of 11
    got = torch.cat([b[2].flatten() + 0 for b in batches])
    assert batches[-1][2].shape == (1, 11)
    want = np.concatenate(
        [window_document_ids(off, [s], 32)[0] for s in range(0, 288, 32)] + [window_document_ids(off, [288], 11)[0]]
    )
    assert got.tolist() == want.tolist()
    assert capsys.readouterr().err == ""
    plain = Dataset(str(tmp_path / "docs"), batch_size=4, block_size=32)
    assert len(plain.train_batch(3, 0)) == 2  # without documents=True: (x, y) as before


def test_each_split_serves_the_document_ids_of_its_own_offsets(tmp_path):
    """Train, val and test of one stream (token t at position t) with different document boundaries: every batch
    reader (train_batch at several steps and micro-steps, fixed_batches, full_split_batches) serves the ids that a
    loop over that split's own offsets gives, never another split's (the ids differ between splits in every
    batch drawn here)."""
    lengths = {"train": [7] * 42 + [6], "val": [11] * 27 + [3], "test": [13] * 23 + [1]}  # 300 tokens each
    off = {split: document_offsets(n) for split, n in lengths.items()}
    folder = stream(str(tmp_path), "splits", offsets=off)
    ds = Dataset(folder, batch_size=4, block_size=32, grad_accum=2, documents=True)

    def loop(split, x):  # each token's document by a scan of the split's offsets, renumbered from the window's first
        o = off[split].tolist()
        rows = [[max(i for i in range(len(o) - 1) if o[i] <= t) for t in row] for row in x.tolist()]
        return [[d - r[0] for d in r] for r in rows]

    def check(split, batch):
        x, _, ids = batch
        assert ids.tolist() == loop(split, x), split
        others = [s for s in off if s != split]
        assert all(ids.tolist() != loop(s, x) for s in others), (split, "the case cannot tell the splits apart")

    for it, micro in ((0, 0), (3, 1), (7, 0)):
        check("train", ds.train_batch(it, micro))
    for split in ("val", "test"):
        for batch in ds.fixed_batches(split, 2):
            check(split, batch)
        for batch in ds.full_split_batches(split):
            x, _, ids = batch
            assert ids.tolist() == loop(split, x), split


def test_an_old_dataset_is_one_document_with_a_one_line_warning(tmp_path, capsys):
    ds = Dataset(stream(str(tmp_path), "old"), batch_size=2, block_size=16, documents=True)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no document boundaries" in err and "block_causal" in err
    assert (ds.train_batch(0, 0)[2] == 0).all()
    Dataset(str(tmp_path / "old"), batch_size=2, block_size=16)  # not asked for documents: no warning
    assert capsys.readouterr().err == ""


def test_a_missing_offsets_file_is_one_error_that_says_what_to_do(tmp_path):
    """meta.json declares documents but val.docs.bin was removed: block_causal's batches raise one line naming the
    file and the fix (it was numpy's bare FileNotFoundError); causal batches never read it."""
    folder = stream(str(tmp_path), "gone", offsets=document_offsets([100, 200]))
    os.remove(os.path.join(folder, "val.docs.bin"))
    ds = Dataset(folder, batch_size=2, block_size=16, documents=True)
    with pytest.raises(FileNotFoundError, match="val.docs.bin is missing, but .*meta.json declares val's document"):
        ds.fixed_batches("val", 1)
    assert len(Dataset(folder, batch_size=2, block_size=16).fixed_batches("val", 1)[0]) == 2


def test_rows_datasets_record_one_document_per_example_and_serve_no_ids(tiny_indirect):
    """A row is one document from position 0: block_causal there is causal attention, so the batch carries no ids
    and the model runs its unmasked path (no mask built per forward)."""
    ds = Dataset(os.path.join(tiny_indirect, "indirect_indexing"), batch_size=4, block_size=64, documents=True)
    for split, n in (("train", 2000), ("val", 200), ("test", 200)):
        assert ds.meta["documents"][split]["unit"] == "rows"
        assert ds.offsets(split).tolist() == list(range(n + 1))
    plain = Dataset(os.path.join(tiny_indirect, "indirect_indexing"), batch_size=4, block_size=64)
    for got, want in (
        (ds.train_batch(0, 0), plain.train_batch(0, 0)),
        (ds.fixed_batches("val", 1)[0], plain.fixed_batches("val", 1)[0]),
    ):
        assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, want))


def test_shakespeare_records_one_document_per_work_in_both_tokenizations(tmp_path):
    works = [
        "THE TEMPEST\nAct one, the ship. " * 30,
        "SONNETS\nShall I compare thee? " * 4,
        "HAMLET\nWho's there? " * 40,
    ]
    src = tmp_path / "works"
    src.mkdir()
    for i, w in enumerate(works):
        (src / f"{i}.txt").write_text(w, encoding="utf-8")
    out = str(tmp_path / "shk")
    shakespeare.prepare(out, input=str(src))
    text, starts = shakespeare.join_works(works)
    n_train = round(0.9 * len(text))  # the train split: characters 0..n_train-1, all three works start there
    assert starts[-1] < n_train
    enc = shakespeare.gpt2_encoding()
    for folder, decode in ((out + "_char", None), (out, enc.decode)):
        meta = json.load(open(os.path.join(folder, "meta.json")))
        ids = np.fromfile(os.path.join(folder, "train.bin"), dtype=meta["dtype"])
        off = np.fromfile(os.path.join(folder, "train.docs.bin"), dtype=np.int64)
        itos = meta["tokenizer"].get("itos")
        decode = decode or (lambda t, itos=itos: "".join(itos[i] for i in t))
        pieces = [decode(ids[a:b].tolist()) for a, b in zip(off, off[1:])]
        assert len(pieces) == 3 and pieces[:2] == [works[0] + "\n\n", works[1] + "\n\n"], folder
        assert works[2].startswith(pieces[2])


def test_shakespeare_works_that_start_inside_val_and_test_open_documents_there(tmp_path):
    """Four works whose starts fall in train (0 and one more), in val and in test (the 90/5/5 character split of a
    real multi-work --input): every split's recorded boundaries, decoded in both tokenizations, cut the split's
    text exactly where the works start inside it (the split's first document may be the tail of a work the split
    cut). The reference: the split's characters cut at the global work starts that lie inside it."""
    works = [  # 1,998 characters joined: train 0..1797, val 1798..1897, test 1898..1997; works start at 0, 1598,
        "ROMEO\n" + "But soft! " * 159,  # 1848 (val) and 1913 (test)
        "LEAR\n" + "Nothing. " * 27,
        "MACBETH\n" + "Out, spot! " * 5,
        "OTHELLO\n" + "Put out the light. " * 4,
    ]
    src = tmp_path / "works"
    src.mkdir()
    for i, w in enumerate(works):
        (src / f"{i}.txt").write_text(w, encoding="utf-8")
    out = str(tmp_path / "shk")
    shakespeare.prepare(out, input=str(src))
    text, starts = shakespeare.join_works(works)
    n_train, n_val = round(0.9 * len(text)), round(0.05 * len(text))
    bounds = {"train": (0, n_train), "val": (n_train, n_train + n_val), "test": (n_train + n_val, len(text))}
    assert [sum(a < c < b for c in starts) for a, b in bounds.values()] == [1, 1, 1], (starts, bounds)
    want = {}
    for split, (a, b) in bounds.items():
        cuts = [a] + [c for c in starts if a < c < b] + [b]
        want[split] = [text[x:y] for x, y in zip(cuts, cuts[1:])]
    assert want["val"][1].startswith("MACBETH") and want["test"][1].startswith("OTHELLO")
    enc = shakespeare.gpt2_encoding()
    for folder, decode in ((out + "_char", None), (out, enc.decode)):
        meta = json.load(open(os.path.join(folder, "meta.json")))
        itos = meta["tokenizer"].get("itos")
        decode = decode or (lambda t, itos=itos: "".join(itos[i] for i in t))
        for split in bounds:
            ids = np.fromfile(os.path.join(folder, f"{split}.bin"), dtype=meta["dtype"])
            off = np.fromfile(os.path.join(folder, f"{split}.docs.bin"), dtype=np.int64)
            assert meta["documents"][split]["n_docs"] == len(off) - 1 and off[0] == 0 and off[-1] == len(ids)
            got = [decode(ids[x:y].tolist()) for x, y in zip(off, off[1:])]
            assert got == want[split], (folder, split)


def test_copy_mix_moves_a_boundary_to_the_start_of_its_span():
    """Spans of 3, all copied: source boundary 4 lies in span 3..5, which starts at 6 in the mix."""
    mixed, _, _, src, out = cm._copy_mix(np.arange(10), p_copy=1.0, min_span=3, max_span=3)
    assert src.tolist() == [0, 3, 6, 9] and out.tolist() == [0, 6, 12, 18]
    assert cm.mixed_offsets(np.array([0, 4, 6, 10]), src, out, len(mixed)).tolist() == [0, 6, 12, 20]


@pytest.mark.parametrize(
    "arg, message",
    [
        ("--attn_mask_type=document", "attn_mask_type must be one of"),
        ("--reset_position_ids=1", "reset_position_ids must be True, False or None"),
        # None is the one non-bool the configurator lets through (any setting may be None); it would train as False
        ("--mask_document_boundary_targets=None", "mask_document_boundary_targets must be True or False, got None"),
        (
            "--attn_mask_type=block_causal --mask_document_boundary_targets=None",
            "mask_document_boundary_targets must be True or False, got None",
        ),
    ],
)
def test_bad_document_settings_exit_2_in_one_line(arg, message, capsys):
    with pytest.raises(SystemExit) as e:
        train.main([*arg.split(), "--dataset=missing", "--data_root=/nonexistent"])  # not one train.py builds
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and message in err and "\n" not in err


def test_reset_position_ids_without_block_causal_exits_2(capsys):
    """Positions restart at document starts, which only block_causal loads: asked for under causal, the run
    would record reset_position_ids=True and never reset (a review found it)."""
    with pytest.raises(train.UserError, match="only attn_mask_type='block_causal' reads"):
        train.document_settings({**train.DEFAULTS, "reset_position_ids": True})
    with pytest.raises(SystemExit) as e:
        train.main(["--reset_position_ids=True", "--data_root=/nonexistent"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "--attn_mask_type=block_causal" in err and "\n" not in err
    assert train.document_settings({**train.DEFAULTS, "attn_mask_type": "block_causal"})["reset_position_ids"] is True
    assert train.document_settings(dict(train.DEFAULTS))["reset_position_ids"] is False


def test_batches_carry_document_and_position_ids_to_the_model():
    x = torch.zeros(1, 4, dtype=torch.long)
    ids = torch.tensor([[0, 0, 1, 1]], dtype=torch.int32)
    assert train.batch_to_device((x, x), "cpu", True)[2] == {}
    kw = train.batch_to_device((x, x, ids), "cpu", True)[2]
    assert kw["document_ids"] is ids and kw["position_ids"].tolist() == [[0, 1, 0, 1]]
    assert train.batch_to_device((x, x, ids), "cpu", False)[2]["position_ids"] is None


def test_block_causal_ddp_step_equals_one_process_and_is_recorded(tmp_path):
    """Two gloo processes (torchrun) equal one process under block_causal: the same losses and metrics;
    metrics.json and the checkpoint's config record attn_mask_type and the resolved reset_position_ids."""
    root = str(tmp_path / "data")
    stream(root, "docs", n=600, offsets=document_offsets([5, 1, 40, 7, 100, 147, 3, 60, 237]))
    common = [
        "--dataset=docs",
        f"--data_root={root}",
        "--n_layer=1",
        "--n_head=2",
        "--n_embd=32",
        "--block_size=32",
        "--batch_size=4",
        "--eval_iters=2",
        "--log_interval=1",
        "--max_iters=3",
        "--eval_interval=3",
        "--gradient_accumulation_steps=2",
        "--attn_backend=torch",
        "--compile=False",
        "--device=cpu",  # gloo ranks on the CPU, also on a GPU machine
        "--attn_mask_type=block_causal",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    train.main([*common, f"--out_dir={one}"])  # one process: this one
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
    p = subprocess.Popen(
        [*cmd, *common, f"--out_dir={two}"],
        cwd=REPO,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        raise
    assert p.returncode == 0, err[-3000:]
    rows = [[json.loads(r) for r in open(os.path.join(d, "log.jsonl"))] for d in (one, two)]
    la, lb = ([r["loss"] for r in rs if "loss" in r] for rs in rows)
    assert len(la) == 3 and np.allclose(la, lb, rtol=1e-5)
    ma, mb = (json.load(open(os.path.join(d, "metrics.json"))) for d in (one, two))
    np.testing.assert_allclose(mb["test"]["loss"], ma["test"]["loss"], rtol=1e-5)
    assert ma["config"]["attn_mask_type"] == "block_causal" and ma["config"]["reset_position_ids"] is True


def test_a_block_causal_run_resumed_or_evaluated_without_the_setting_keeps_its_mask(tmp_path, capsys):
    """A real resume: a block_causal run without its boundary targets (mask_document_boundary_targets=True) saved at
    step 3 and resumed to step 6 without --attn_mask_type or --mask_document_boundary_targets gives the uninterrupted
    run's losses at steps 4..6 (it silently trained causally, or on the boundary targets, on); --eval_only=True
    without them gives the run's own val and test losses over its own targets, 599 - 8 (the 8 documents that start
    past token 0 of the 600-token split); both say so in one note line naming all three settings, and record the
    checkpoint's settings. --eval_only=True without --init_from=resume (which would score best.pt with this
    command's settings, over every target, and replace the run's metrics.json) exits 2 in one line, touching nothing."""
    root = str(tmp_path / "data")
    stream(root, "docs", n=600, offsets=document_offsets([5, 1, 40, 7, 100, 147, 3, 60, 237]))
    common = [
        "--dataset=docs",
        f"--data_root={root}",
        "--n_layer=1",
        "--n_head=2",
        "--n_embd=32",
        "--block_size=32",
        "--batch_size=4",
        "--eval_iters=2",
        "--log_interval=1",
        "--eval_interval=3",
        "--learning_rate=1e-2",
        "--attn_backend=torch",
        "--compile=False",
    ]
    trained = ["--attn_mask_type=block_causal", "--mask_document_boundary_targets=True"]
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    m_full = train.main([*common, *trained, "--max_iters=6", f"--out_dir={full}"])
    train.main([*common, *trained, "--max_iters=3", f"--out_dir={part}"])
    capsys.readouterr()
    m_res = train.main([*common, "--init_from=resume", "--max_iters=6", f"--out_dir={part}"])
    out = capsys.readouterr().out
    settings = "attn_mask_type='block_causal', reset_position_ids=True, mask_document_boundary_targets=True"
    assert f"note: {settings} as" in out, out
    losses = [
        {r["iter"]: r["loss"] for r in map(json.loads, open(os.path.join(d, "log.jsonl"))) if "loss" in r}
        for d in (full, part)
    ]
    np.testing.assert_allclose([losses[1][i] for i in (4, 5, 6)], [losses[0][i] for i in (4, 5, 6)], rtol=1e-6)
    for m in (m_res, m_full):
        assert m["config"]["attn_mask_type"] == "block_causal" and m["config"]["reset_position_ids"] is True
        assert m["config"]["mask_document_boundary_targets"] is True and m["val"]["targets"] == 599 - 8
    m_eval = train.main([*common, "--init_from=resume", "--eval_only=True", f"--out_dir={full}"])
    assert f"note: {settings} as" in capsys.readouterr().out
    for split in ("val", "test"):
        assert m_eval[split]["targets"] == m_full[split]["targets"]
        np.testing.assert_allclose(m_eval[split]["loss"], m_full[split]["loss"], rtol=1e-9)
    with open(os.path.join(full, "metrics.json")) as f:
        before = f.read()
    with pytest.raises(SystemExit) as e:
        train.main([*common, "--eval_only=True", f"--out_dir={full}"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "--init_from=resume" in err and "\n" not in err, err
    with open(os.path.join(full, "metrics.json")) as f:
        assert f.read() == before


def test_boundary_targets_are_left_out_of_the_loss_when_asked_by_hand(tmp_path):
    """Documents [0, 3), [3, 4), [4, 9), [9, 12), [12, 300) of a stream whose token t is t. Windows of 6 from 0 and 6
    (full_split_batches): targets 1..6 and 7..12. With mask_boundary_targets the targets that start a document
    (tokens 3, 4, 9 and 12, the last one the window's final target, beyond its own ids) are -1; the ids and x are
    unchanged; without it every target stays (the last token of a document predicts the next one's first)."""
    path = stream(str(tmp_path), "docs", n=300, offsets=document_offsets([3, 1, 5, 3, 288]))
    kw = dict(batch_size=2, block_size=6, documents=True)
    (x, y, ids), *_ = Dataset(path, mask_boundary_targets=True, **kw).full_split_batches("val")
    assert x.tolist() == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
    assert y.tolist() == [[1, 2, -1, -1, 5, 6], [7, 8, -1, 10, 11, -1]]
    assert ids.tolist() == [[0, 0, 0, 1, 2, 2], [0, 0, 0, 1, 1, 1]] and ids.dtype == torch.int32
    (x2, y2, ids2), *_ = Dataset(path, **kw).full_split_batches("val")
    assert torch.equal(x2, x) and torch.equal(ids2, ids) and y2.tolist() == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    (_, y3), *_ = Dataset(path, mask_boundary_targets=True, batch_size=2, block_size=6).full_split_batches("val")
    assert y3.tolist() == y2.tolist()  # causal (no documents): nothing is dropped


def test_train_py_drops_boundary_targets_under_block_causal_only(tmp_path, capsys):
    """--mask_document_boundary_targets=True: the final evaluation counts 299 - 4 targets of the 300-token val
    split (4 document starts past token 0), recorded in metrics.json; without block_causal it exits 2 in one line."""
    root = str(tmp_path / "data")
    stream(root, "docs", n=300, offsets=document_offsets([3, 1, 5, 3, 288]))
    common = ["--dataset=docs", f"--data_root={root}", "--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=16"]
    common += ["--batch_size=4", "--eval_iters=1", "--max_iters=1", "--attn_backend=torch", "--compile=False"]
    on = ["--mask_document_boundary_targets=True"]
    m = train.main([*common, *on, "--attn_mask_type=block_causal", f"--out_dir={tmp_path / 'a'}"])
    assert m["val"]["targets"] == m["test"]["targets"] == 295 and m["config"]["mask_document_boundary_targets"]
    m = train.main([*common, "--attn_mask_type=block_causal", f"--out_dir={tmp_path / 'b'}"])
    assert m["val"]["targets"] == 299
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.main([*common, *on, f"--out_dir={tmp_path / 'c'}"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "--attn_mask_type=block_causal" in err and "\n" not in err


@pytest.mark.parametrize("pos_encoding", ["learned", "pope"])
def test_the_periodic_val_loss_of_a_block_causal_run_is_each_document_alone(tmp_path, pos_encoding):
    """The val loss train.py logs every eval_interval under block_causal reads its batches as training does, with
    positions restarting at each document: it equals the loss of the same fixed val batches (Dataset.fixed_batches,
    the run's seed) with every document of every window run alone from position 0 through the run's checkpoint
    of that step, token-weighted. An absolute encoding (learned) would read other rows with positions not reset;
    PoPE is relative (its result changes only by rounding)."""
    from checkpoint import load_run

    root = str(tmp_path / "data")
    lengths = [5, 1, 40, 7, 100, 147, 3, 60, 237]  # 600 tokens
    stream(root, "docs", n=600, offsets=document_offsets(lengths))
    out = str(tmp_path / "run")
    train.main(
        [
            "--dataset=docs",
            f"--data_root={root}",
            "--n_layer=1",
            "--n_head=2",
            "--n_embd=32",
            "--block_size=32",
            "--batch_size=4",
            "--eval_iters=3",
            "--log_interval=1",
            "--max_iters=4",
            "--eval_interval=2",
            "--learning_rate=1e-2",
            "--attn_backend=torch",
            "--compile=False",
            "--dropout=0.0",
            "--attn_mask_type=block_causal",
            "--device=cpu",  # the reference runs on the CPU: no TF32 on a GPU machine
            f"--pos_encoding={pos_encoding}",
            f"--out_dir={out}",
        ]
    )
    logged = {
        r["iter"]: r["val_loss"] for r in map(json.loads, open(os.path.join(out, "log.jsonl"))) if "val_loss" in r
    }
    model, _ = load_run(out, "ckpt.pt", "cpu")  # the weights of step 4, where the last periodic evaluation ran
    model.eval()
    data = Dataset(os.path.join(root, "docs"), batch_size=4, block_size=32, seed=1337, documents=True)
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y, ids in data.fixed_batches("val", 3):
            for b in range(len(x)):
                for doc in ids[b].unique():
                    part = (ids[b] == doc).nonzero().flatten()
                    a, e = int(part[0]), int(part[-1]) + 1
                    logits, _ = model(x[b : b + 1, a:e])
                    total += torch.nn.functional.cross_entropy(logits[0], y[b, a:e], reduction="sum").item()
                    count += e - a
    assert sorted(logged) == [0, 2, 4]
    np.testing.assert_allclose(logged[4], total / count, rtol=1e-5)
