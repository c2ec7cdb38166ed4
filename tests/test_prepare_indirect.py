"""Indirect-indexing variants (prepare/indirect_indexing.py's flags): the distributions they promise,
every query's target and the loss mask, meta.json and the variant's name, and train.py building one."""

import hashlib
import json
import os
import random
from collections import Counter
from dataclasses import asdict

import numpy as np
import pytest

import train
from cli import UserError
from data import Dataset
from prepare import indirect_indexing as ii
from prepare.indirect_indexing import Variant, decode, prepare, sample_example
from tests.test_data import chisquare_p

SMALL = Variant(n_letters=12, min_len=6, max_len=10, max_shift=3, n_queries=3)
TINY_MODEL = [
    "--n_layer=2",
    "--n_head=2",
    "--n_embd=32",
    "--batch_size=8",
    "--eval_iters=2",
    "--log_interval=1",
    "--warmup_iters=2",
    "--attn_backend=torch",
    "--compile=False",
    "--block_size=64",
]


def parse(text, v):
    """Independent check of one row 'string,src,shift,tgt[,src,shift,tgt...]' of variant v: returns
    (string, [(source position, shift, target position)]) after asserting every promise."""
    fields = text.split(",")
    assert len(fields) == 1 + 3 * v.n_queries, text
    s = fields[0]
    assert v.min_len <= len(s) <= v.max_len and len(set(s)) == len(s), text
    assert set(s) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"[: v.n_letters]), text
    queries = []
    for src, shift, tgt in zip(fields[1::3], fields[2::3], fields[3::3]):
        assert shift[0] in "+-" and shift[1:].isdigit() and 1 <= abs(int(shift)) <= v.max_shift, text
        i = s.index(src)
        j = i + int(shift)
        assert 0 <= j < len(s) and s[j] == tgt, text
        queries.append((i, int(shift), j))
    assert len({i for i, _, _ in queries}) == len(queries), f"sources of a row must be distinct: {text}"
    return s, queries


def exact_shift_and_source(v):
    """P(shift) and P(L, i) of one query of variant v: L ~ U{min..max}, i ~ U{0..L-1}, j uniform over
    the positions with 1 <= |j - i| <= max_shift (enumerated)."""
    n_len = v.max_len - v.min_len + 1
    shift, source = Counter(), Counter()
    for L in range(v.min_len, v.max_len + 1):
        for i in range(L):
            source[L, i] += 1 / (n_len * L)
            js = [j for j in range(L) if 1 <= abs(j - i) <= v.max_shift]
            for j in js:
                shift[j - i] += 1 / (n_len * L * len(js))
    return shift, source


def test_variant_rows_are_valid_and_cover_every_letter_shift_and_query():
    for v in (
        SMALL,
        Variant(n_letters=2, min_len=2, max_len=2, max_shift=1, n_queries=2),
        Variant(n_letters=16, min_len=8, max_len=16, max_shift=4, n_queries=8),
    ):
        rng, shifts, letters = random.Random(1), set(), set()
        for _ in range(3000):
            s, queries = parse(sample_example(rng, v), v)
            shifts |= {sh for _, sh, _ in queries}
            letters |= set(s)
        assert shifts == set(range(-v.max_shift, 0)) | set(range(1, v.max_shift + 1)), v
        assert len(letters) == v.n_letters, v


def test_variant_distributions_chi_square():
    """6000 rows of SMALL: string length uniform on 6..10, letters uniform on the first 12, and for each
    query index separately the shift and the (length, source position) as enumerated (p > 1e-4)."""
    rng, n, v = random.Random(11), 6000, SMALL
    rows = [parse(sample_example(rng, v), v) for _ in range(n)]
    lengths = np.bincount([len(s) for s, _ in rows], minlength=v.max_len + 1)[v.min_len :]
    assert chisquare_p(lengths) > 1e-4
    letters = Counter(c for s, _ in rows for c in s)
    assert chisquare_p([letters[c] for c in ii.LETTERS[: v.n_letters]]) > 1e-4
    p_shift, p_source = exact_shift_and_source(v)
    for q in range(v.n_queries):
        shifts = Counter(queries[q][1] for _, queries in rows)
        assert chisquare_p([shifts[k] for k in p_shift], [n * p for p in p_shift.values()]) > 1e-4, q
        source = Counter((len(s), queries[q][0]) for s, queries in rows)
        assert chisquare_p([source[k] for k in p_source], [n * p for p in p_source.values()]) > 1e-4, q


def test_default_is_the_papers_sampler_bit_for_bit(tmp_path):
    """The paper's sampler as it was before variants (a second copy, here) draws the same texts, and
    prepare's default writes the same bytes as before (sha256 of the splits of the earlier code)."""

    def paper(rng):
        n = rng.randint(20, 40)
        letters = rng.sample(ii.LETTERS, n)
        i = rng.randrange(n)
        lo, hi = max(0, i - 15), min(n - 1, i + 15)
        j = rng.randint(lo, hi - 1)
        j += j >= i
        return f"{''.join(letters)},{letters[i]},{j - i:+d},{letters[j]}"

    a, b = random.Random(5), random.Random(5)
    assert [sample_example(a) for _ in range(2000)] == [paper(b) for _ in range(2000)]
    prepare(str(tmp_path), n_train=300, n_val=20, n_test=20, seed=3)
    want = {
        "train": "511fc61ebcd6f4e222b92ddbb214dcaf130ed04163e46395bfed8a7ab2133a36",
        "val": "b6d5e445d1d9499f222985df26056c0516ac671408d957580ac5e1bf4f24f04f",
        "test": "ec7fff54141d5db176202099011e58e43720455f5c34fd962e3e030175f54b32",
    }
    for split, digest in want.items():
        assert hashlib.sha256((tmp_path / f"{split}.bin").read_bytes()).hexdigest() == digest, split
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert (meta["loss"], meta["vocab_size"], meta["pad_id"], meta["variant"]) == ("last", 66, 65, "indirect_indexing")


@pytest.fixture(scope="module")
def small_variant(tmp_path_factory):
    root = tmp_path_factory.mktemp("variant")
    return prepare(str(root / SMALL.name), n_train=400, n_val=60, n_test=50, seed=2, **asdict(SMALL))


def test_multi_query_rows_targets_and_loss_mask(small_variant):
    """Every target is the letter at its shift, splits are disjoint, and the loss falls on each query's
    target and nowhere else (positions found by walking the fields of the text)."""
    ds = Dataset(small_variant, batch_size=16, block_size=64)
    v = Variant.from_meta(ds.meta)
    assert ds.meta["loss"] == "after_sep" and ds.vocab_size == 12 + 13 + 1 == v.pad_id + 1
    texts = {}
    for split in ("train", "val", "test"):
        rows = np.asarray(ds.array(split))
        assert rows.shape[1] == v.row_len == 10 + 3 * 7
        texts[split] = [decode(r, v) for r in rows]
        assert len(set(texts[split])) == len(rows)
        assert ds.meta["splits"][split]["tokens"] == sum(map(len, texts[split]))  # real tokens, padding not counted
        x, y = ds.rows_to_xy(rows)
        for r, text in enumerate(texts[split]):
            s, queries = parse(text, v)
            ends, at = [], len(s)  # index in the text of each query's target
            for field in text.split(",")[1:]:
                at += 1 + len(field)
                ends.append(at - 1)
            targets = ends[2::3]
            assert [int(p) for p in (y[r] != -1).nonzero()] == [t - 1 for t in targets]  # y[p] predicts token p + 1
            assert decode(y[r][y[r] != -1].tolist(), v) == "".join(s[j] for _, _, j in queries)
            assert decode(x[r, : len(text) - 1].tolist(), v) == text[:-1]  # inputs: the row up to its final target
    assert not set(texts["train"]) & set(texts["val"]) and not set(texts["train"]) & set(texts["test"])
    assert not set(texts["val"]) & set(texts["test"])
    x, y = ds.train_batch(0, 0)
    assert ((y != -1).sum(1) == 3).all()


@pytest.mark.parametrize("q", [1, 2])
def test_the_loss_falls_on_every_querys_target_for_any_number_of_queries(tmp_path, q):
    """Q queries per row: Q targets per row, each the letter at its shift (decoded from the row's text)."""
    v = Variant(n_letters=8, min_len=4, max_len=8, max_shift=3, n_queries=q)
    ds = Dataset(prepare(str(tmp_path / "d"), n_train=20, n_val=5, n_test=5, seed=0, **asdict(v)), block_size=64)
    rows = np.asarray(ds.array("val"))
    _, y = ds.rows_to_xy(rows)
    for r in range(len(rows)):
        s, queries = parse(decode(rows[r], v), v)
        assert decode(y[r][y[r] != -1].tolist(), v) == "".join(s[j] for _, _, j in queries)


def test_after_sep_on_one_query_rows_equals_last(tiny_indirect):
    """The two loss modes agree on the paper's rows: the final token follows the third ','."""
    ds = Dataset(os.path.join(tiny_indirect, "indirect_indexing"))
    rows = np.asarray(ds.array("val"))
    last = ds.rows_to_xy(rows)
    ds.loss, ds.loss_sep = "after_sep", {"id": ii.STOI[","], "every": 3}
    sep = ds.rows_to_xy(rows)
    assert all(np.array_equal(a, b) for a, b in zip(last, sep))


def test_meta_and_name_round_trip_the_variant(tmp_path, monkeypatch):
    """prepare's default out_dir is data/<variant name>; meta.json gives the variant back; the name
    parses back; a second run is a no-op and another variant in the same folder is refused."""
    monkeypatch.chdir(tmp_path)
    v = Variant(n_letters=8, min_len=4, max_len=8, max_shift=3, n_queries=4)
    out = prepare(n_train=50, n_val=5, n_test=5, seed=0, **asdict(v))
    assert out == os.path.join("data", "indirect_indexing_letters8_len4-8_shift3_q4")
    meta = json.loads((tmp_path / out / "meta.json").read_text())
    assert Variant.from_meta(meta) == v and meta["variant"] == v.name and meta["sampling"]["seed"] == 0
    assert meta["tokenizer"]["itos"] == list("ABCDEFGH0123456789,+-") + ["<pad>"] and meta["pad_id"] == 21
    assert meta["loss_sep"] == {"id": 18, "every": 3}
    assert Variant.from_meta({"sampling": {"seed": 1, "min_len": 20, "max_len": 40, "max_shift": 15}}) == Variant()
    for w in (
        v,
        Variant(),
        Variant(n_queries=2),
        Variant(max_shift=4),
        Variant(30, 10, 30),
        Variant(52, 2, 40, 1, 2),
        Variant(max_shift=20),
        Variant(n_letters=45),
        Variant(min_len=25),
        Variant(max_len=30),
    ):  # above and below
        assert Variant.from_name(w.name) == w
    assert prepare(out, n_train=50, n_val=5, n_test=5, seed=0, **asdict(v)) == out  # complete: nothing to do
    for field, value in {"n_letters": 9, "min_len": 5, "max_len": 7, "max_shift": 2, "n_queries": 2}.items():
        with pytest.raises(ValueError, match="holds the variant indirect_indexing_letters8_len4-8_shift3_q4"):
            prepare(out, n_train=50, n_val=5, n_test=5, **{**asdict(v), field: value})


@pytest.mark.parametrize(
    "name,message",
    [
        ("indirect_indexing_q8_letters16", "not an indirect-indexing variant"),
        ("indirect_indexing_letters52_q2", "names the variant 'indirect_indexing_q2'"),
        ("indirect_indexing_letters16", "max_len <= n_letters"),
        ("indirect_indexing_len4-8_shift3_q5", "n_queries must be in 1..min_len = 4"),
        ("indirect_indexing_len4-8_shift0", "max_shift must be >= 1"),
    ],
)
def test_bad_variant_names_are_refused(name, message):
    with pytest.raises(ValueError, match=message):
        Variant.from_name(name)


def test_splits_of_a_variant_with_few_examples_are_disjoint_and_use_them_all(tmp_path):
    """Test, val and train never share an example, even where the variant has so few (here 12: 3 x 2
    two-letter strings x 2 sources) that independent draws would repeat them across splits."""
    v = Variant(n_letters=3, min_len=2, max_len=2, max_shift=1)
    ds = Dataset(prepare(str(tmp_path / "d"), n_train=6, n_val=3, n_test=3, seed=0, **asdict(v)))
    texts = {s: {decode(r, v) for r in ds.array(s)} for s in ("train", "val", "test")}
    assert [len(t) for t in texts.values()] == [6, 3, 3] and len(set().union(*texts.values())) == 12


def test_a_variant_with_too_few_examples_stops_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(ii, "MAX_STALL", 200)
    with pytest.raises(ValueError, match="only 4 distinct examples .* lower --n_train"):  # AB/BA x 2 sources
        prepare(str(tmp_path / "x"), n_train=10, n_val=1, n_test=1, n_letters=2, min_len=2, max_len=2, max_shift=1)
    assert not (tmp_path / "x" / "meta.json").exists()


@pytest.mark.parametrize(
    "field,value", [("n_letters", 51), ("min_len", 21), ("max_len", 39), ("max_shift", 14), ("n_queries", 2)]
)
def test_each_parameter_on_its_own_changes_the_name(field, value, tmp_path, monkeypatch):
    """A variant that differs from the paper in one parameter has a name of its own that parses back to it,
    so its data never lands in data/indirect_indexing, the paper's folder."""
    v = Variant(**{field: value})
    assert v.name != "indirect_indexing" and Variant.from_name(v.name) == v
    monkeypatch.setattr(Variant, "name", property(lambda self: "indirect_indexing"))  # a name that forgets a field
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="does not identify the variant"):
        prepare(n_train=5, n_val=5, n_test=5, **asdict(v))
    assert not (tmp_path / "data").exists()


def test_the_stall_limit_counts_repeats_in_a_row_not_in_all(tmp_path, monkeypatch):
    """3 letters, strings of 2-3, shifts of 1: 36 distinct examples. Drawing 28 of them repeats an example
    45 times in all but at most 7 times in a row (seed 0), so a limit of 20 in a row is never reached."""
    monkeypatch.setattr(ii, "MAX_STALL", 20)
    out = prepare(
        str(tmp_path / "x"), n_train=20, n_val=4, n_test=4, seed=0, n_letters=3, min_len=2, max_len=3, max_shift=1
    )
    rows = np.concatenate([np.fromfile(tmp_path / "x" / f"{s}.bin", dtype=np.uint8) for s in ("train", "val", "test")])
    v = Variant(3, 2, 3, 1, 1)
    assert len({decode(r, v) for r in rows.reshape(28, v.row_len).tolist()}) == 28 and out == str(tmp_path / "x")


def test_train_builds_a_variant_named_by_its_dataset_and_scores_every_target(tmp_path, small_indirect_splits):
    """dataset='indirect_indexing_letters8_len4-8_shift3_q4' is built on first use (small splits here)
    and the test accuracy counts all 4 targets of each of the 40 test rows; a misspelt name exits 2."""
    small_indirect_splits(300, 30, 40)
    root = tmp_path / "data"
    name = "indirect_indexing_letters8_len4-8_shift3_q4"
    m = train.main(
        TINY_MODEL
        + [
            f"--dataset={name}",
            f"--data_root={root}",
            f"--out_dir={tmp_path / 'out'}",
            "--max_iters=2",
            "--eval_interval=2",
        ]
    )
    meta = json.loads((root / name / "meta.json").read_text())
    assert meta["variant"] == name and Variant.from_meta(meta) == Variant(8, 4, 8, 3, 4)
    assert m["test"]["targets"] == 4 * 40 and m["val"]["targets"] == 4 * 30
    with pytest.raises(UserError, match="write 'indirect_indexing' plus"):
        train.auto_prepare("indirect_indexing_q4_letters8", str(root / "bad"))
    assert train.auto_preparable(name) and train.auto_preparable("indirect_indexing")
    assert not train.auto_preparable("openwebtext")


def test_an_unknown_loss_mode_is_refused(tmp_path, tiny_indirect):
    """A meta.json whose loss the reader does not know stops with the fix, instead of training on every token."""
    import shutil

    folder = tmp_path / "ii"
    shutil.copytree(os.path.join(tiny_indirect, "indirect_indexing"), folder)
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "loss": "targets"}))
    with pytest.raises(ValueError, match="loss 'targets' is not one of"):
        Dataset(str(folder))
