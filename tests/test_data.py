"""Indirect-indexing data and the batch reader."""

import os
import random

import numpy as np
import pytest
import torch

from data import Dataset
from prepare.common import BinWriter, write_meta
from prepare.indirect_indexing import PAD_ID, decode, prepare, sample_example


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
    assert not (texts["train"] & texts["val"]) and not (texts["train"] & texts["test"]) and not (texts["val"] & texts["test"])


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
    x, y = ds._rows_to_xy(rows)
    assert ((y != -1).sum(1) == 1).all()
    for r in range(16):
        text = decode(rows[r])
        pos = int((y[r] != -1).nonzero())
        assert decode(x[r, : pos + 1].tolist()) + decode([int(y[r, pos])]) == text  # sees all but the target
        assert decode([int(y[r, pos])]) == text.split(",")[3]
    assert x.shape[1] == max(len(decode(r)) for r in rows) - 1  # all-pad columns trimmed


def test_global_batch_is_the_same_for_any_world_size(tiny_indirect):
    ds = Dataset(os.path.join(tiny_indirect, "indirect_indexing"))
    one = [ds.train_batch(7, m, 0, 4, 64, grad_accum=4)[0] for m in range(4)]
    two = [ds.train_batch(7, m, 0, 4, 64, grad_accum=2, rank=r, world_size=2)[0] for m in range(2) for r in range(2)]
    key = lambda xs: sorted(tuple(row.tolist()) for x in xs for row in x)  # noqa: E731
    assert key(one) == key(two)
    assert not torch.equal(one[0], ds.train_batch(8, 0, 0, 4, 64, grad_accum=4)[0])


def make_stream(path, tokens, vocab_size=50):
    with BinWriter(os.path.join(path, "val.bin"), np.uint16) as w:
        w.write(tokens)
    write_meta(path, {"dataset": "toy", "vocab_size": vocab_size, "dtype": "uint16", "layout": "stream",
                      "splits": {"val": {"file": "val.bin", "shape": [len(tokens)], "tokens": len(tokens)}},
                      "pad_id": None, "loss": "all", "tokenizer": {"kind": "none"}})


@pytest.mark.parametrize("world_size", [1, 3])
def test_full_split_predicts_every_token_once(tmp_path, world_size):
    tokens = np.arange(103) % 50
    make_stream(str(tmp_path), tokens)
    ds = Dataset(str(tmp_path))
    ys = [y for r in range(world_size) for _, y in ds.full_split_batches("val", 2, 10, r, world_size)]
    got = sorted(int(t) for y in ys for t in y.flatten())
    assert got == sorted(int(t) for t in tokens[1:])


def test_missing_dataset_names_the_prepare_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="python prepare/openwebtext.py"):
        Dataset(str(tmp_path / "openwebtext"))


def test_interrupted_write_leaves_no_file(tmp_path):
    path = str(tmp_path / "train.bin")
    with pytest.raises(RuntimeError):
        with BinWriter(path, np.uint16) as w:
            w.write(np.arange(10))
            raise RuntimeError("crash")
    assert os.listdir(tmp_path) == []
