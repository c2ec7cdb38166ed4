"""Indirect-indexing data and the batch reader."""

import os
import random
import re

import numpy as np
import pytest
import torch

from data import Dataset
from prepare.common import BinWriter, write_meta
from prepare.indirect_indexing import decode, prepare, sample_example


def check_example(text):
    """Independent validity check of one example 'string,source,shift,target' (paper appendix)."""
    string, source, shift, target = text.split(",")
    assert 20 <= len(string) <= 40 and string.isalpha() and string.isascii()
    assert len(set(string)) == len(string), "letters must be distinct"
    assert source in string
    assert shift[0] in "+-" and 1 <= abs(int(shift)) <= 15, shift
    j = string.index(source) + int(shift)
    assert 0 <= j < len(string) and string[j] == target


def test_sampled_examples_are_valid_and_cover_the_shift_range():
    rng = random.Random(0)
    shifts = set()
    for _ in range(20000):
        text = sample_example(rng)
        check_example(text)
        shifts.add(int(text.split(",")[2]))
    assert shifts == set(range(-15, 0)) | set(range(1, 16))


def test_sample_example_is_deterministic_for_a_seed():
    a = [sample_example(random.Random(5)) for _ in range(3)]
    b = [sample_example(random.Random(5)) for _ in range(3)]
    assert a == b and sample_example(random.Random(6)) != a[0]


def test_prepared_splits_are_valid_and_disjoint(tiny_indirect):
    ds = Dataset(os.path.join(tiny_indirect, "indirect_indexing"))
    assert ds.vocab_size == 66 and ds.meta["loss"] == "last" and ds.meta["dtype"] == "uint8"
    texts = {}
    for split, n in (("train", 2000), ("val", 200), ("test", 200)):
        rows = ds.array(split)
        assert rows.shape == (n, 48)
        texts[split] = {decode(r) for r in rows}
        assert len(texts[split]) == n
        for t in texts[split]:
            check_example(t)
    assert (
        not (texts["train"] & texts["val"])
        and not (texts["train"] & texts["test"])
        and not (texts["val"] & texts["test"])
    )


def test_prepare_is_deterministic_and_a_second_run_is_a_noop(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    prepare(a, n_train=300, n_val=20, n_test=20, seed=3)
    prepare(b, n_train=300, n_val=20, n_test=20, seed=3)
    for split in ("train", "val", "test"):
        assert open(os.path.join(a, f"{split}.bin"), "rb").read() == open(os.path.join(b, f"{split}.bin"), "rb").read()
    mtimes = {f: os.stat(os.path.join(a, f)).st_mtime_ns for f in os.listdir(a)}
    prepare(a, n_train=300, n_val=20, n_test=20, seed=3)
    assert mtimes == {f: os.stat(os.path.join(a, f)).st_mtime_ns for f in os.listdir(a)}


def test_loss_is_on_the_target_alone(tiny_indirect):
    ds = Dataset(os.path.join(tiny_indirect, "indirect_indexing"))
    rows = np.asarray(ds.array("val")[:16])
    x, y = ds.rows_to_xy(rows)
    assert ((y != -1).sum(1) == 1).all()
    for r in range(16):
        text = decode(rows[r])
        pos = int((y[r] != -1).nonzero())
        assert decode(x[r, : pos + 1].tolist()) + decode([int(y[r, pos])]) == text  # sees all but the target
        assert decode([int(y[r, pos])]) == text.split(",")[3]
    assert x.shape[1] == max(len(decode(r)) for r in rows) - 1  # all-pad columns trimmed


def test_global_batch_is_the_same_for_any_world_size(tiny_indirect):
    path = os.path.join(tiny_indirect, "indirect_indexing")
    ds = Dataset(path, batch_size=4, block_size=64, grad_accum=4)
    ranks = [Dataset(path, batch_size=4, block_size=64, grad_accum=2, rank=r, world_size=2) for r in range(2)]
    one = [ds.train_batch(7, m)[0] for m in range(4)]
    two = [ranks[r].train_batch(7, m)[0] for m in range(2) for r in range(2)]
    key = lambda xs: sorted(tuple(row.tolist()) for x in xs for row in x)  # noqa: E731
    assert key(one) == key(two)
    assert not torch.equal(one[0], ds.train_batch(8, 0)[0])
    fixed = [x for x, _ in ds.fixed_batches("val", 5)]  # the ranks split the same evaluation batches
    shares = [[x for x, _ in r.fixed_batches("val", 5)] for r in ranks]
    assert [len(s) for s in shares] == [3, 2]
    assert all(torch.equal(a, b) for a, b in zip(fixed, [shares[i % 2][i // 2] for i in range(5)]))


def make_stream(path, tokens, vocab_size=50):
    with BinWriter(os.path.join(path, "val.bin"), np.uint16) as w:
        w.write(tokens)
    write_meta(
        path,
        {
            "dataset": "toy",
            "vocab_size": vocab_size,
            "dtype": "uint16",
            "layout": "stream",
            "splits": {"val": {"file": "val.bin", "shape": [len(tokens)], "tokens": len(tokens)}},
            "pad_id": None,
            "loss": "all",
            "tokenizer": {"kind": "none"},
        },
    )


@pytest.mark.parametrize("world_size", [1, 3])
def test_full_split_predicts_every_token_once(tmp_path, world_size):
    tokens = np.arange(103) % 50
    make_stream(str(tmp_path), tokens)
    ranks = [
        Dataset(str(tmp_path), batch_size=2, block_size=10, rank=r, world_size=world_size) for r in range(world_size)
    ]
    ys = [y for ds in ranks for _, y in ds.full_split_batches("val")]
    got = sorted(int(t) for y in ys for t in y.flatten())
    assert got == sorted(int(t) for t in tokens[1:])


def test_missing_dataset_names_the_prepare_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="python prepare/openwebtext.py"):
        Dataset(str(tmp_path / "openwebtext"))
    variant = str(tmp_path / "indirect_indexing_letters16_len8-16_shift4_q8")  # a variant: its flags, from its name
    with pytest.raises(
        FileNotFoundError,
        match=re.escape(
            "Run: python prepare/indirect_indexing.py --n_letters=16 "
            f"--min_len=8 --max_len=16 --max_shift=4 --n_queries=8 --out_dir={variant}"
        ),
    ):
        Dataset(variant)


def test_interrupted_write_leaves_no_file(tmp_path):
    path = str(tmp_path / "train.bin")
    with pytest.raises(RuntimeError):
        with BinWriter(path, np.uint16) as w:
            w.write(np.arange(10))
            raise RuntimeError("crash")
    assert os.listdir(tmp_path) == []


# --- batches against the file they come from -----------------------------------------------------


def _stream_ds(path, n=3000, splits=("train", "val")):
    """A stream whose token i is i: a window's first input names its offset in the file. Returns
    (path, tokens)."""
    tokens = np.arange(n)
    for split in splits:
        with BinWriter(os.path.join(path, f"{split}.bin"), np.uint16) as w:
            w.write(tokens)
    write_meta(
        path,
        {
            "dataset": "toy",
            "vocab_size": n,
            "dtype": "uint16",
            "layout": "stream",
            "splits": {s: {"file": f"{s}.bin", "shape": [n], "tokens": n} for s in splits},
            "pad_id": None,
            "loss": "all",
            "tokenizer": {"kind": "none"},
        },
    )
    return path, tokens


def _check_windows(x, y, tokens, batch_size, block_size):
    assert x.shape == y.shape == (batch_size, block_size) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        s = row_x[0]
        assert row_x == tokens[s : s + block_size].tolist()
        assert row_y == tokens[s + 1 : s + block_size + 1].tolist()  # y is the next token in the file


def test_stream_batches_are_windows_of_the_file_and_y_is_x_shifted(tmp_path):
    path, tokens = _stream_ds(str(tmp_path))
    ds = Dataset(path, batch_size=6, block_size=32, grad_accum=2)
    starts = set()
    for it in range(5):
        for m in range(2):
            x, y = ds.train_batch(it, m)
            _check_windows(x, y, tokens, 6, 32)
            starts |= set(x[:, 0].tolist())
    for x, y in Dataset(path, batch_size=5, block_size=32, seed=1).fixed_batches("val", 3):
        _check_windows(x, y, tokens, 5, 32)
    assert len(starts) > 50 and max(starts) > 2000  # windows come from all over the file
    xs, ys = zip(*Dataset(path, batch_size=4, block_size=100).full_split_batches("val"))
    assert all(t.dtype == torch.int64 for t in xs + ys)
    assert torch.equal(torch.cat([x.flatten() for x in xs]), torch.from_numpy(tokens[:-1]).long())
    assert torch.equal(torch.cat([y.flatten() for y in ys]), torch.from_numpy(tokens[1:]).long())


def test_the_data_seed_draws_the_training_batches(tmp_path):
    """Seeds of one setting train on other batches (the spread over seeds that the README's tables
    report includes the data order); one seed draws the same batch of an iteration every time."""
    path, _ = _stream_ds(str(tmp_path))
    a, again, other = (Dataset(path, batch_size=4, block_size=32, seed=s) for s in (0, 0, 1))
    for it in (0, 5):
        assert torch.equal(a.train_batch(it, 0)[0], again.train_batch(it, 0)[0])
        assert not torch.equal(a.train_batch(it, 0)[0], other.train_batch(it, 0)[0])


def _rows_ds(path, rows, pad):
    """Writes a rows dataset of `rows`; returns its path."""
    with BinWriter(os.path.join(path, "train.bin"), np.uint8) as w:
        w.write(rows)
    write_meta(
        str(path),
        {
            "dataset": "toy",
            "vocab_size": 10,
            "dtype": "uint8",
            "layout": "rows",
            "splits": {"train": {"file": "train.bin", "shape": list(rows.shape)}},
            "pad_id": pad,
            "loss": "all",
            "tokenizer": {"kind": "none"},
        },
    )
    return str(path)


def test_padded_rows_with_loss_on_every_token(tmp_path):
    """Rows layout (JSB, MAESTRO): y is the next token of the row, padding targets are -1, and
    all-padding columns are trimmed; every reader (full split, train, fixed batches) draws whole
    rows of the file, all of them."""
    pad = 9
    rows = np.array(
        [[1, 2, 3, 4, pad, pad, pad, pad], [5, 6, pad, pad, pad, pad, pad, pad], [7, 8, 1, 2, 3, pad, pad, pad]],
        dtype=np.uint8,
    )
    path = _rows_ds(tmp_path, rows, pad)
    ((x, y),) = Dataset(path, batch_size=8, block_size=16).full_split_batches("train")
    assert x.tolist() == [[1, 2, 3, 4], [5, 6, pad, pad], [7, 8, 1, 2]]
    assert y.tolist() == [[2, 3, 4, -1], [6, -1, -1, -1], [8, 1, 2, 3]]
    ds = Dataset(path, batch_size=1, block_size=16)
    assert [b[0].tolist() for b in ds.full_split_batches("train")] == [[[1, 2, 3]], [[5]], [[7, 8, 1, 2]]]
    with pytest.raises((ValueError, RuntimeError)):  # the memmap is read-only: a bug cannot overwrite data
        ds.array("train")[0, 0] = 0
    want = {tuple(r[:-1]) for r in rows}
    ds = Dataset(path, batch_size=2, block_size=16)
    train = [ds.train_batch(it, 0) for it in range(20)]
    fixed = ds.fixed_batches("train", 20)
    again = ds.fixed_batches("train", 20)  # the same batches on every call
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(fixed, again))
    for drawn in (train, fixed):
        seen = set()
        for x, _y in drawn:
            assert x.dim() == 2 and x.dtype == torch.int64
            for r in x.tolist():
                full = next(w for w in want if tuple(w[: len(r)]) == tuple(r))  # a prefix of a file row
                seen.add(full)
        assert seen == want


def test_rows_longer_than_the_context_are_refused(tmp_path):
    """Rows of 8 tokens are 7 inputs: block_size 7 fits, block_size 6 is refused with the fix."""
    path = _rows_ds(tmp_path, np.arange(16, dtype=np.uint8).reshape(2, 8) % 9, 9)
    Dataset(path, batch_size=2, block_size=7)
    with pytest.raises(ValueError, match="has rows of 8 tokens: set block_size >= 7"):
        Dataset(path, batch_size=2, block_size=6)


def test_full_rows_without_padding(tmp_path):
    """Rows with no padding id (genome: <cls> + 1000 tokens): x = row[:-1], y = row[1:]."""
    rows = np.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 1]], dtype=np.uint8)
    ((x, y),) = Dataset(_rows_ds(tmp_path, rows, None), batch_size=8, block_size=16).full_split_batches("train")
    assert x.tolist() == [[1, 2, 3, 4], [6, 7, 8, 9]] and y.tolist() == [[2, 3, 4, 5], [7, 8, 9, 1]]


def test_windows_reach_both_ends_of_a_short_stream(tmp_path):
    """A split only 1 token longer than a window (block_size + 1 tokens): random windows start at 0
    and at 1, so the first and the last token are both used, and never past the end."""
    path, tokens = _stream_ds(str(tmp_path), n=34)
    ds = Dataset(path, batch_size=4, block_size=32)
    train_starts, val_starts = set(), set()
    for it in range(40):
        x, y = ds.train_batch(it, 0)
        _check_windows(x, y, tokens, 4, 32)
        train_starts |= set(x[:, 0].tolist())
    for x, y in ds.fixed_batches("val", 40):
        _check_windows(x, y, tokens, 4, 32)
        val_starts |= set(x[:, 0].tolist())
    assert train_starts == val_starts == {0, 1}
    ((x, y),) = Dataset(path, batch_size=2, block_size=33).fixed_batches(
        "val", 1
    )  # exactly block_size + 1 tokens: one window
    _check_windows(x, y, tokens, 2, 33)
    with pytest.raises(ValueError, match=r"has 34 tokens, fewer than block_size \+ 1 = 35"):
        Dataset(path, batch_size=2, block_size=34).fixed_batches("val", 1)


# --- the indirect-indexing generator's distributions (paper appendix) ----------------------------


def chisquare_p(observed, expected=None):
    """Pearson chi-square goodness-of-fit p-value (df = k - 1), via the regularised upper incomplete
    gamma function Q(df/2, stat/2); expected defaults to uniform with the observed total."""
    o = torch.as_tensor(np.asarray(observed, dtype=np.float64))
    e = (
        o.sum() / len(o) * torch.ones_like(o)
        if expected is None
        else torch.as_tensor(np.asarray(expected, dtype=np.float64))
    )
    stat = ((o - e) ** 2 / e).sum()
    return float(torch.special.gammaincc(torch.tensor((len(o) - 1) / 2, dtype=torch.float64), stat / 2))


def _exact_shift_distribution():
    """P(shift) when L ~ U{20..40}, i ~ U{0..L-1}, j uniform over the positions with 1 <= |j-i| <= 15."""
    p = {s: 0.0 for s in list(range(-15, 0)) + list(range(1, 16))}
    for L in range(20, 41):
        for i in range(L):
            js = [j for j in range(L) if 1 <= abs(j - i) <= 15]
            for j in js:
                p[j - i] += 1 / (21 * L * len(js))
    return p


def test_indirect_indexing_length_shift_and_position_distributions():
    """6000 examples: string length uniform on 20..40, shifts as enumerated above, the source
    position uniform within the string, and every letter equally likely (chi-square, p > 1e-4)."""
    rng, n = random.Random(11), 6000
    ex = [sample_example(rng).split(",") for _ in range(n)]
    lengths = np.bincount([len(s) for s, *_ in ex], minlength=41)[20:]
    assert lengths.sum() == n and chisquare_p(lengths) > 1e-4
    p = _exact_shift_distribution()
    counts = {s: 0 for s in p}
    for _, _, shift, _ in ex:
        counts[int(shift)] += 1
    assert chisquare_p([counts[s] for s in p], [n * p[s] for s in p]) > 1e-4
    fifth = lambda i, L: 5 * i // L  # noqa: E731  (which fifth of the string the source sits in)
    rel = np.bincount([fifth(s.index(src), len(s)) for s, src, _, _ in ex], minlength=5)
    want = np.zeros(5)
    for L in range(20, 41):
        for i in range(L):
            want[fifth(i, L)] += n / (21 * L)
    assert chisquare_p(rel, want) > 1e-4
    letters = np.bincount([ord(c) for s, *_ in ex for c in s], minlength=128)
    letters = letters[[ord(c) for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"]]
    assert chisquare_p(letters) > 1e-4


def test_fixed_val_batches_follow_the_data_seed(tmp_path):
    """The fixed evaluation batches are drawn with (seed, 7919): every run of one seed (RoPE and PoPE at
    seed s, a resumed run, every call) is evaluated on the same batches, so their curves and best.pt
    choices compare like for like; another seed draws other batches, so the spread over seeds includes
    which val batches chose best.pt, as it includes everything else random in a run."""
    path, _ = _stream_ds(str(tmp_path))
    starts = {
        seed: [
            x[:, 0].tolist() for x, _ in Dataset(path, batch_size=4, block_size=32, seed=seed).fixed_batches("val", 3)
        ]
        for seed in (1337, 1338)
    }
    again = [x[:, 0].tolist() for x, _ in Dataset(path, batch_size=4, block_size=32, seed=1337).fixed_batches("val", 3)]
    assert again == starts[1337] != starts[1338]
    rng = np.random.default_rng([1337, 7919])  # the documented draw: batch_size starts per batch in turn
    assert starts[1337] == [rng.integers(0, 3000 - 32, 4).tolist() for _ in range(3)]
