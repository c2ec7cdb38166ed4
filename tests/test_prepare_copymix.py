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
