"""Character-level Shakespeare with copying in the training text: the CPU-scale search for a setting
where a small model retrieves at all (issue 44, docs/extrapolation.md).

    python prepare/shakespeare_copymix.py                               # needs data/shakespeare_char
    python prepare/shakespeare_copymix.py --p_copy=0.5 --min_span=16 --max_span=200

The training split of data/shakespeare_char is cut, from its start, into spans of lengths drawn uniformly from
min_span .. max_span characters; each span is followed by itself again with probability p_copy (numpy's
default_rng(seed)), so the text holds exact repeats at distances min_span .. max_span, the pattern induction heads
learn (Olsson et al. 2022). With --p_random, that share of the repeated spans are random characters instead of text
(uniform over the vocabulary): there only copying lowers the loss. val and test are the source's, unchanged, so a
run's test loss stays comparable with the default run's. The tokenizer is the source's (the same ids and symbols):
checkpoints trained on either evaluate on either. Written to data/shakespeare_char_copymix (--out_dir); meta.json
records the settings under "copymix". Documents (meta.json "documents", for train.py's block_causal): the
source's (one per work); in train each boundary moves back to the start of the span that holds it, so a span
and its copy are never in two documents. Bad input exits 2 with one line.
"""

import argparse
import json
import os
import sys

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cli import UserError, exit_on_user_error  # noqa: E402
from prepare.common import BinWriter, write_documents, write_meta  # noqa: E402


def copy_mix(tokens, p_copy, min_span, max_span, seed=0, p_random=0.0, vocab_size=None):
    """(mixed, n_spans, n_copied): tokens (1-D array) cut from its start into spans of
    rng.integers(min_span, max_span + 1) tokens (the last one shorter if the text ends), each followed by
    a second copy of itself with probability p_copy; rng = np.random.default_rng(seed). With p_random > 0,
    a repeated span is, with that probability, first replaced by as many ids drawn uniformly from
    0 .. vocab_size - 1 (random characters: only copying predicts its second copy)."""
    return _copy_mix(tokens, p_copy, min_span, max_span, seed, p_random, vocab_size)[:3]


def _copy_mix(tokens, p_copy, min_span, max_span, seed=0, p_random=0.0, vocab_size=None):
    """copy_mix's (mixed, n_spans, n_copied), plus where each span starts in `tokens` and in `mixed`."""
    rng = np.random.default_rng(seed)
    out, i, n_spans, n_copied, src_starts, out_starts, at = [], 0, 0, 0, [], [], 0
    while i < len(tokens):
        src_starts.append(i)
        out_starts.append(at)
        span = tokens[i : i + int(rng.integers(min_span, max_span + 1))]
        i += len(span)
        if rng.random() < p_copy:
            if p_random and rng.random() < p_random:
                span = rng.integers(0, vocab_size, len(span)).astype(tokens.dtype)
            out.append(span)
            n_copied += 1
            at += len(span)
        out.append(span)
        at += len(span)
        n_spans += 1
    mixed = np.concatenate(out) if out else tokens[:0]
    return mixed, n_spans, n_copied, np.asarray(src_starts, np.int64), np.asarray(out_starts, np.int64)


def mixed_offsets(offsets, src_starts, out_starts, n_mixed):
    """The source's document offsets carried into the mixed text: each boundary moves back to the start of the
    span that holds it, so a span and its copy stay in one document. -> int64 offsets, 0 .. n_mixed."""
    inner = np.asarray(offsets[1:-1], dtype=np.int64)
    moved = out_starts[np.searchsorted(src_starts, inner, side="right") - 1]
    return np.unique(np.concatenate([[0], moved, [n_mixed]])).astype(np.int64)


def prepare(
    source_dir="data/shakespeare_char",
    out_dir="data/shakespeare_char_copymix",
    p_copy=0.5,
    min_span=16,
    max_span=200,
    seed=0,
    p_random=0.0,
):
    if not 0 <= p_copy <= 1 or not 0 <= p_random <= 1 or not 1 <= min_span <= max_span:
        raise UserError(
            f"need 0 <= p_copy, p_random <= 1 and 1 <= min_span <= max_span, got {p_copy}, {p_random}, "
            f"{min_span}, {max_span}"
        )
    path = os.path.join(source_dir, "meta.json")
    if not os.path.isfile(path):
        raise UserError(f"no {path}: prepare it first (python train.py does, or python prepare/shakespeare.py)")
    with open(path) as f:
        meta = json.load(f)
    splits, offsets = {}, {}
    for split, info in meta["splits"].items():
        arr = np.fromfile(os.path.join(source_dir, info["file"]), dtype=meta["dtype"])
        docs = meta.get("documents", {}).get(split)
        off = (
            np.fromfile(os.path.join(source_dir, docs["file"]), dtype=np.int64)
            if docs
            else np.array([0, len(arr)], np.int64)
        )
        if split == "train":
            arr, n_spans, n_copied, src, out = _copy_mix(
                arr, p_copy, min_span, max_span, seed, p_random, meta["vocab_size"]
            )
            off = mixed_offsets(off, src, out, len(arr))
        offsets[split] = off
        with BinWriter(os.path.join(out_dir, info["file"]), np.dtype(meta["dtype"])) as w:
            w.write(arr)
        splits[split] = {**info, "shape": [len(arr)], "tokens": len(arr)}
    write_meta(
        out_dir,
        {
            **meta,
            "dataset": os.path.basename(os.path.normpath(out_dir)),
            "splits": splits,
            "documents": write_documents(
                out_dir,
                offsets,
                "tokens",
                "the source's documents (works); in train each boundary moved back to the start of its span",
            ),
            "copymix": {
                "source": source_dir,
                "p_copy": p_copy,
                "min_span": min_span,
                "max_span": max_span,
                "seed": seed,
                "p_random": p_random,
                "spans": n_spans,
                "copied": n_copied,
            },
        },
    )
    print(f"{out_dir}: train {splits['train']['tokens']:,} characters ({n_copied:,} of {n_spans:,} spans repeated)")


def main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source_dir", default="data/shakespeare_char")
    p.add_argument("--out_dir", default="data/shakespeare_char_copymix")
    p.add_argument("--p_copy", type=float, default=0.5)
    p.add_argument("--min_span", type=int, default=16)
    p.add_argument("--max_span", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--p_random", type=float, default=0.0, help="share of repeated spans made of random characters")
    prepare(**vars(p.parse_args(argv)))


if __name__ == "__main__":
    exit_on_user_error(main)(sys.argv[1:])
