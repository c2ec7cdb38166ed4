"""prepare/shakespeare_copymix.py: spans repeated by hand, val/test and the tokenizer untouched."""

import json
import os

import numpy as np
import pytest
from conftest import char_dataset

from prepare import shakespeare_copymix as cm


def test_copy_mix_by_hand():
    mixed, n_spans, n_copied = cm.copy_mix(np.arange(10), p_copy=1.0, min_span=3, max_span=3)
    assert mixed.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8, 6, 7, 8, 9, 9]
    assert (n_spans, n_copied) == (4, 4)
    same, n_spans, n_copied = cm.copy_mix(np.arange(10), p_copy=0.0, min_span=2, max_span=5)
    assert same.tolist() == list(range(10)) and n_copied == 0


def test_prepare_keeps_val_test_and_the_tokenizer(tmp_path):
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    char_dataset(src, "to be or not to be, that is the question. " * 20, "chars")
    cm.prepare(src, out, p_copy=1.0, min_span=5, max_span=5)
    a, b = (json.load(open(os.path.join(d, "meta.json"))) for d in (src, out))
    assert a["tokenizer"] == b["tokenizer"] and a["vocab_size"] == b["vocab_size"]
    assert (
        b["copymix"]["copied"] == b["copymix"]["spans"]
        and b["splits"]["train"]["tokens"] == 2 * a["splits"]["train"]["tokens"]
    )
    for split in ("val", "test"):
        assert (
            open(os.path.join(src, f"{split}.bin"), "rb").read() == open(os.path.join(out, f"{split}.bin"), "rb").read()
        )
    assert b["documents"]["train"]["n_docs"] == 1  # a source without boundaries: one document per split
    with pytest.raises(cm.UserError, match="min_span"):
        cm.prepare(src, out, min_span=0)


def test_random_spans_are_repeated_exactly():
    tokens = np.full(300, 7, dtype=np.uint8)  # a constant text: any other id comes from a random span
    mixed, n_spans, n_copied = cm.copy_mix(tokens, p_copy=1.0, min_span=10, max_span=10, p_random=1.0, vocab_size=5)
    assert (n_spans, n_copied) == (30, 30) and len(mixed) == 600 and 7 not in mixed.tolist()
    pairs = mixed.reshape(30, 2, 10)
    assert (pairs[:, 0] == pairs[:, 1]).all() and len({tuple(p) for p in pairs[:, 0]}) == 30


def test_the_copy_cpu_config_trains_on_the_mix_its_comment_prepares(tmp_path):
    """config/train_copy_cpu.py (issue 44's retrieval setting) on the mix its comment's command makes
    (min_span 4, max_span 32, all repeats random), small: the run keeps the config's model and context."""
    import train

    root = str(tmp_path)
    char_dataset(os.path.join(root, "shakespeare_char"), "to be or not to be, that is the question. " * 200, "chars")
    cm.main(
        [
            "--source_dir",
            os.path.join(root, "shakespeare_char"),
            "--p_random=1",
            "--min_span=4",
            "--max_span=32",
            "--out_dir",
            os.path.join(root, "shakespeare_char_copyrand32"),
        ]
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    metrics = train.main(
        [
            os.path.join(repo, "config", "train_copy_cpu.py"),
            "--max_iters=2",
            "--eval_iters=1",
            "--batch_size=2",
            f"--data_root={root}",
            f"--out_dir={tmp_path / 'out'}",
        ]
    )
    cfg = metrics["config"]
    assert metrics["dataset"] == "shakespeare_char_copyrand32"
    assert (cfg["n_layer"], cfg["n_embd"], cfg["block_size"], cfg["learning_rate"], cfg["min_lr"]) == (
        2,
        128,
        64,
        3e-3,
        3e-4,
    )


# ---- issue 53, round six ------------------------------------------------------------------------


def reference_mix(tokens, p_copy, min_span, max_span, seed):
    """The documented mix without random spans, drawn by hand: per span, integers(min_span, max_span + 1)
    for its length, then one random() < p_copy for its repeat, and nothing else."""
    rng, out, i = np.random.default_rng(seed), [], 0
    while i < len(tokens):
        span = tokens[i : i + int(rng.integers(min_span, max_span + 1))]
        i += len(span)
        out += [span, span] if rng.random() < p_copy else [span]
    return np.concatenate(out)


@pytest.mark.parametrize("seed", [0, 3])
def test_p_random_zero_draws_nothing_more_so_a_recorded_mix_is_reproduced(seed):
    """With p_random = 0 (the default, and every mix recorded before --p_random existed) the generator
    makes no extra draw: the mix is the hand-drawn reference's, with or without vocab_size given."""
    tokens = np.arange(500) % 61
    ref = reference_mix(tokens, 0.5, 3, 20, seed)
    for kwargs in ({}, {"p_random": 0.0, "vocab_size": 61}, {"p_random": 0, "vocab_size": 61}):
        mixed, n_spans, n_copied = cm.copy_mix(tokens, 0.5, 3, 20, seed, **kwargs)
        assert mixed.tolist() == ref.tolist()
    assert 0 < n_copied < n_spans  # the test sees both outcomes of the repeat draw


def test_random_spans_draw_every_id_of_the_vocabulary_and_no_other():
    """Random characters are uniform over 0 .. vocab_size - 1: with 4 ids, 0 and 3 included, nothing else;
    each id about a quarter of the 2000 drawn (binomial sd ~19)."""
    tokens = np.full(2000, 9, dtype=np.uint8)
    mixed, _, _ = cm.copy_mix(tokens, p_copy=1.0, min_span=10, max_span=10, p_random=1.0, vocab_size=4)
    first = mixed.reshape(-1, 2, 10)[:, 0].ravel()
    assert set(mixed.tolist()) == {0, 1, 2, 3} and mixed.dtype == np.uint8
    assert all(abs((first == v).sum() - 500) < 100 for v in range(4))


def test_prepare_draws_random_spans_from_the_source_vocabulary(tmp_path):
    """Through prepare: the random spans' ids are exactly the source tokenizer's, 0 .. vocab_size - 1."""
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    char_dataset(src, "abcdefghij " * 300, "chars")  # 11 symbols
    cm.prepare(src, out, p_copy=1.0, min_span=8, max_span=8, p_random=1.0)
    meta = json.load(open(os.path.join(out, "meta.json")))
    train = np.fromfile(os.path.join(out, "train.bin"), dtype=meta["dtype"])
    assert meta["vocab_size"] == 11 and set(train.tolist()) == set(range(11))


@pytest.mark.parametrize("p_random", ["1.5", "-0.1", "2"])
def test_p_random_outside_0_1_exits_2_in_one_line_before_writing(tmp_path, capsys, p_random):
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    char_dataset(src, "to be or not to be " * 20, "chars")
    with pytest.raises(SystemExit) as e:
        cm.exit_on_user_error(cm.main)(["--source_dir", src, "--out_dir", out, f"--p_random={p_random}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "p_random" in err and p_random in err, err
    assert not os.path.exists(out)
    for ok in ("0", "1"):  # the ends are allowed
        cm.main(["--source_dir", src, "--out_dir", out, f"--p_random={ok}", "--p_copy=1"])
        assert json.load(open(os.path.join(out, "meta.json")))["copymix"]["p_random"] == float(ok)


def test_the_dataset_is_named_after_the_out_dir_with_or_without_a_trailing_slash(tmp_path):
    src = str(tmp_path / "src")
    char_dataset(src, "to be or not to be " * 20, "chars")
    for out in (str(tmp_path / "shakespeare_char_copyrand32") + "/", str(tmp_path / "mix2")):
        cm.main(["--source_dir", src, "--out_dir", out])
        meta = json.load(open(os.path.join(out, "meta.json")))
        assert meta["dataset"] == os.path.basename(out.rstrip("/"))
