"""Length extrapolation beyond perplexity: passkey retrieval and long-range copying at 1x .. 16x the
training context, generated, seeded and offline, on any run folder that eval_extrapolate.py takes.

    python eval_retrieval.py out-shakespeare-char-rope out-shakespeare-char-pope
    python eval_retrieval.py out-owt-124m-rope out-owt-124m-pope out-owt-124m-yarn-4096 --multiples=1,2,4,8
    python eval_retrieval.py out-owt-124m-rope --rope_scaling=4 --tasks=passkey   # YaRN at evaluation time

Lengths: --lengths in tokens, or --multiples (default 1,2,4,8,16) of the first run's training context
(rope_original_block_size of a YaRN fine-tune, else block_size). Every model reads exactly L tokens.

passkey  The protocol of Mohtashami & Jaggi 2023 (Landmark Attention, section 4.2), as the YaRN paper
         uses it. The window holds filler sentences (FILLER_SENTENCES, repeated, cut from the left to
         fit), the key sentence KEY_SENTENCE at a depth d (0: the window's start, 1: just before the
         question; placed at the sentence boundary of the filler nearest to d x the filler's length),
         then QUESTION, then the answer " K" but its last token. Score: exact match of the greedy
         continuation, i.e. the argmax at every answer position equals the answer's token (with the
         answer fed in, which equals greedy decoding while it is right). Landmark's task line ("There is
         an important info hidden ...") is left out: at a 256-character context it would fill 60 % of
         the window. The key: --key_len symbols from the digits 0-9 where the tokenizer spells each as
         one character (GPT-2 BPE always; char vocabularies that hold all ten), else from the lowercase
         letters it holds; the alphabet used is printed and written to the CSV.
         Per (length, depth): --trials keys; accuracy with its Wilson 95 % interval (results.wilson).
copy     The induction test of Olsson et al. 2022: a random sequence s of m = ceil((L + 1) / 2) tokens
         (uniform over the tokenizer's ids but padding), then s again, cut to L + 1 tokens; the model reads
         the first L and predicts the next token at each. Scored: the second copy after its first token
         (the L - m targets whose answer lies m tokens back: the distance), and, as the no-retrieval
         baseline, the first copy. Loss (nats, mean over targets) and next-token accuracy, over --copy_trials
         sequences per length (default 200: the former 8 added about 0.85 points of noise at 4x, issue 53),
         with the accuracy's Wilson 95 % interval over the targets. The distance is about L / 2: a distance
         of 16x the context needs L = 32x.

Seeds: each (task, length, depth) draws from numpy's default_rng([--seed, task, L, depth index]) (task:
passkey 0, copy 1; copy has no depth), so a number does not change when other lengths are added, nor when
depths are added after the last (the index of a depth counts the smaller depths asked: adding 0.5 to
--depths=0,1 draws other keys at depth 1), and every model with one tokenizer sees the same prompts and
sequences.
Memory is O(L): attention runs on SDPA's fused kernels (PoPE: its torch path or Triton kernel), and the
lm_head and cross-entropy run on slices of positions (eval_extrapolate.token_losses' rule); windows of
one length run max(1, L_max // L) at a time. Checkpoint loading, the tokenizer check, YaRN (a fine-tune's
own rope_scaling, or --rope_scaling=S at evaluation time) and absolute encodings (no cells past
block_size) are eval_extrapolate.py's.

Outputs: markdown tables on stdout (passkey accuracy per length over all depths, per length and depth,
copy loss/accuracy per length, seconds per length), and in --out_dir, written atomically:
  passkey.csv   one row per (model, length, depth): run, label, length, multiple, depth, trials, correct,
                accuracy, ci_low, ci_high, key_alphabet, seconds, provenance (provenance.flat)
  copy.csv      one row per (model, length): run, label, length, multiple, distance, trials, targets,
                loss_second, acc_second, loss_first, acc_first, seconds, provenance, then hits_second,
                acc_second_low, acc_second_high (the Wilson 95 % interval of acc_second over its targets:
                binomial noise only, it treats the targets of one sequence as independent)
  retrieval.png passkey accuracy (Wilson intervals) and second-copy accuracy vs length, one line per model
Lengths shorter than the passkey prompt without filler (102 characters with a 5-symbol key; with GPT-2
BPE 28 to 31 tokens, the longest over the keys drawn) get no passkey row (a note says which; copying
still runs them): a context-64 model's passkey starts at 2x. A length where the key lies as far from its
answer as the run's training context (block_size) or farther at every depth asked (at depth 1 the key's
first spelling is 81 characters before the answer) is refused with a note: no cell there can succeed
by construction, so a context-64 character model gets no passkey row at all (exit 2 with --tasks=passkey).
Bad input (no best.pt, every length too short for the passkey prompt, a tokenizer that cannot spell it,
a copy length under 3 tokens, a depth outside [0, 1], trials < 1, ...) prints one line and exits with code 2.
"""

import argparse
import csv
import functools
import io
import os
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F

from checkpoint import build_model, load_checkpoint, load_codec, tokenizer_from_checkpoint
from cli import (
    DTYPES,
    ArgumentParser,
    UserError,
    atomic_open,
    atomic_write,
    autocast_context,
    exit_on_user_error,
    resolve_device,
    resolve_dtype,
)
from eval_extrapolate import display_names, inspect_run, parse_lengths
from model import ABSOLUTE_ENCODINGS
from provenance import FLAT_COLUMNS, flat, provenance
from study.results import wilson  # the Wilson interval every study table uses

FILLER_SENTENCES = (
    " The grass is green.",
    " The sky is blue.",
    " The sun is yellow.",
    " Here we go.",
    " There and back again.",
)  # Landmark Attention's filler, one unit per sentence
KEY_SENTENCE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
DIGITS = "0123456789"
TASKS = ("passkey", "copy")
TASK_SEED = {"passkey": 0, "copy": 1}


# ---- generators ----


def key_alphabet(meta):
    """The symbols a passkey is drawn from for a tokenizer description (tokenizer_from_checkpoint): the
    digits where every digit is one character of the vocabulary (GPT-2 BPE: always), else the lowercase
    letters a char vocabulary holds. UserError for other tokenizers or fewer than two symbols."""
    tok = meta.get("tokenizer") or {}
    if tok.get("kind") == "gpt2":
        return DIGITS
    if tok.get("kind") != "char":
        raise UserError(
            f"passkey retrieval needs a text tokenizer ('char' or 'gpt2'), this run has "
            f"{tok.get('kind')!r}; run --tasks=copy only"
        )
    itos = set(tok["itos"])
    if set(DIGITS) <= itos:
        return DIGITS
    letters = "".join(c for c in "abcdefghijklmnopqrstuvwxyz" if c in itos)
    if len(letters) < 2:
        raise UserError(
            "this char vocabulary has neither the ten digits nor two lowercase letters for a passkey; "
            "run --tasks=copy only"
        )
    return letters


def passkey_parts(encode, key):
    """(key_ids, question_ids, answer_ids) of one key: the token ids of KEY_SENTENCE, QUESTION and " key".
    encode: str -> list[int] (checkpoint.load_codec); ValueError if the tokenizer cannot spell them."""
    return encode(KEY_SENTENCE.format(key=key)), encode(QUESTION), encode(" " + key)


def filler_stream(units, n):
    """(ids, boundaries) of n filler tokens: the units (lists of token ids, one per sentence) repeated in
    order and cut from the left to n tokens; boundaries: the sorted positions in 0 .. n where a sentence
    may go without splitting one and be followed by a whole one (n and every unit start). The cut leaves
    a fragment of a sentence at the stream's start: 0 is a boundary only where a unit starts there, so a
    key sentence never runs into a fragment cut mid-word (the fragment stays the window's first tokens)."""
    period = sum(len(u) for u in units)
    reps = -(-n // period) + 1 if n else 0
    ids, starts = [], []
    for _ in range(reps):
        for u in units:
            starts.append(len(ids))
            ids.extend(u)
    cut = len(ids) - n
    return ids[cut:], sorted({n, *(s - cut for s in starts if 0 <= s - cut <= n)})


def passkey_window(encode, key, length, depth):
    """One passkey prompt of exactly `length` tokens: (x, answer, key_pos).

    x: list of `length` ids = filler[:p] + key sentence + filler[p:] + question + answer[:-1]; answer: the
    ids of " key", the greedy continuation that scores; key_pos: p, the index of the key sentence's first
    token, the filler boundary nearest to depth * n_filler (ties: the earlier). depth in [0, 1]. filler[p:]
    starts with a whole sentence (filler_stream's boundaries): at depth 0 the key sentence follows the
    filler's leading fragment, if the cut left one, and is followed by a whole sentence.
    UserError when the length cannot hold the key sentence, the question and the answer.
    """
    key_ids, q_ids, a_ids = passkey_parts(encode, key)
    n_fill = length - len(key_ids) - len(q_ids) - (len(a_ids) - 1)
    if n_fill < 0:
        raise UserError(
            f"length {length} is shorter than the passkey prompt without filler "
            f"({length - n_fill} tokens): use longer --lengths"
        )
    fill, bounds = filler_stream([encode(s) for s in FILLER_SENTENCES], n_fill)
    target = depth * n_fill
    p = min(bounds, key=lambda b: (abs(b - target), b))
    x = fill[:p] + key_ids + fill[p:] + q_ids + a_ids[:-1]
    assert len(x) == length
    return x, a_ids, p


def answer_distance(encode, key, length, depth):
    """Tokens from the key to its answer in the passkey window of (key, length, depth): from the first token
    of " key" after "The pass key is" in the key sentence (the spelling the question's own "The pass key is"
    matches) to the first answer token. Answering needs attention over this distance: a run trained at a
    context of T attends at most T - 1 back (see run: lengths where even the nearest depth exceeds it are
    refused)."""
    _, answer, p = passkey_window(encode, key, length, depth)
    key_ids, n = encode(KEY_SENTENCE.format(key=key)), len(answer)
    s = next((i for i in range(len(key_ids) - n + 1) if key_ids[i : i + n] == answer), 0)
    return (length - n + 1) - (p + s)


def random_key(rng, alphabet, key_len):
    """A key of key_len symbols drawn uniformly (with replacement) from alphabet by rng."""
    return "".join(alphabet[i] for i in rng.integers(0, len(alphabet), key_len))


def passkey_keys(alphabet, key_len, trials, seed, length, depth_index):
    """The `trials` keys of one (length, depth index): drawn from default_rng([seed, passkey, length, depth
    index]), the stream run_passkey uses."""
    rng = np.random.default_rng([seed, TASK_SEED["passkey"], length, depth_index])
    return [random_key(rng, alphabet, key_len) for _ in range(trials)]


def prompt_tokens(encode, key):
    """Tokens of the passkey prompt of `key` without filler: key sentence, question, answer but its last.
    With GPT-2 BPE it depends on the key ("00000": 28 tokens, "00521": 31), so a length is sized from the
    longest over the keys drawn."""
    return sum(map(len, passkey_parts(encode, key))) - 1


def copy_window(seq, length):
    """(x, y, m) of the copy test: chunk = seq + seq cut to length + 1 tokens; x = chunk[:length],
    y = chunk[1:] (next tokens); m = len(seq), the distance between the copies. The second copy's scored
    targets are y[m:] (tokens 1 .. of the second copy), the first copy's y[:m - 1]. seq must have
    m = ceil((length + 1) / 2) tokens."""
    m = len(seq)
    if m != -(-(length + 1) // 2):
        raise ValueError(f"a copy window of {length} tokens needs a sequence of {-(-(length + 1) // 2)}, got {m}")
    chunk = np.concatenate([seq, seq])[: length + 1]
    return chunk[:-1], chunk[1:], m


def copy_ids(meta, vocab_size):
    """int64 ids a copy sequence is drawn from: the tokenizer's symbols (char: its itos, GPT-2: 50257) or
    0 .. vocab_size - 1, without the padding id."""
    tok, pad = meta.get("tokenizer") or {}, meta.get("pad_id")
    n = len(tok["itos"]) if tok.get("kind") == "char" else 50257 if tok.get("kind") == "gpt2" else vocab_size
    ids = np.arange(min(n, vocab_size), dtype=np.int64)
    return ids[ids != pad] if pad is not None else ids


# ---- scoring ----


@torch.no_grad()
def score_last(model, x, y):
    """(losses, hits) of the predictions at x's last n positions: x (B, T) int64 inputs, y (B, n) int64
    targets of x's last n positions, n <= T. losses (B, n) float32 cross-entropy in nats; hits (B, n) bool,
    argmax == target. The lm_head runs on slices of at most 2**24 / vocab_size positions (no (B, T, vocab)
    tensor); model: anything with hidden_states(x) -> (B, T, C) and lm_head."""
    h = model.hidden_states(x)[:, x.shape[1] - y.shape[1] :]
    B, n, C = h.shape
    h, y = h.reshape(B * n, C), y.reshape(B * n)
    step = max(1, 2**24 // model.lm_head.out_features)
    losses = torch.empty(B * n, dtype=torch.float32, device=h.device)
    hits = torch.empty(B * n, dtype=torch.bool, device=h.device)
    for i in range(0, B * n, step):
        logits = model.lm_head(h[i : i + step]).float()
        losses[i : i + step] = F.cross_entropy(logits, y[i : i + step], reduction="none")
        hits[i : i + step] = logits.argmax(-1) == y[i : i + step]
    return losses.view(B, n), hits.view(B, n)


@torch.no_grad()
def passkey_correct(model, windows, device="cpu", autocast=nullcontext):
    """Exact-match flags (list of bool) of passkey windows [(x, answer, key_pos)] of one length, run as one
    batch: True where the argmax at every answer position is the answer's token."""
    n = max(len(a) for _, a, _ in windows)
    x = torch.tensor([w[0] for w in windows], dtype=torch.int64, device=device)
    # x's last len(a) positions (the question's last token, then the answer but its last) predict the answer;
    # shorter answers are left-padded with id 0, whose positions are not read
    y = torch.tensor([[0] * (n - len(a)) + a for _, a, _ in windows], dtype=torch.int64, device=device)
    with autocast():
        _, hits = score_last(model, x, y)
    return [bool(hits[i, n - len(a) :].all()) for i, (_, a, _) in enumerate(windows)]


def run_passkey(
    model,
    encode,
    alphabet,
    lengths,
    depths,
    trials,
    key_len,
    seed,
    max_length,
    device="cpu",
    autocast=nullcontext,
    skip=(),
):
    """{(length, depth): (correct, trials, seconds)} of one model; lengths in `skip` are left out."""
    out = {}
    for L in lengths:
        if L in skip:
            continue
        batch = max(1, max_length // L)
        for j, d in enumerate(depths):
            windows = [passkey_window(encode, k, L, d) for k in passkey_keys(alphabet, key_len, trials, seed, L, j)]
            t0 = time.perf_counter()
            ok = []
            for i in range(0, trials, batch):
                ok += passkey_correct(model, windows[i : i + batch], device, autocast)
            out[(L, d)] = (sum(ok), trials, time.perf_counter() - t0)
    return out


@torch.no_grad()
def run_copy(model, ids, lengths, trials, seed, max_length, device="cpu", autocast=nullcontext, skip=()):
    """{length: dict(distance, trials, targets, loss_second, acc_second, hits_second, acc_second_low,
    acc_second_high, loss_first, acc_first, seconds)} of one model; losses in nats, accuracies as fractions,
    means over all scored targets; hits_second of targets correct, (acc_second_low, acc_second_high) its
    Wilson 95 % interval (results.wilson) over the targets."""
    out = {}
    for L in lengths:
        if L in skip:
            continue
        rng = np.random.default_rng([seed, TASK_SEED["copy"], L])
        m = -(-(L + 1) // 2)
        seqs = [rng.choice(ids, m) for _ in range(trials)]
        sums = np.zeros(4)
        t0 = time.perf_counter()
        batch = max(1, max_length // L)
        for i in range(0, trials, batch):
            xy = [copy_window(s, L) for s in seqs[i : i + batch]]
            x = torch.tensor(np.stack([a for a, _, _ in xy]), device=device)
            y = torch.tensor(np.stack([b for _, b, _ in xy]), device=device)
            with autocast():
                loss, hit = score_last(model, x, y)
            sums += [
                loss[:, m:].double().sum().item(),
                hit[:, m:].sum().item(),
                loss[:, : m - 1].double().sum().item(),
                hit[:, : m - 1].sum().item(),
            ]
        n2, n1 = trials * (L - m), trials * (m - 1)
        hits = int(round(sums[1]))
        _, (lo, hi) = wilson(hits, n2)
        out[L] = dict(
            distance=m,
            trials=trials,
            targets=n2,
            loss_second=sums[0] / n2,
            acc_second=hits / n2,
            hits_second=hits,
            acc_second_low=lo,
            acc_second_high=hi,
            loss_first=sums[2] / n1 if n1 else None,
            acc_first=sums[3] / n1 if n1 else None,
            seconds=time.perf_counter() - t0,
        )
    return out


# ---- outputs ----

PASSKEY_COLUMNS = [
    "run",
    "label",
    "length",
    "multiple",
    "depth",
    "trials",
    "correct",
    "accuracy",
    "ci_low",
    "ci_high",
    "key_alphabet",
    "seconds",
    *FLAT_COLUMNS,
]
COPY_COLUMNS = [
    "run",
    "label",
    "length",
    "multiple",
    "distance",
    "trials",
    "targets",
    "loss_second",
    "acc_second",
    "loss_first",
    "acc_first",
    "seconds",
    *FLAT_COLUMNS,
    "hits_second",
    "acc_second_low",
    "acc_second_high",
]  # issue 53: appended, the old columns unchanged


def write_csv(path, columns, rows):
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for r in rows:
        w.writerow(["" if r.get(k) is None else (f"{r[k]:.6g}" if isinstance(r[k], float) else r[k]) for k in columns])
    atomic_write(path, buf.getvalue())


def pooled(rows, run, L):
    """(correct, trials) of a run at length L over all depths, or None if not scored."""
    cells = [r for r in rows if r["run"] == run and r["length"] == L]
    return (sum(r["correct"] for r in cells), sum(r["trials"] for r in cells)) if cells else None


def passkey_tables(rows, runs, lengths, depths, names):
    """Markdown: pooled accuracy per length (one column per run), then accuracy by depth for each run.
    names: {run: header}."""
    out = [
        "\npasskey retrieval, exact match over all depths: correct / trials (accuracy, Wilson 95 % interval)\n",
        "| length | " + " | ".join(names[r] for r in runs) + " |",
        "|---:|" + "---|" * len(runs),
    ]
    for L in lengths:
        cells = []
        for r in runs:
            kn = pooled(rows, r, L)
            cells.append("" if kn is None else "{}/{} ({:.2f}, {:.2f}-{:.2f})".format(*kn, *_flat(wilson(*kn))))
        out.append(f"| {L} | " + " | ".join(cells) + " |")
    for r in runs:
        by = {(x["length"], x["depth"]): x for x in rows if x["run"] == r}
        out += [
            f"\npasskey accuracy by depth, {names[r]}\n",
            "| length | " + " | ".join(f"d={d:g}" for d in depths) + " | seconds |",
            "|---:|" + "---:|" * (len(depths) + 1),
        ]
        for L in lengths:
            if (L, depths[0]) in by:
                secs = sum(by[(L, d)]["seconds"] for d in depths)
                out.append(
                    f"| {L} | " + " | ".join(f"{by[(L, d)]['accuracy']:.2f}" for d in depths) + f" | {secs:.1f} |"
                )
    return "\n".join(out) + "\n"


def _flat(rate_ci):
    return rate_ci[0], *rate_ci[1]


def copy_table(rows, runs, lengths, names):
    """Markdown: per length, the distance and each run's second-copy accuracy (its Wilson 95 % interval over
    the targets) / loss, first-copy accuracy."""
    out = [
        "\nlong-range copying: second copy accuracy (Wilson 95 % interval over the targets) / loss (nats) "
        "[first copy accuracy]; seconds\n",
        "| length | distance | " + " | ".join(names[r] for r in runs) + " |",
        "|---:|---:|" + "---|" * len(runs),
    ]
    by = {(r["run"], r["length"]): r for r in rows}
    for L in lengths:
        dist = {by[(r, L)]["distance"] for r in runs if (r, L) in by}
        cells = [
            ""
            if (r, L) not in by
            else "{:.3f} ({:.3f}-{:.3f}) / {:.3f} [{:.3f}]; {:.1f} s".format(
                by[(r, L)]["acc_second"],
                by[(r, L)]["acc_second_low"],
                by[(r, L)]["acc_second_high"],
                by[(r, L)]["loss_second"],
                by[(r, L)]["acc_first"] or 0.0,
                by[(r, L)]["seconds"],
            )
            for r in runs
        ]
        out.append(f"| {L} | {', '.join(map(str, sorted(dist)))} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def write_plot(path, pk_rows, cp_rows, runs, lengths, train_length, names):
    """Two panels vs length (log x): passkey accuracy over all depths with Wilson intervals; second-copy
    next-token accuracy. The training context as a dotted vertical."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in (("passkey", pk_rows), ("copy", cp_rows)) if p[1]]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.0), squeeze=False)
    for ax, (task, rows) in zip(axes[0], panels):
        for run in runs:
            if task == "passkey":
                pts = [(L, *_flat(wilson(*pooled(rows, run, L)))) for L in lengths if pooled(rows, run, L)]
                if pts:
                    Ls, acc, lo, hi = map(np.array, zip(*pts))
                    ax.errorbar(Ls, acc, yerr=[acc - lo, hi - acc], marker="o", capsize=3, label=names[run])
            else:
                pts = [(r["length"], r["acc_second"]) for r in rows if r["run"] == run]
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=names[run])
        ax.axvline(train_length, color="gray", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("exact-match accuracy" if task == "passkey" else "next-token accuracy, second copy")
        ax.set_title("passkey retrieval" if task == "passkey" else "long-range copying")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_open(path) as f:
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)


# ---- command line ----


def parse_floats(text, name, low=None, high=None):
    try:
        vals = sorted({float(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise UserError(f"{name} must be comma-separated numbers, got {text!r}") from None
    if not vals or (low is not None and vals[0] < low) or (high is not None and vals[-1] > high):
        raise UserError(f"{name} must lie in [{low}, {high if high is not None else 'inf'}), got {text!r}")
    return vals


def parse_args(argv):
    p = ArgumentParser(
        prog="eval_retrieval.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("runs", nargs="+", help="run folders (train.py out_dir) holding best.pt")
    p.add_argument("--tasks", default="passkey,copy", help="comma-separated: passkey, copy")
    p.add_argument("--lengths", default=None, help="comma-separated window lengths in tokens (overrides --multiples)")
    p.add_argument("--multiples", default="1,2,4,8,16", help="lengths as multiples of the first run's context")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="passkey depths in [0, 1]")
    p.add_argument("--trials", type=int, default=20, help="passkey keys per length and depth")
    p.add_argument("--copy_trials", type=int, default=200, help="copy sequences per length")
    p.add_argument("--key_len", type=int, default=5, help="passkey symbols")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--rope_scaling", type=float, default=1.0, help="YaRN's s for RoPE runs trained without it (1: off)")
    p.add_argument("--out_dir", default="out-retrieval", help="where the CSVs and PNG go")
    p.add_argument("--device", default="auto", help="'auto' (cuda if available) | 'cpu' | 'cuda:1' ...")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *DTYPES],
        help="autocast dtype; 'auto': float32 on CPU, bf16 on CUDA where supported, else fp16",
    )
    return p.parse_args(argv)


def train_context(args):
    """The context a model was trained at: YaRN's original length if set, else block_size."""
    return args.get("rope_original_block_size") or args["block_size"]


def run(argv):
    """Evaluate as the command line asks; returns (passkey rows, copy rows). UserError on bad input."""
    a = parse_args(argv)
    tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
    if not tasks or set(tasks) - set(TASKS):
        raise UserError(f"--tasks must name some of {', '.join(TASKS)}, got {a.tasks!r}")
    depths = parse_floats(a.depths, "--depths", 0.0, 1.0)
    for name, v in (("--trials", a.trials), ("--copy_trials", a.copy_trials), ("--key_len", a.key_len)):
        if v < 1:
            raise UserError(f"{name} must be >= 1, got {v}")
    if a.rope_scaling < 1.0:
        raise UserError(f"--rope_scaling is YaRN's s = L'/L >= 1 (1: off), got {a.rope_scaling}")
    runs = []  # all checks before any work
    for path in a.runs:
        state = load_checkpoint(path, "best.pt", "cpu")
        tok = tokenizer_from_checkpoint(state, source=os.path.join(path, "best.pt"))
        overrides, args, label, notes = inspect_run(path, a.rope_scaling, tok, state)
        alphabet = key_alphabet(tok) if "passkey" in tasks else None
        runs.append(
            dict(
                run=path,
                state=state,
                tok=tok,
                overrides=overrides,
                args=args,
                label=label,
                notes=notes,
                alphabet=alphabet,
            )
        )
    ctx = train_context(runs[0]["args"])
    if a.lengths:
        lengths = parse_lengths(a.lengths)
    else:
        mults = parse_floats(a.multiples, "--multiples", 1e-9)
        lengths = sorted({max(1, round(m * ctx)) for m in mults})
    if "copy" in tasks and lengths[0] < 3:  # L <= 2: m = L, no second-copy token after its first to score
        raise UserError(
            f"copying needs windows of at least 3 tokens (a second copy with a token after its first), "
            f"got {lengths[0]}: use longer --lengths or --multiples, or --tasks=passkey"
        )
    max_length = lengths[-1]
    device = resolve_device(a.device)
    autocast = functools.partial(autocast_context, device, resolve_dtype(a.dtype, device))
    where = flat(provenance(None, device))
    print(f"lengths {', '.join(map(str, lengths))} (context {ctx} of {runs[0]['run']}); tasks {', '.join(tasks)}")
    pk_rows, cp_rows = [], []
    for r in runs:
        for n in r["notes"]:
            print(f"note: {n}")
        skip = ()
        if r["args"]["pos_encoding"] in ABSOLUTE_ENCODINGS:
            skip = [L for L in lengths if L > r["args"]["block_size"]]
            if skip:
                print(
                    f"note: {r['run']} uses the absolute encoding {r['args']['pos_encoding']!r}: lengths "
                    f"{', '.join(map(str, skip))} left empty"
                )
        model = build_model(load_checkpoint(r["run"], "best.pt", device), device, **r["overrides"])
        common = dict(run=r["run"], label=r["label"], **where)
        if "passkey" in tasks:
            encode, _ = load_codec(r["tok"])
            try:
                passkey_parts(encode, r["alphabet"][0])
                [encode(s) for s in FILLER_SENTENCES]
            except ValueError as e:
                raise UserError(f"{r['run']}: its tokenizer cannot spell the passkey prompt ({e})") from None
            print(f"{r['label']} {r['run']}: passkey keys of {a.key_len} symbols from {r['alphabet']!r}")
            # the prompt without filler, its longest over the keys drawn (GPT-2 BPE spells keys in 2 or 3 tokens)
            need = max(
                (
                    prompt_tokens(encode, k)
                    for L in lengths
                    if L not in skip
                    for j in range(len(depths))
                    for k in passkey_keys(r["alphabet"], a.key_len, a.trials, a.seed, L, j)
                ),
                default=prompt_tokens(encode, r["alphabet"][0] * a.key_len),
            )
            short = [L for L in lengths if L < need]
            if len(short) == len(lengths):
                raise UserError(
                    f"every length is shorter than the passkey prompt without filler ({need} tokens): "
                    "use longer --lengths, or --tasks=copy"
                )
            if short:
                print(
                    f"note: the passkey prompt needs {need} tokens: passkey at {', '.join(map(str, short))} left empty"
                )
            # the key's distance to its answer at the deepest depth (the nearest it comes), nearest over the keys
            # drawn; beyond the training context no cell of the length can be answered by construction
            block, j = r["args"]["block_size"], len(depths) - 1
            far = {
                L: min(
                    answer_distance(encode, k, L, depths[j])
                    for k in passkey_keys(r["alphabet"], a.key_len, a.trials, a.seed, L, j)
                )
                for L in lengths
                if L not in skip and L not in short
            }
            far = {L: d for L, d in far.items() if d >= block}
            if far:
                why = (
                    f"the key lies at least {min(far.values())} tokens before its answer, beyond the {block - 1} "
                    f"that a training context of {block} attends back, so it cannot be retrieved by construction"
                )
                if "copy" not in tasks and all(L in skip or L in short or L in far for L in lengths):
                    raise UserError(f"{r['run']}: passkey refused at every length: {why}; run --tasks=copy")
                print(f"note: {r['run']}: passkey refused at {', '.join(map(str, far))}: {why}")
            res = run_passkey(
                model,
                encode,
                r["alphabet"],
                lengths,
                depths,
                a.trials,
                a.key_len,
                a.seed,
                max_length,
                device,
                autocast,
                [*skip, *short, *far],
            )
            for (L, d), (k, n, secs) in res.items():
                rate, (lo, hi) = wilson(k, n)
                pk_rows.append(
                    dict(
                        common,
                        length=L,
                        multiple=L / ctx,
                        depth=d,
                        trials=n,
                        correct=k,
                        accuracy=rate,
                        ci_low=lo,
                        ci_high=hi,
                        key_alphabet=r["alphabet"],
                        seconds=secs,
                    )
                )
        if "copy" in tasks:
            ids = copy_ids(r["tok"], r["args"]["vocab_size"])
            for L, v in run_copy(
                model, ids, lengths, a.copy_trials, a.seed, max_length, device, autocast, skip
            ).items():
                cp_rows.append(dict(common, length=L, multiple=L / ctx, **v))
        del model
    names = display_names([dict(run=r["run"], label=r["label"]) for r in runs])
    runs = [r["run"] for r in runs]
    if pk_rows:
        print(passkey_tables(pk_rows, runs, lengths, depths, names))
    if cp_rows:
        print(copy_table(cp_rows, runs, lengths, names))
    os.makedirs(a.out_dir, exist_ok=True)
    if pk_rows:
        write_csv(os.path.join(a.out_dir, "passkey.csv"), PASSKEY_COLUMNS, pk_rows)
    if cp_rows:
        write_csv(os.path.join(a.out_dir, "copy.csv"), COPY_COLUMNS, cp_rows)
    write_plot(os.path.join(a.out_dir, "retrieval.png"), pk_rows, cp_rows, runs, lengths, ctx, names)
    print(
        f"wrote {', '.join(f for f, rows in (('passkey.csv', pk_rows), ('copy.csv', cp_rows)) if rows)} and "
        f"retrieval.png to {a.out_dir}"
    )
    return pk_rows, cp_rows


main = exit_on_user_error(run)  # the command line: bad input exits with code 2 after one line on stderr


if __name__ == "__main__":
    main(sys.argv[1:])
