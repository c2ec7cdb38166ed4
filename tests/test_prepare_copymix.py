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
    assert b["copymix"]["copied"] == b["copymix"]["spans"] and b["splits"]["train"]["tokens"] == 2 * a["splits"]["train"]["tokens"]
    for split in ("val", "test"):
        assert open(os.path.join(src, f"{split}.bin"), "rb").read() == open(os.path.join(out, f"{split}.bin"), "rb").read()
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
    cm.main(["--source_dir", os.path.join(root, "shakespeare_char"), "--p_random=1", "--min_span=4", "--max_span=32",
             "--out_dir", os.path.join(root, "shakespeare_char_copyrand32")])
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    metrics = train.main([os.path.join(repo, "config", "train_copy_cpu.py"), "--max_iters=2", "--eval_iters=1",
                          "--batch_size=2", f"--data_root={root}", f"--out_dir={tmp_path / 'out'}"])
    cfg = metrics["config"]
    assert metrics["dataset"] == "shakespeare_char_copyrand32"
    assert (cfg["n_layer"], cfg["n_embd"], cfg["block_size"], cfg["learning_rate"], cfg["min_lr"]) == (2, 128, 64, 3e-3, 3e-4)
