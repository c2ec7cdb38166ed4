"""Length extrapolation: perplexity of trained models at contexts longer than they were trained on.

    python eval_extrapolate.py out-owt-124m-rope out-owt-124m-pope out-owt-124m-yarn-4096 out-owt-124m-pope-4096
    python eval_extrapolate.py out-x-rope out-x-pope --dataset=shakespeare_char --lengths=256,512,1024,2048,4096
    python eval_extrapolate.py out-owt-124m-rope --rope_scaling=4    # YaRN at evaluation time, no fine-tune

The paper's headline test (section 4, Figure 2): models trained at 1024 tokens, scored zero-shot on
the PG-19 test books at 1024, 2048, ..., 10240 tokens.

Windows (chosen once, from the dataset, the lengths, --max_tokens and --seed only, so every model
sees the same tokens):
  1. Documents: the dataset's document offsets where it has them (meta.json "documents", e.g. the
     PG-19 books of prepare/pg19.py), otherwise the whole split is one document.
  2. Chunks: each document is cut from its start into consecutive chunks of L_max + 1 tokens
     (L_max = the longest length), stepping by L_max, so the predicted tokens of two chunks never
     overlap; a document's tail shorter than a chunk is dropped. No chunk crosses a document.
  3. Budget: with --max_tokens=B > 0, max(1, B // L_max) chunks are drawn without replacement with
     numpy's generator seeded by --seed (then kept in dataset order); B = 0 keeps all chunks.
  4. At each length L, a chunk holds floor(L_max / L) non-overlapping windows of L inputs (and their
     L next-token targets), placed right to left from the chunk's end. So at every length the last
     window of a chunk ends at the same token, and each length scores at most B tokens.
Two numbers per model and length:
  ppl        the paper's: exp(mean next-token loss over all tokens of all windows at that length);
  last_loss  a same-tokens view: the mean loss (nats) of the last K (--last_k) targets of the window
             that ends at each chunk's end. These are the same tokens at every L; only the amount of
             context before them differs.
Absolute encodings (model.ABSOLUTE_ENCODINGS) cannot run past their block_size: those cells stay
empty, with a note. The windows of one chunk run as one batch (at most L_max tokens at a time)
under torch.no_grad; attention runs on SDPA's fused kernels (PoPE: its torch path or Triton kernel),
and the loss is taken over slices of positions, so memory grows as O(L_max), never with a (T, T)
score tensor or a (T, vocab) logit tensor for the full window.
(Exception: alibi_half passes its (H, T, T) bias to SDPA, so it grows as T^2.)
YaRN: a checkpoint fine-tuned with YaRN carries rope_scaling / rope_original_block_size in its
model_args and runs with them as is. --rope_scaling=S > 1 (train.py's name for YaRN's s; the old
flag --yarn_scale still works, with a note) gives the other RoPE runs s = S and L = their block_size
at evaluation time (no fine-tuning); other encodings ignore it, with a note.

Outputs: two markdown tables on stdout, and in --out_dir (written atomically):
  extrapolation.csv   one row per (model, length): run, label, length, tokens, ppl, last_loss
  extrapolation.png   perplexity vs context length, log y, one line per model, training length marked
Labels name the encoding: `rope`, `rope+yarn(s=4)`, `pope`, `none`, ...; the legend adds the run folder.
Bad input (no best.pt, unknown dataset, a length <= 0, no document long enough for the longest
length, ...) prints one line and exits with code 2.
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

from checkpoint import build_model, load_checkpoint, tokenizer_from_checkpoint
from cli import (DTYPES, UserError, atomic_open, atomic_write, autocast_context, exit_on_user_error, note_renamed,
                 resolve_device, resolve_dtype)
from data import Dataset
from model import ABSOLUTE_ENCODINGS, GPTConfig

DEFAULT_LENGTHS = ",".join(str(1024 * i) for i in range(1, 11))


# ---- windows ----

def document_offsets(ds, split):
    """int64 offsets (n_docs + 1,) of the documents of a stream split: document i is
    arr[off[i]:off[i+1]]. From meta.json "documents"[split] where the dataset declares them (format:
    prepare/pg19.py), else [0, n_tokens] (one document)."""
    n = len(ds.array(split))
    docs = ds.meta.get("documents", {}).get(split)
    if not docs:
        return np.array([0, n], dtype=np.int64)
    off = np.fromfile(os.path.join(ds.dir, docs["file"]), dtype=docs.get("dtype", "int64")).astype(np.int64)
    if len(off) < 2 or off[0] != 0 or off[-1] != n or np.any(np.diff(off) < 0):
        raise UserError(f"{ds.dir}/{docs['file']} does not hold document offsets 0 .. {n} of {split}.bin; "
                        "prepare the dataset again")
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
        raise UserError(f"the longest length {max_length} needs a document of at least {max_length + 1} tokens; "
                        f"the longest has {longest}: use shorter --lengths or another --split/--dataset")
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


# ---- scoring ----

@torch.no_grad()
def token_losses(model, x, y):
    """Next-token losses (B, T) float32 in nats of model on inputs x (B, T) and targets y (B, T).

    The lm_head and cross-entropy run on slices of at most 2**24 / vocab_size positions, so no
    (B, T, vocab) logit tensor is held at once.
    """
    h = model._hidden(x)  # (B, T, n_embd), the final RMSNorm applied
    B, T, C = h.shape
    h, y = h.reshape(B * T, C), y.reshape(B * T)
    step = max(1, 2 ** 24 // model.lm_head.out_features)
    out = torch.empty(B * T, dtype=torch.float32, device=h.device)
    for i in range(0, B * T, step):
        logits = model.lm_head(h[i:i + step]).float()
        out[i:i + step] = F.cross_entropy(logits, y[i:i + step], reduction="none")
    return out.view(B, T)


@torch.no_grad()
def evaluate(model, arr, starts, lengths, last_k, device="cpu", autocast=nullcontext, skip=(), desc=None):
    """{length: (tokens, ppl, last_loss)} of one model over the chunks at `starts` (see module docstring).

    arr: 1-D token array; starts: chunk starts; lengths: ascending ints; last_k: targets per chunk in
    the same-tokens view. Lengths in `skip` are not run (value None).
    """
    max_length = max(lengths)
    todo = [L for L in lengths if L not in skip]
    results = {L: None for L in lengths}
    bar = tqdm(total=len(starts) * sum(max_length // L for L in todo), desc=desc, unit="win", file=sys.stderr)
    for L in todo:
        offs = window_offsets(L, max_length)
        total, n_tok, last_total = 0.0, 0, 0.0
        for s in starts:
            chunk = torch.from_numpy(np.asarray(arr[s:s + max_length + 1]).astype(np.int64)).to(device)
            x = torch.stack([chunk[o:o + L] for o in offs])
            y = torch.stack([chunk[o + 1:o + L + 1] for o in offs])
            with autocast():
                loss = token_losses(model, x, y).double()
            total += loss.sum().item()
            n_tok += loss.numel()
            last_total += loss[0, -last_k:].sum().item()  # window 0 ends at the chunk's end
            bar.update(len(offs))
        results[L] = (n_tok, math.exp(total / n_tok), last_total / (last_k * len(starts)))
    bar.close()
    return results


# ---- runs ----

def encoding_label(cfg):
    """'rope', 'rope+yarn(s=4)', 'pope', ... from a model_args dict."""
    label = cfg.get("pos_encoding", "?")
    s = cfg.get("rope_scaling", 1.0)
    return f"{label}+yarn(s={s:g})" if label == "rope" and s != 1.0 else label


def inspect_run(run, rope_scaling, ds_meta):
    """(overrides, model_args, label, notes) of a run folder, its checkpoint read on the CPU and checked
    (readable, a valid config, the dataset's tokenizer) without building the model.
    overrides: the GPTConfig fields --rope_scaling sets. UserError on bad input."""
    state = load_checkpoint(run, "best.pt", "cpu")
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
        raise UserError(f"{run} has a vocabulary of {args['vocab_size']} tokens, dataset "
                        f"{ds_meta['dataset']} has {ds_meta['vocab_size']}: evaluate on the tokenizer it was trained with")
    try:
        trained = tokenizer_from_checkpoint(state)
    except UserError:
        return  # an old checkpoint without its dataset at hand: the vocabulary check above is all we have
    mine, theirs = trained.get("tokenizer") or {}, ds_meta.get("tokenizer") or {}
    if mine.get("kind") != theirs.get("kind") or mine.get("itos") != theirs.get("itos"):
        raise UserError(f"{run} was trained with tokenizer {mine.get('kind')!r} (dataset {trained.get('dataset')}), "
                        f"dataset {ds_meta['dataset']} uses {theirs.get('kind')!r}: pick the matching --dataset")


# ---- outputs ----

def display_names(rows):
    """{run: 'label (folder)'} for table headers and the legend."""
    return {r["run"]: f"{r['label']} ({os.path.basename(os.path.normpath(r['run']))})" for r in rows}


def markdown_tables(rows, runs, lengths, last_k):
    names = display_names(rows)
    by = {(r["run"], r["length"]): r for r in rows}
    fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
    out = []
    for title, key, f in (("perplexity over all tokens of the windows", "ppl", ".3f"),
                          (f"mean loss (nats) of the last {last_k} tokens, the same tokens at every length",
                           "last_loss", ".4f")):
        out.append(f"\n{title}\n")
        out.append("| length | tokens | " + " | ".join(names[r] for r in runs) + " |")
        out.append("|---:|---:|" + "---:|" * len(runs))
        for L in lengths:
            toks = {by[(r, L)]["tokens"] for r in runs if by[(r, L)]["tokens"] is not None}
            if key == "last_loss":
                toks = {last_k * by[(r, L)]["chunks"] for r in runs if by[(r, L)]["tokens"] is not None}
            tok = ", ".join(f"{t:,}" for t in sorted(toks))
            out.append(f"| {L} | {tok} | " + " | ".join(fmt(by[(r, L)][key], f) for r in runs) + " |")
    return "\n".join(out) + "\n"


def write_csv(path, rows):
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["run", "label", "length", "tokens", "ppl", "last_loss"])
    for r in rows:
        w.writerow([r["run"], r["label"], r["length"], "" if r["tokens"] is None else r["tokens"],
                    "" if r["ppl"] is None else f"{r['ppl']:.6g}",
                    "" if r["last_loss"] is None else f"{r['last_loss']:.6g}"])
    atomic_write(path, buf.getvalue())


def write_plot(path, rows, runs, train_lengths, dataset):
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
        ax.annotate(f"trained at {t}", (t, 1), xycoords=("data", "axes fraction"), xytext=(3, -12),
                    textcoords="offset points", fontsize=8, color="gray")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title(f"length extrapolation, {dataset}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_open(path) as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


# ---- command line ----

class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2 (main), instead of usage + message
        raise UserError(f"{message} (see python eval_extrapolate.py --help)")


def parse_lengths(text):
    try:
        lengths = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise UserError(f"--lengths must be comma-separated integers, got {text!r}") from None
    if not lengths or lengths[0] <= 0:
        raise UserError(f"--lengths must be positive token counts, got {text!r}")
    return lengths


def parse_args(argv):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run folders (train.py out_dir) holding best.pt")
    p.add_argument("--dataset", default="pg19", help="prepared dataset folder under --data_root")
    p.add_argument("--data_root", default="data")
    p.add_argument("--split", default="test")
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, help="comma-separated context lengths in tokens")
    p.add_argument("--last_k", type=int, default=256, help="targets per chunk in the same-tokens view")
    p.add_argument("--max_tokens", type=int, default=0, help="token budget per length (0: all chunks)")
    p.add_argument("--seed", type=int, default=1337, help="draws the chunks when --max_tokens limits them")
    p.add_argument("--rope_scaling", type=float, default=1.0, help="YaRN's s for RoPE runs trained without it (1: off)")
    p.add_argument("--yarn_scale", type=float, help=argparse.SUPPRESS)  # the old name of --rope_scaling
    p.add_argument("--out_dir", default="out-extrapolate", help="where the CSV and PNG go")
    p.add_argument("--device", default="auto", help="'auto' (cuda if available) | 'cpu' | 'cuda:1' ...")
    p.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                   help="autocast dtype; 'auto': float32 on CPU, bf16 on CUDA where supported, else fp16")
    a = p.parse_args(argv)
    if a.yarn_scale is not None:
        note_renamed("--yarn_scale", "--rope_scaling")
        a.rope_scaling = a.yarn_scale
    return a


def run(argv):
    """Evaluate as the command line asks; returns the result rows. UserError on bad input."""
    a = parse_args(argv)
    lengths = parse_lengths(a.lengths)
    if not 0 < a.last_k <= lengths[0]:
        raise UserError(f"--last_k must lie in 1 .. the shortest length {lengths[0]}, got {a.last_k}")
    if a.max_tokens < 0:
        raise UserError(f"--max_tokens must be >= 0 (0: no limit), got {a.max_tokens}")
    if a.rope_scaling < 1.0:
        raise UserError(f"--rope_scaling is YaRN's s = L'/L >= 1 (1: off), got {a.rope_scaling}")
    data_dir = os.path.join(a.data_root, a.dataset)
    try:
        ds = Dataset(data_dir)
    except FileNotFoundError:
        raise UserError(f"unknown dataset {a.dataset!r}: no {data_dir}/meta.json; run prepare/{a.dataset}.py "
                        f"or pass --data_root") from None
    if ds.layout != "stream":
        raise UserError(f"dataset {a.dataset!r} has layout {ds.layout!r}; length extrapolation needs a stream dataset")
    if not ds.has_split(a.split):
        raise UserError(f"dataset {a.dataset!r} has no split {a.split!r}; it has {sorted(ds.meta['splits'])}")
    arr = ds.array(a.split)
    starts = chunk_starts(document_offsets(ds, a.split), lengths[-1], a.max_tokens, a.seed)

    device = resolve_device(a.device)
    autocast = functools.partial(autocast_context, device, resolve_dtype(a.dtype, device))  # a fresh context per use
    inspected = [inspect_run(run, a.rope_scaling, ds.meta) for run in a.runs]  # all errors before any work

    print(f"{a.dataset}/{a.split}: {len(arr):,} tokens, {len(starts)} chunks of {lengths[-1] + 1} tokens, "
          f"lengths {', '.join(map(str, lengths))}")
    rows, train_lengths = [], []
    for run, (overrides, args, label, notes) in zip(a.runs, inspected):
        for n in notes:
            print(f"note: {n}")
        skip = ()
        if args["pos_encoding"] in ABSOLUTE_ENCODINGS:
            skip = [L for L in lengths if L > args["block_size"]]
            if skip:
                print(f"note: {run} uses the absolute encoding {args['pos_encoding']!r}, which has no positions "
                      f"past block_size={args['block_size']}: lengths {', '.join(map(str, skip))} left empty")
        train_lengths.append(args["block_size"])
        model = build_model(load_checkpoint(run, "best.pt", device), device, **overrides)  # one model at a time
        res = evaluate(model, arr, starts, lengths, a.last_k, device, autocast, skip, desc=f"{label} {run}")
        for L in lengths:
            tokens, ppl, last = res[L] or (None, None, None)
            rows.append(dict(run=run, label=label, length=L, tokens=tokens, ppl=ppl, last_loss=last,
                             chunks=len(starts)))
        del model
    print(markdown_tables(rows, a.runs, lengths, a.last_k))
    os.makedirs(a.out_dir, exist_ok=True)
    write_csv(os.path.join(a.out_dir, "extrapolation.csv"), rows)
    write_plot(os.path.join(a.out_dir, "extrapolation.png"), rows, a.runs, train_lengths, a.dataset)
    print(f"wrote {a.out_dir}/extrapolation.csv and {a.out_dir}/extrapolation.png")
    return rows


main = exit_on_user_error(run)  # the command line: bad input exits with code 2 after one line on stderr


if __name__ == "__main__":
    main(sys.argv[1:])
