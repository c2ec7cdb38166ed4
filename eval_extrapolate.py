"""Length extrapolation: perplexity of trained models at contexts longer than they were trained on.

    python eval_extrapolate.py out-owt-124m-rope out-owt-124m-pope out-owt-124m-yarn-4096 out-owt-124m-pope-4096
    python eval_extrapolate.py out-x-rope out-x-pope --dataset=shakespeare_char --lengths=256,512,1024,2048,4096
    python eval_extrapolate.py out-owt-124m-rope --rope_scaling=4    # YaRN at evaluation time, no fine-tune
    python eval_extrapolate.py out-owt-124m-rope out-owt-124m-pope --protocol=sliding --max_tokens=1000000

The paper's headline test (section 4, Figure 2): models trained at 1024 tokens, scored zero-shot on
the PG-19 test books at 1024, 2048, ..., 10240 tokens. Which protocol below its figure used is
unknown: the paper names the split (100 books, about 7M tokens) but no windows, stride or
truncation. Scoring whole books points to tiled or sliding rather than truncate, no more than that.
Tiled, the protocol that needs no stride, is the default.

Protocols (--protocol). At length L a model reads windows of L input tokens and predicts their L
next tokens (targets); the context of a prediction is the number of tokens it reads, 1 .. L.
L_max is the longest length, "forwards" counts model calls on L tokens.
  tiled     non-overlapping windows (ALiBi's "nonoverlapping inference"): every context from 1 to L
            equally often, the direct test of positions 0 .. L-1. One forward per L targets.
  sliding   the protocol of Position Interpolation and YaRN's eval/perplexity.py: a window of L
            slides over each document with stride S (--stride, default 256). The first window of a
            document scores all its L targets (contexts 1 .. L: never past the document's start);
            each later one scores only its last S targets, the new ones, so they see L-S+1 .. L
            tokens. Where fewer than S targets are left, one last window ends at the document's end
            and scores them. Costs about L/S forwards per S targets: L/S times tiled (16 at L = 4096,
            S = 256). YaRN's window of L tokens holds L-1 predictions (contexts L-S .. L-1); here it
            holds L inputs and L targets, as in tiled. With S = L it tiles each document from its
            start: the windows that tiled scores with --lengths=L alone, plus the tail window.
  truncate  each document's first L + 1 tokens, one window per document and length (YaRN's
            --truncate): contexts 1 .. L, each window at a document's start. One forward per window.
Which documents and tokens (chosen once, from the dataset, the lengths, the protocol, --max_tokens,
--seed, --doc_tokens and --one_document only, so every model sees the same tokens):
  Documents: the dataset's document offsets where it has them (meta.json "documents", e.g. the
     PG-19 books of prepare/pg19.py), otherwise (or with --one_document) the whole split is one
     document, or with --doc_tokens=N consecutive documents of N tokens (a shorter tail dropped).
  tiled: 1. Chunks: each document is cut from its start into consecutive chunks of L_max + 1 tokens,
     stepping by L_max, so the predicted tokens of two chunks never overlap; a document's tail
     shorter than a chunk is dropped. No chunk crosses a document.
  2. Budget: with --max_tokens=B > 0, max(1, B // L_max) chunks are drawn without replacement with
     numpy's generator seeded by --seed (then kept in dataset order); B = 0 keeps all chunks.
  3. At each length L, a chunk holds floor(L_max / L) non-overlapping windows of L inputs (and their
     L next-token targets), placed right to left from the chunk's end. So at every length the last
     window of a chunk ends at the same token, and each length scores at most B tokens.
  sliding: the documents of at least L_max + 1 tokens, each scored from its start to its end; with
     B > 0, taken in an order shuffled by --seed until B targets are scored, the last one cut to the
     budget left (but at least L_max targets). The same targets at every length: only their context
     differs.
  truncate: the documents of at least L_max + 1 tokens (shorter ones are left out at every length);
     with B > 0, max(1, B // L_max) of them drawn by --seed. n_docs * L targets at length L.
Numbers per model and length (and the number of targets scored):
  ppl              exp(mean next-token loss over all scored targets), token-weighted;
  ppl_window_mean  sliding only: exp(mean over windows of each window's mean loss), the number YaRN's
                   eval/perplexity.py reports (tiled and truncate windows all hold L targets, so
                   there it would equal ppl);
  last_loss        tiled only, a same-tokens view: the mean loss (nats) of the last K (--last_k)
                   targets of the window that ends at each chunk's end. These are the same tokens at
                   every L; only the amount of context before them differs.
Absolute encodings (model.ABSOLUTE_ENCODINGS) cannot run past their block_size: those cells stay
empty, with a note. Windows run in batches of at most L_max tokens under torch.no_grad;
attention runs on SDPA's fused kernels (PoPE: its torch path or Triton kernel), and the loss is
taken over slices of the scored positions, so memory grows as O(L_max), never with a (T, T) score
tensor or a (T, vocab) logit tensor for the full window.
(Exception: alibi_half passes its (H, T, T) bias to SDPA, so it grows as T^2.)
YaRN: a checkpoint fine-tuned with YaRN carries rope_scaling / rope_original_block_size in its
model_args and runs with them as is. --rope_scaling=S > 1 (train.py's name for YaRN's s; the old
flag --yarn_scale still works, with a note) gives the other RoPE runs s = S and L = their block_size
at evaluation time (no fine-tuning); other encodings ignore it, with a note. YaRN's ramp is the checkpoint's
rope_yarn_ramp ('code' by default; 'paper' for a checkpoint written before the setting existed).

Outputs: markdown tables on stdout, and in --out_dir (written atomically):
  extrapolation.csv   one row per (model, length): run, label, protocol, one_document (True when
                      --one_document read the split as one), length, tokens, ppl,
                      ppl_window_mean, last_loss (empty where a protocol has no such number), and
                      where the evaluation ran (provenance.flat: commit, libraries, machine,
                      threads, world_size, data_digest)
  extrapolation.png   perplexity vs context length, log y, one line per model, training length marked
Labels name the encoding: `rope`, `rope+yarn(s=4,code)` (YaRN with its ramp), `pope`, `none`, ...; the legend
adds the run folder.
Bad input (no best.pt, unknown dataset, a length <= 0, no document long enough for the longest
length, a stride <= 0 or longer than the shortest length, ...) prints one line and exits with code 2.
"""

import argparse
import csv
import functools
import io
import math
import os
import sys
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from checkpoint import build_model, describe_tokenizer, load_checkpoint, same_tokenizer, tokenizer_from_checkpoint
from cli import (
    DTYPES,
    ArgumentParser,
    UserError,
    atomic_open,
    atomic_write,
    autocast_context,
    exit_on_user_error,
    note_renamed,
    resolve_device,
    resolve_dtype,
)
from data import Dataset
from model import ABSOLUTE_ENCODINGS, GPTConfig
from provenance import FLAT_COLUMNS, flat, provenance

DEFAULT_LENGTHS = ",".join(str(1024 * i) for i in range(1, 11))
PROTOCOLS = ("tiled", "sliding", "truncate")
DEFAULT_STRIDE = 256  # YaRN's and Position Interpolation's


# ---- windows ----


def document_offsets(ds, split):
    """int64 offsets (n_docs + 1,) of the documents of a stream split: document i is
    arr[off[i]:off[i+1]]. From meta.json "documents"[split] where the dataset declares them (format:
    prepare/pg19.py), else [0, n_tokens] (one document). UserError for a missing or malformed offsets file."""
    n = len(ds.array(split))
    docs = ds.meta.get("documents", {}).get(split)
    if not docs:
        return np.array([0, n], dtype=np.int64)
    path = os.path.join(ds.dir, docs["file"])
    if not os.path.exists(path):
        raise UserError(
            f"{path} is missing, but meta.json declares {split}'s documents in it: prepare the dataset again, or pass "
            "--one_document to read the split as one document"
        )
    off = np.fromfile(path, dtype=docs.get("dtype", "int64")).astype(np.int64)
    if len(off) < 2 or off[0] != 0 or off[-1] != n or np.any(np.diff(off) < 0):
        raise UserError(
            f"{ds.dir}/{docs['file']} does not hold document offsets 0 .. {n} of {split}.bin; prepare the dataset again"
        )
    return off


def chunk_starts(offsets, max_length, max_tokens=0, seed=1337):
    """Start indices (int64, sorted) of the chunks of max_length + 1 tokens (see the module docstring).

    offsets: document offsets (n_docs + 1,). max_tokens > 0 keeps max(1, max_tokens // max_length)
    chunks drawn with np.random.default_rng(seed); 0 keeps all. Depends on nothing else, so every
    model gets the same chunks. Raises UserError when no document has max_length + 1 tokens.
    """
    starts = [np.arange(a, b - max_length, max_length) for a, b in zip(offsets[:-1], offsets[1:])]
    starts = np.concatenate(starts) if starts else np.zeros(0, np.int64)
    if len(starts) == 0:
        longest = int(np.diff(offsets).max()) if len(offsets) > 1 else 0
        raise UserError(
            f"the longest length {max_length} needs a document of at least {max_length + 1} tokens; "
            f"the longest has {longest}: use shorter --lengths or another --split/--dataset"
        )
    if max_tokens > 0:
        n = max(1, max_tokens // max_length)
        if n < len(starts):
            starts = np.sort(np.random.default_rng(seed).choice(starts, n, replace=False))
    return starts.astype(np.int64)


def window_offsets(length, max_length):
    """Offsets, inside a chunk of max_length + 1 tokens, of its floor(max_length / length) windows of
    `length` inputs: window w reads chunk[o:o + length], predicts chunk[o + 1:o + length + 1], with
    o = max_length - (w + 1) * length. Window 0 ends at the chunk's end."""
    return [max_length - (w + 1) * length for w in range(max_length // length)]


def cut_documents(n_tokens, doc_tokens):
    """Offsets (n_docs + 1,) int64 of a split of n_tokens without document offsets, read as consecutive
    documents of doc_tokens tokens (--doc_tokens; a tail shorter than doc_tokens is left out)."""
    return np.arange(0, n_tokens // doc_tokens * doc_tokens + 1, doc_tokens, dtype=np.int64)


def long_documents(offsets, max_length):
    """(n, 2) int64 [start, end) of the documents with at least max_length + 1 tokens (a window of
    max_length inputs and its targets), in dataset order. offsets: (n_docs + 1,).
    Raises UserError when there is none."""
    spans = np.stack([offsets[:-1], offsets[1:]], 1)
    keep = spans[spans[:, 1] - spans[:, 0] >= max_length + 1]
    if len(keep) == 0:
        longest = int((spans[:, 1] - spans[:, 0]).max()) if len(spans) else 0
        raise UserError(
            f"the longest length {max_length} needs a document of at least {max_length + 1} tokens; "
            f"the longest has {longest}: use shorter --lengths or another --split/--dataset"
        )
    return keep.astype(np.int64)


def truncate_starts(offsets, max_length, max_tokens=0, seed=1337):
    """Starts (int64, sorted) of the documents the truncate protocol scores: those with at least
    max_length + 1 tokens; max_tokens > 0 keeps max(1, max_tokens // max_length) of them drawn with
    np.random.default_rng(seed). UserError when no document is long enough."""
    starts = long_documents(offsets, max_length)[:, 0]
    if max_tokens > 0:
        n = max(1, max_tokens // max_length)
        if n < len(starts):
            starts = np.sort(np.random.default_rng(seed).choice(starts, n, replace=False))
    return starts


def sliding_stretches(offsets, max_length, max_tokens=0, seed=1337):
    """[(start, m)] sorted by start: the sliding protocol scores the m targets of arr[start:start + m + 1].

    Documents with at least max_length + 1 tokens, each whole (m = its length - 1); max_tokens > 0
    takes them in np.random.default_rng(seed).permutation order until max_tokens targets, the last
    one cut to the budget left but to no fewer than max_length targets. UserError when none is long
    enough. The stretches do not depend on the length, so every length scores the same targets.
    """
    docs = long_documents(offsets, max_length)
    if max_tokens > 0:
        docs = docs[np.random.default_rng(seed).permutation(len(docs))]
    out, left = [], max_tokens
    for a, b in docs.tolist():
        m = b - a - 1
        if max_tokens > 0:
            if left <= 0:
                break
            m = min(m, max(left, max_length))
            left -= m
        out.append((a, m))
    return sorted(out)


def sliding_windows(m, length, stride):
    """[(a, n)]: the windows that score the m targets of a stretch of m + 1 tokens (m >= length).

    Window (a, n) reads tokens [a, a + length) and scores its last n targets, tokens
    a + length - n + 1 .. a + length, each from all the window's tokens before it. The first window,
    (0, length), scores targets 1 .. length; then a = stride, 2 * stride, ... with n = stride while
    the window fits; where 0 < r < stride targets are left, a last window (m - length, r) ends at
    the stretch's end. Every target 1 .. m is scored once; past the first window each sees at least
    length - stride + 1 tokens. ValueError unless 0 < stride <= length <= m.
    """
    if not 0 < stride <= length <= m:
        raise ValueError(f"sliding windows need 0 < stride <= length <= m, got {stride}, {length}, {m}")
    wins = [(0, length)]
    while wins[-1][0] + stride + length <= m:
        wins.append((wins[-1][0] + stride, stride))
    end = wins[-1][0] + length
    if end < m:
        wins.append((m - length, m - end))
    return wins


# ---- scoring ----


@torch.no_grad()
def token_losses(model, x, y):
    """Next-token losses (B, n) float32 in nats of model on inputs x (B, T) and the targets y (B, n),
    n <= T, of x's last n positions (n = T: all of them).

    The lm_head and cross-entropy run on slices of at most 2**24 / vocab_size positions, so no
    (B, T, vocab) logit tensor is held at once.
    """
    h = model.hidden_states(x)[:, x.shape[1] - y.shape[1] :]  # (B, n, n_embd), the final RMSNorm applied
    B, T, C = h.shape
    h, y = h.reshape(B * T, C), y.reshape(B * T)
    step = max(1, 2**24 // model.lm_head.out_features)
    out = torch.empty(B * T, dtype=torch.float32, device=h.device)
    for i in range(0, B * T, step):
        logits = model.lm_head(h[i : i + step]).float()
        out[i : i + step] = F.cross_entropy(logits, y[i : i + step], reduction="none")
    return out.view(B, T)


def _tokens(arr, start, n, device):
    """arr[start:start + n] as an int64 tensor on device."""
    return torch.from_numpy(np.asarray(arr[start : start + n]).astype(np.int64)).to(device)


@torch.no_grad()
def evaluate(model, arr, starts, lengths, last_k, device="cpu", autocast=nullcontext, skip=(), desc=None):
    """Tiled protocol: {length: {tokens, ppl, last_loss}} of one model over the chunks at `starts`.

    arr: 1-D token array; starts: chunk starts (chunk_starts); lengths: ascending ints; last_k:
    targets per chunk in the same-tokens view. Lengths in `skip` are not run (value None).
    """
    max_length = max(lengths)
    todo = [L for L in lengths if L not in skip]
    results = {L: None for L in lengths}
    bar = tqdm(total=len(starts) * sum(max_length // L for L in todo), desc=desc, unit="win", file=sys.stderr)
    for L in todo:
        offs = window_offsets(L, max_length)
        total, n_tok, last_total = 0.0, 0, 0.0
        for s in starts:
            chunk = _tokens(arr, s, max_length + 1, device)
            x = torch.stack([chunk[o : o + L] for o in offs])
            y = torch.stack([chunk[o + 1 : o + L + 1] for o in offs])
            with autocast():
                loss = token_losses(model, x, y).double()
            total += loss.sum().item()
            n_tok += loss.numel()
            last_total += loss[0, -last_k:].sum().item()  # window 0 ends at the chunk's end
            bar.update(len(offs))
        results[L] = dict(tokens=n_tok, ppl=math.exp(total / n_tok), last_loss=last_total / (last_k * len(starts)))
    bar.close()
    return results


@torch.no_grad()
def sliding_losses(model, tokens, length, stride, batch=1, autocast=nullcontext, bar=None):
    """(losses, window_means) of one stretch under the sliding protocol (windows: sliding_windows).

    tokens: (m + 1,) int64 on the model's device, m >= length. losses: (m,) float64, losses[t - 1] the
    loss (nats) of token t given the tokens its window holds before it. window_means: (n_windows,)
    float64, the mean loss of each window's scored targets. The windows after the first run `batch`
    at a time; `bar` (tqdm) advances by one per window.
    """
    m = len(tokens) - 1
    wins = sliding_windows(m, length, stride)
    losses = torch.empty(m, dtype=torch.float64, device=tokens.device)
    means = []
    for g in [wins[:1]] + [wins[i : i + batch] for i in range(1, len(wins), batch)]:
        n = max(k for _, k in g)  # the first window scores `length` targets, the others `stride` or fewer
        x = torch.stack([tokens[a : a + length] for a, _ in g])
        y = torch.stack([tokens[a + length - n + 1 : a + length + 1] for a, _ in g])
        with autocast():
            loss = token_losses(model, x, y).double()
        for (a, k), row in zip(g, loss):
            losses[a + length - k : a + length] = row[n - k :]
            means.append(row[n - k :].mean())
        if bar is not None:
            bar.update(len(g))
    return losses, torch.stack(means)


@torch.no_grad()
def evaluate_sliding(model, arr, stretches, lengths, stride, device="cpu", autocast=nullcontext, skip=(), desc=None):
    """Sliding protocol: {length: {tokens, ppl, ppl_window_mean}} of one model over `stretches`
    [(start, m)] (sliding_stretches) with stride `stride`. Lengths in `skip` are not run (None).
    ppl is token-weighted; ppl_window_mean = exp(mean of the windows' mean losses), YaRN's number."""
    max_length = max(lengths)
    todo = [L for L in lengths if L not in skip]
    results = {L: None for L in lengths}
    n_windows = sum(len(sliding_windows(m, L, stride)) for L in todo for _, m in stretches)
    bar = tqdm(total=n_windows, desc=desc, unit="win", file=sys.stderr)
    for L in todo:
        total, n_tok, means = 0.0, 0, []
        for start, m in stretches:
            losses, wm = sliding_losses(
                model, _tokens(arr, start, m + 1, device), L, stride, max(1, max_length // L), autocast, bar
            )
            total += losses.sum().item()
            n_tok += m
            means.append(wm)
        results[L] = dict(
            tokens=n_tok, ppl=math.exp(total / n_tok), ppl_window_mean=math.exp(torch.cat(means).mean().item())
        )
    bar.close()
    return results


@torch.no_grad()
def evaluate_truncate(model, arr, starts, lengths, device="cpu", autocast=nullcontext, skip=(), desc=None):
    """Truncate protocol: {length: {tokens, ppl}} of one model, one window per document start in
    `starts` (truncate_starts): inputs arr[s:s + L], targets arr[s + 1:s + L + 1]. Lengths in `skip`
    are not run (None). Windows run max(1, max(lengths) // L) at a time."""
    max_length = max(lengths)
    todo = [L for L in lengths if L not in skip]
    results = {L: None for L in lengths}
    bar = tqdm(total=len(starts) * len(todo), desc=desc, unit="win", file=sys.stderr)
    for L in todo:
        total, batch = 0.0, max(1, max_length // L)
        for i in range(0, len(starts), batch):
            docs = [_tokens(arr, s, L + 1, device) for s in starts[i : i + batch]]
            with autocast():
                loss = token_losses(model, torch.stack([d[:-1] for d in docs]), torch.stack([d[1:] for d in docs]))
            total += loss.double().sum().item()
            bar.update(len(docs))
        results[L] = dict(tokens=len(starts) * L, ppl=math.exp(total / (len(starts) * L)))
    bar.close()
    return results


# ---- runs ----


def encoding_label(cfg):
    """'rope', 'rope+yarn(s=4,code)', 'pope', ... from a model_args dict (YaRN's ramp: rope_yarn_ramp,
    'paper' for a checkpoint without it)."""
    label = cfg.get("pos_encoding", "?")
    s = cfg.get("rope_scaling", 1.0)
    ramp = cfg.get("rope_yarn_ramp", "paper")
    return f"{label}+yarn(s={s:g},{ramp})" if label == "rope" and s != 1.0 else label


def inspect_run(run, rope_scaling, ds_meta, state=None):
    """(overrides, model_args, label, notes) of a run folder, its checkpoint read on the CPU and checked
    (readable, a valid config, the dataset's tokenizer) without building the model.
    overrides: the GPTConfig fields --rope_scaling sets. state: the checkpoint dict if already read
    (load_checkpoint), else best.pt is read. UserError on bad input."""
    state = load_checkpoint(run, "best.pt", "cpu") if state is None else state
    args = dict(state["model_args"])
    notes, overrides = [], {}
    if rope_scaling != 1.0:
        if args.get("pos_encoding") != "rope":
            notes.append(f"{run}: --rope_scaling applies to RoPE only; {args.get('pos_encoding')} runs as trained")
        elif args.get("rope_scaling", 1.0) != 1.0:
            notes.append(f"{run}: already YaRN (s={args['rope_scaling']:g}); --rope_scaling ignored")
        else:
            overrides = dict(rope_scaling=rope_scaling, rope_original_block_size=args["block_size"])
    try:
        GPTConfig(**{**args, **overrides})
    except (TypeError, ValueError) as e:
        raise UserError(f"{run}: its model_args do not make a model of this version ({e})") from None
    args.update(overrides)
    check_tokenizer(run, state, args, ds_meta)
    return overrides, args, encoding_label(args), notes


def check_tokenizer(run, state, args, ds_meta):
    """UserError if the run's tokens do not mean the dataset's tokens."""
    if ds_meta["vocab_size"] > args["vocab_size"]:
        raise UserError(
            f"{run} has a vocabulary of {args['vocab_size']} tokens, dataset "
            f"{ds_meta['dataset']} has {ds_meta['vocab_size']}: evaluate on the tokenizer it was trained with"
        )
    try:
        trained = tokenizer_from_checkpoint(state)
    except UserError:
        return  # an old checkpoint without its dataset at hand: the vocabulary check above is all we have
    if not same_tokenizer(trained, ds_meta):  # e.g. two char alphabets of one size: same shapes, other symbols
        raise UserError(
            f"{run} was trained with {describe_tokenizer(trained)}, --dataset has "
            f"{describe_tokenizer(ds_meta)}: pick the matching --dataset"
        )


# ---- outputs ----


def display_names(rows):
    """{run: 'label (folder)'} for table headers and the legend."""
    return {r["run"]: f"{r['label']} ({os.path.basename(os.path.normpath(r['run']))})" for r in rows}


def table_specs(protocol, last_k, stride=None):
    """[(title, row key, format)] of the markdown tables of a protocol."""
    if protocol == "sliding":
        return [
            (f"perplexity, sliding window (stride {stride}), token-weighted", "ppl", ".3f"),
            (
                f"perplexity, sliding window (stride {stride}), exp(mean of per-window mean losses) as YaRN reports it",
                "ppl_window_mean",
                ".3f",
            ),
        ]
    if protocol == "truncate":
        return [("perplexity over each document's first L tokens", "ppl", ".3f")]
    return [
        ("perplexity over all tokens of the windows", "ppl", ".3f"),
        (f"mean loss (nats) of the last {last_k} tokens, the same tokens at every length", "last_loss", ".4f"),
    ]


def markdown_tables(rows, runs, lengths, last_k, protocol="tiled", stride=None):
    names = display_names(rows)
    by = {(r["run"], r["length"]): r for r in rows}
    fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
    out = []
    for title, key, f in table_specs(protocol, last_k, stride):
        out.append(f"\n{title}\n")
        out.append("| length | tokens | " + " | ".join(names[r] for r in runs) + " |")
        out.append("|---:|---:|" + "---:|" * len(runs))
        for L in lengths:
            toks = {by[(r, L)]["tokens"] for r in runs if by[(r, L)]["tokens"] is not None}
            if key == "last_loss":
                toks = {last_k * by[(r, L)]["chunks"] for r in runs if by[(r, L)]["tokens"] is not None}
            tok = ", ".join(f"{t:,}" for t in sorted(toks))
            out.append(f"| {L} | {tok} | " + " | ".join(fmt(by[(r, L)].get(key), f) for r in runs) + " |")
    return "\n".join(out) + "\n"


CSV_COLUMNS = [
    "run",
    "label",
    "protocol",
    "one_document",
    "length",
    "tokens",
    "ppl",
    "ppl_window_mean",
    "last_loss",
    *FLAT_COLUMNS,
]


def write_csv(path, rows):
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for r in rows:
        cell = lambda v: "" if v is None else (f"{v:.6g}" if isinstance(v, float) else v)  # noqa: E731
        w.writerow([cell(r.get(k)) for k in CSV_COLUMNS])
    atomic_write(path, buf.getvalue())


def write_plot(path, rows, runs, train_lengths, dataset, protocol="tiled"):
    """Perplexity vs context length, log y, one line per run, training lengths as dotted verticals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    names = display_names(rows)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for run in runs:
        pts = [(r["length"], r["ppl"]) for r in rows if r["run"] == run and r["ppl"] is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=names[run])
    for t in sorted(set(train_lengths)):
        ax.axvline(t, color="gray", linestyle=":", linewidth=1)
        ax.annotate(
            f"trained at {t}",
            (t, 1),
            xycoords=("data", "axes fraction"),
            xytext=(3, -12),
            textcoords="offset points",
            fontsize=8,
            color="gray",
        )
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title(f"length extrapolation, {dataset}, {protocol} windows")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_open(path) as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


# ---- command line ----


def parse_lengths(text):
    try:
        lengths = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise UserError(f"--lengths must be comma-separated integers, got {text!r}") from None
    if not lengths or lengths[0] <= 0:
        raise UserError(f"--lengths must be positive token counts, got {text!r}")
    return lengths


def parse_stride(protocol, stride, shortest):
    """The stride of the sliding protocol (default DEFAULT_STRIDE), None for the others.
    UserError for a stride <= 0, one longer than the shortest length, or one given to another protocol."""
    if protocol != "sliding":
        if stride is not None:
            raise UserError("--stride applies to --protocol=sliding only; drop it or add --protocol=sliding")
        return None
    stride = DEFAULT_STRIDE if stride is None else stride
    if not 0 < stride <= shortest:
        raise UserError(
            f"--stride must lie in 1 .. the shortest length {shortest} (each window scores its last "
            f"stride tokens), got {stride}"
        )
    return stride


def select(protocol, offsets, max_length, max_tokens, seed):
    """(units, summary): what a protocol scores (chunk starts, [(start, m)] stretches or document starts)
    and one line that says so. UserError when no document is long enough."""
    if protocol == "tiled":
        starts = chunk_starts(offsets, max_length, max_tokens, seed)
        return starts, f"{len(starts)} chunks of {max_length + 1} tokens"
    if protocol == "sliding":
        stretches = sliding_stretches(offsets, max_length, max_tokens, seed)
        return stretches, (
            f"{len(stretches)} document(s) of at least {max_length + 1} tokens, "
            f"{sum(m for _, m in stretches):,} targets at every length"
        )
    starts = truncate_starts(offsets, max_length, max_tokens, seed)
    return starts, f"the first L + 1 tokens of {len(starts)} document(s) of at least {max_length + 1} tokens"


def parse_args(argv):
    p = ArgumentParser(
        prog="eval_extrapolate.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("runs", nargs="+", help="run folders (train.py out_dir) holding best.pt")
    p.add_argument("--dataset", default="pg19", help="prepared dataset folder under --data_root")
    p.add_argument("--data_root", default="data")
    p.add_argument("--split", default="test")
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, help="comma-separated context lengths in tokens")
    p.add_argument("--protocol", default="tiled", choices=PROTOCOLS, help="how windows are cut (see above)")
    p.add_argument(
        "--stride", type=int, default=None, help=f"sliding: new targets scored per window (default {DEFAULT_STRIDE})"
    )
    p.add_argument(
        "--doc_tokens",
        type=int,
        default=0,
        help="read a split without document offsets as documents of this many tokens (0: one document)",
    )
    p.add_argument(
        "--one_document",
        action="store_true",
        help="read the split as one document even where meta.json declares its documents (issues 54, 60 and 74 "
        "score shakespeare_char so: it declared none when issue 54 registered its chunks)",
    )
    p.add_argument("--last_k", type=int, default=256, help="tiled: targets per chunk in the same-tokens view")
    p.add_argument("--max_tokens", type=int, default=0, help="token budget per length (0: all chunks/documents)")
    p.add_argument("--seed", type=int, default=1337, help="draws the chunks/documents when --max_tokens limits them")
    p.add_argument("--rope_scaling", type=float, default=1.0, help="YaRN's s for RoPE runs trained without it (1: off)")
    p.add_argument("--yarn_scale", type=float, help=argparse.SUPPRESS)  # the old name of --rope_scaling
    p.add_argument("--out_dir", default="out-extrapolate", help="where the CSV and PNG go")
    p.add_argument("--device", default="auto", help="'auto' (cuda if available) | 'cpu' | 'cuda:1' ...")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="autocast dtype; 'auto': float32 on CPU, bf16 on CUDA where supported, else fp16",
    )
    a = p.parse_args(argv)
    if a.yarn_scale is not None:
        note_renamed("--yarn_scale", "--rope_scaling")
        a.rope_scaling = a.yarn_scale
    return a


def run(argv):
    """Evaluate as the command line asks; returns the result rows. UserError on bad input."""
    a = parse_args(argv)
    lengths = parse_lengths(a.lengths)
    if a.protocol == "tiled" and not 0 < a.last_k <= lengths[0]:  # the same-tokens view is tiled's only
        raise UserError(f"--last_k must lie in 1 .. the shortest length {lengths[0]}, got {a.last_k}")
    if a.max_tokens < 0:
        raise UserError(f"--max_tokens must be >= 0 (0: no limit), got {a.max_tokens}")
    if a.rope_scaling < 1.0:
        raise UserError(f"--rope_scaling is YaRN's s = L'/L >= 1 (1: off), got {a.rope_scaling}")
    stride = parse_stride(a.protocol, a.stride, lengths[0])
    data_dir = os.path.join(a.data_root, a.dataset)
    try:
        ds = Dataset(data_dir)
    except FileNotFoundError:
        raise UserError(
            f"unknown dataset {a.dataset!r}: no {data_dir}/meta.json; run prepare/{a.dataset}.py or pass --data_root"
        ) from None
    except ValueError as e:  # an empty split (data prepared before the prepare scripts refused them)
        raise UserError(str(e)) from None
    if ds.layout != "stream":
        raise UserError(f"dataset {a.dataset!r} has layout {ds.layout!r}; length extrapolation needs a stream dataset")
    if not ds.has_split(a.split):
        raise UserError(f"dataset {a.dataset!r} has no split {a.split!r}; it has {sorted(ds.meta['splits'])}")
    arr = ds.array(a.split)
    offsets = np.array([0, len(arr)], dtype=np.int64) if a.one_document else document_offsets(ds, a.split)
    if a.doc_tokens:
        if len(offsets) > 2 or not 0 < a.doc_tokens <= len(arr):
            raise UserError(
                f"--doc_tokens must lie in 1 .. {len(arr)} and applies to a split without document "
                f"offsets; {a.dataset}/{a.split} has {len(offsets) - 1} documents, got {a.doc_tokens}"
            )
        offsets = cut_documents(len(arr), a.doc_tokens)
    units, summary = select(a.protocol, offsets, lengths[-1], a.max_tokens, a.seed)

    device = resolve_device(a.device)
    autocast = functools.partial(autocast_context, device, resolve_dtype(a.dtype, device))  # a fresh context per use
    inspected = [inspect_run(run, a.rope_scaling, ds.meta) for run in a.runs]  # all errors before any work

    print(
        f"{a.dataset}/{a.split}: {len(arr):,} tokens; {a.protocol} windows"
        f"{f' (stride {stride})' if stride else ''}: {summary}; lengths {', '.join(map(str, lengths))}"
    )
    rows, train_lengths = [], []
    where = flat(provenance(data_dir, device))
    for run, (overrides, args, label, notes) in zip(a.runs, inspected):
        for n in notes:
            print(f"note: {n}")
        skip = ()
        if args["pos_encoding"] in ABSOLUTE_ENCODINGS:
            skip = [L for L in lengths if L > args["block_size"]]
            if skip:
                print(
                    f"note: {run} uses the absolute encoding {args['pos_encoding']!r}, which has no positions "
                    f"past block_size={args['block_size']}: lengths {', '.join(map(str, skip))} left empty"
                )
        train_lengths.append(args["block_size"])
        model = build_model(load_checkpoint(run, "best.pt", device), device, **overrides)  # one model at a time
        desc = f"{label} {run}"
        if a.protocol == "tiled":
            res = evaluate(model, arr, units, lengths, a.last_k, device, autocast, skip, desc)
        elif a.protocol == "sliding":
            res = evaluate_sliding(model, arr, units, lengths, stride, device, autocast, skip, desc)
        else:
            res = evaluate_truncate(model, arr, units, lengths, device, autocast, skip, desc)
        for L in lengths:
            rows.append(
                dict(
                    run=run,
                    label=label,
                    protocol=a.protocol,
                    one_document=a.one_document,
                    length=L,
                    chunks=len(units),
                    **{k: (res[L] or {}).get(k) for k in ("tokens", "ppl", "ppl_window_mean", "last_loss")},
                    **where,
                )
            )
        del model
    print(markdown_tables(rows, a.runs, lengths, a.last_k, a.protocol, stride))
    os.makedirs(a.out_dir, exist_ok=True)
    write_csv(os.path.join(a.out_dir, "extrapolation.csv"), rows)
    write_plot(os.path.join(a.out_dir, "extrapolation.png"), rows, a.runs, train_lengths, a.dataset, a.protocol)
    print(f"wrote {a.out_dir}/extrapolation.csv and {a.out_dir}/extrapolation.png")
    return rows


main = exit_on_user_error(run)  # the command line: bad input exits with code 2 after one line on stderr


if __name__ == "__main__":
    main(sys.argv[1:])
