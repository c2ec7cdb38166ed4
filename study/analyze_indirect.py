"""Pictures of indirect-indexing runs: learning curves, and where the final token attends.

    python study/analyze_indirect.py curves out-ii-pope-s1 out-ii-rope-s1 ...   # assets/indirect_indexing_curves.png
    python study/analyze_indirect.py attention out-ii-pope-s1 out-ii-rope-s1    # ..._attention.png
    python study/analyze_indirect.py attention RUN RUN --example=3 --text='ABCDEFGH,C,+2,E' --out=figs/att.png

curves     val accuracy (train.py's periodic evaluation on its fixed val batches, logged in each run's
           log.jsonl as val_acc: the share of target tokens predicted right) against the step, one line
           per run, coloured by pos_encoding; a dotted line at chance, 1/K for K letters. A RUN is a run
           folder or a run's record in docs/runs (NAME.json, with its log beside it as NAME.log.jsonl,
           as study/lane.sh keeps them), so the curves can be drawn again once out/ is gone.
attention  the final token's attention (softmax weights over the row's positions) on one test row, one
           heatmap per run side by side: rows are layer x head, columns the row's characters; the last
           query's source letter (blue) and target letter (red) are marked in the string. The row is the
           --example-th row of the test split of the runs' dataset (all runs must share it), or --text.
           The input is the row without its final target, so the final token is the one whose
           prediction is scored. Weights are recomputed in float64 from the queries and keys captured
           on each layer's c_attn (hooks; the model's attention code is not touched), with the
           encoding's own formulas (attention_weights).

Flags: --out (PNG, written atomically), --ckpt (default best.pt), --example, --text, --split (default
test), --data_root (default: the run's), --device (default cpu). Bad input exits 2 with one line.
"""

import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: cli.py, model.py ...

from analyze import capture_qk
from checkpoint import load_checkpoint, load_codec, load_run, tokenizer_from_checkpoint
from cli import UserError, atomic_open, exit_on_user_error
from configurator import configure
from data import Dataset
from model import rope_frequencies, yarn_attention_factor
from pope import pope_frequencies, pope_magnitude

DEFAULTS = dict(out="", ckpt="best.pt", example=0, text="", split="test", data_root="", device="cpu")
OUTPUTS = {"curves": "assets/indirect_indexing_curves.png", "attention": "assets/indirect_indexing_attention.png"}
COLORS = {
    "pope": "tab:blue",
    "rope": "tab:red",
    "rope_half": "tab:orange",
    "alibi_half": "tab:green",
    "learned": "tab:purple",
    "sinusoidal": "tab:brown",
    "none": "tab:gray",
}


# --- learning curves ---------------------------------------------------------------------------------


def run_files(run):
    """(log.jsonl path, metrics.json path) of a run folder, or of a run record NAME.json in docs/runs
    (its log is NAME.log.jsonl beside it, and the record is metrics.json plus lane.sh's times)."""
    if os.path.isfile(run) and run.endswith(".json"):
        return run[: -len(".json")] + ".log.jsonl", run
    return os.path.join(run, "log.jsonl"), os.path.join(run, "metrics.json")


def read_curve(run):
    """(steps, val_acc): int and float64 arrays from the run's log.jsonl evaluation rows (val_acc in
    [0, 1]); `run` is a run folder or a docs/runs record (run_files). A step logged twice (a resumed run
    evaluates its first step again) keeps its last row. Raises UserError if the log is missing or holds
    no evaluation."""
    path = run_files(run)[0]
    if not os.path.isfile(path):
        raise UserError(
            f"no {path}: give run folders written by train.py, or docs/runs records kept with "
            f"their NAME.log.jsonl by study/lane.sh"
        )
    acc = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if "val_acc" in row:
                acc[row["iter"]] = row["val_acc"]
    if not acc:
        raise UserError(f"{path} holds no evaluation (val_acc); train past iteration 0 first")
    steps = np.array(sorted(acc))
    return steps, np.array([acc[s] for s in steps], dtype=np.float64)


def run_settings(run, ckpt="best.pt"):
    """The train.py settings of a run: metrics.json's config (or the docs/runs record's) when the run has
    finished, else the run folder's checkpoint's (ckpt, then ckpt.pt). Raises UserError if neither exists."""
    path = run_files(run)[1]
    if os.path.isfile(path):
        with open(path) as f:
            config = json.load(f).get("config")
        if config:
            return config
    if os.path.isfile(run):
        raise UserError(f"{run} has no 'config': give a run folder or a docs/runs record written by lane.sh")
    name = ckpt if os.path.isfile(os.path.join(run, ckpt)) else "ckpt.pt"
    return load_checkpoint(run, name)["config"]


def n_letters(tokenizer):
    """K, the number of letters in a char tokenizer description (chance accuracy is 1/K), or None."""
    itos = (tokenizer.get("tokenizer") or {}).get("itos") or []
    return sum(1 for s in itos if len(s) == 1 and s.isalpha()) or None


def plot_curves(runs, path, ckpt="best.pt"):
    """Draw val accuracy (%) against the step for every run folder, coloured by pos_encoding, into the
    PNG `path` (written atomically); returns path. Raises UserError on a folder without a log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), layout="constrained")
    counts, chance = {}, set()
    for run in runs:
        steps, acc = read_curve(run)
        cfg = run_settings(run, ckpt)
        enc = cfg["pos_encoding"]
        counts[enc] = counts.get(enc, 0) + 1
        ax.plot(
            steps, 100 * acc, color=COLORS.get(enc, "black"), lw=1.2, alpha=0.8, label=enc if counts[enc] == 1 else None
        )
        meta = os.path.join(cfg.get("data_root", "data"), cfg.get("dataset", ""), "meta.json")
        if os.path.isfile(meta):
            with open(meta) as f:
                chance.add(n_letters(json.load(f)))
    if len(chance) == 1 and None not in chance:
        k = chance.pop()
        ax.axhline(100 / k, color="gray", ls=":", lw=1, label=f"chance (1/{k})")
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(
        handles,
        [f"{lab} ({counts[lab]} run{'s' * (counts[lab] > 1)})" if lab in counts else lab for lab in labels],
        fontsize=8,
    )
    ax.set_xlabel("step")
    ax.set_ylabel("val accuracy (%, all query targets)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.set_title("indirect indexing: val accuracy during training")
    _save(fig, path)
    plt.close(fig)
    return path


# --- the final token's attention ---------------------------------------------------------------------


def _rotate(x, positions, freqs):
    """RoPE in float64: pairs (c, c + n/2) of x (..., T, n) turned by positions * freqs[c] radians."""
    angle = positions.double()[:, None] * freqs.double()  # (T, n/2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()), dim=-1)


def attention_logits(q, k, config, delta=None, slopes=None):
    """Pre-softmax attention logits of one layer in float64, before the causal mask.

    q (H, T, d), k (H, T, d): raw queries and keys (c_attn's output, before any positional encoding; key
    heads already repeated over their query heads); positions 0..T-1. delta (H, d) radians: PoPE's phase
    bias (None: 0); slopes (H,): alibi_half's per-head slopes. Returns (H, T, T), entry [h, i, j] the logit
    of query i for key j:
        rope / rope_half   (R_i q_i) . (R_j k_j) / sqrt(d), rotation on all d (half: the first d/2) channels,
                           frequencies rope_frequencies (YaRN-scaled, logits times (0.1 ln s + 1)^2)
        pope               sum_c mu(q_ic) mu(k_jc) cos((j - i) theta_c + delta_c) / sqrt(d) (paper, Method)
        alibi_half         q_i . k_j / sqrt(d) - slope_h (i - j)   (Press et al. 2022)
        none, learned, sinusoidal   q_i . k_j / sqrt(d) (absolute positions are in q and k already)
    """
    q, k = q.double(), k.double()
    H, T, d = q.shape
    pos = torch.arange(T, device=q.device)
    enc = config.pos_encoding
    if enc in ("rope", "rope_half"):
        n = d if enc == "rope" else d // 2
        freqs = rope_frequencies(
            n,
            config.rope_theta,
            config.rope_scaling,
            config.rope_original_block_size,
            device=q.device,
            ramp=config.rope_yarn_ramp,
        )
        q = torch.cat((_rotate(q[..., :n], pos, freqs), q[..., n:]), dim=-1)
        k = torch.cat((_rotate(k[..., :n], pos, freqs), k[..., n:]), dim=-1)
        m = yarn_attention_factor(config.rope_scaling) ** 2 if config.rope_scaling != 1.0 else 1.0
        return m * q @ k.transpose(-1, -2) / math.sqrt(d)
    if enc == "pope":
        theta = pope_frequencies(d, config.rope_theta, device=q.device).double()
        mu_q, mu_k = pope_magnitude(q, config.pope_magnitude), pope_magnitude(k, config.pope_magnitude)
        phase_q = pos.double()[:, None] * theta  # (T, d) radians
        phase_k = phase_q + (torch.zeros(H, 1, d, dtype=torch.float64) if delta is None else delta.double()[:, None, :])
        qc = torch.cat((mu_q * phase_q.cos(), mu_q * phase_q.sin()), dim=-1)  # Cartesian forms (H, T, 2d)
        kc = torch.cat((mu_k * phase_k.cos(), mu_k * phase_k.sin()), dim=-1)
        return qc @ kc.transpose(-1, -2) / math.sqrt(d)
    logits = q @ k.transpose(-1, -2) / math.sqrt(d)
    if enc == "alibi_half":
        logits = logits - slopes.double()[:, None, None] * (pos[:, None] - pos[None, :]).double()
    return logits


@torch.no_grad()
def attention_weights(model, idx):
    """idx (1, T) token ids -> (n_layer, n_head, T, T) float64 causal attention weights of every layer,
    row i the softmax over keys 0..i of query i (zeros beyond). Queries and keys are captured by forward
    hooks on each layer's c_attn during one forward pass; attention_logits does the rest."""
    cfg = model.config
    H = cfg.n_head
    H_kv = cfg.n_kv_head or H
    blocks = model.transformer.h
    captured = [(q.transpose(0, 1), k.transpose(0, 1)) for q, k in capture_qk(model, idx)]
    T = idx.shape[1]
    future = torch.ones(T, T, dtype=torch.bool, device=idx.device).triu(1)
    out = []
    for i, block in enumerate(blocks):
        q, k = captured[i]
        k = k.repeat_interleave(H // H_kv, dim=0)
        delta = block.attn.pope_delta
        delta = delta.detach().repeat_interleave(H // H_kv, dim=0) if delta is not None else None
        slopes = getattr(block.attn, "alibi_slopes", None)
        logits = attention_logits(q, k, cfg, delta, slopes).masked_fill(future, float("-inf"))
        out.append(torch.softmax(logits, dim=-1))
    return torch.stack(out).cpu()


def final_token_attention(model, idx):
    """(n_layer, n_head, T) float64: the attention weights of idx's last position (1, T) over positions 0..T-1."""
    return attention_weights(model, idx)[:, :, -1, :]


def parse_row(text):
    """An indirect-indexing row 'STRING,src,shift,tgt[,src,shift,tgt...]' -> (string, [(src, shift, tgt), ...]).
    Raises UserError if it is not one."""
    fields = text.split(",")
    if len(fields) < 4 or (len(fields) - 1) % 3:
        raise UserError(f"{text!r} is not an indirect-indexing row 'STRING,source,shift,target[,...]'")
    try:
        queries = [(fields[i], int(fields[i + 1]), fields[i + 2]) for i in range(1, len(fields), 3)]
    except ValueError:
        raise UserError(f"{text!r}: a shift is not an integer") from None
    return fields[0], queries


def example_row(run, state, split="test", example=0, data_root=""):
    """Token ids (list) of row `example` of `split` of the run's dataset (padding dropped)."""
    cfg = state["config"]
    data_dir = os.path.join(data_root or cfg.get("data_root", "data"), cfg["dataset"])
    try:
        ds = Dataset(data_dir)
        rows = ds.array(split)
    except (FileNotFoundError, KeyError) as e:
        raise UserError(f"{run}: {e}; give --data_root, or --text='STRING,source,shift,target'") from None
    if not 0 <= example < len(rows):
        raise UserError(f"--example must be in 0..{len(rows) - 1} ({data_dir} {split}), got {example}")
    return [int(t) for t in rows[example] if t != ds.pad_id]


def plot_attention(runs, path, ckpt="best.pt", example=0, text="", split="test", data_root="", device="cpu"):
    """Heatmaps of the final token's attention (layer x head rows, the row's characters as columns), one per
    run side by side, into the PNG `path` (written atomically). Returns (path, {run: (n_layer, n_head, T)
    weights}). Raises UserError on runs with different tokenizers or a row that is not an example."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loaded = [load_run(run, ckpt, device) for run in runs]
    toks = [tokenizer_from_checkpoint(state) for _, state in loaded]
    if any(t["tokenizer"] != toks[0]["tokenizer"] for t in toks[1:]):
        raise UserError("the runs use different tokenizers (datasets); compare runs trained on one dataset")
    encode, decode = load_codec(toks[0])
    try:
        ids = encode(text) if text else example_row(runs[0], loaded[0][1], split, example, data_root)
    except ValueError as e:
        raise UserError(f"--text: {e}") from None
    row = decode(ids)
    string, queries = parse_row(row)
    src, shift, tgt = queries[-1]
    if (
        src not in string
        or string.index(src) + shift not in range(len(string))
        or string[string.index(src) + shift] != tgt
    ):
        raise UserError(f"{row!r}: its last query's target is not the letter at the shift from its source")
    x = torch.tensor([ids[:-1]], device=device)  # everything but the final target
    chars = list(row[:-1])
    marks = {string.index(src): "tab:blue", string.index(src) + shift: "tab:red"}
    weights = {}
    width = max(6.0, 0.16 * len(chars))
    n_rows = max(m.config.n_layer * m.config.n_head for m, _ in loaded)
    fig, axes = plt.subplots(
        1, len(runs), figsize=(width * len(runs), 1.6 + 0.28 * n_rows), squeeze=False, layout="constrained"
    )
    for ax, run, (model, _state) in zip(axes[0], runs, loaded):
        cfg = model.config
        w = final_token_attention(model, x)
        weights[run] = w.numpy()
        with torch.no_grad():
            probs = F.softmax(model(x)[0][0, -1].double(), dim=-1)
        pred = int(probs.argmax())
        im = ax.imshow(
            w.reshape(-1, w.shape[-1]).numpy(),
            aspect="auto",
            cmap="viridis",
            vmin=0.0,
            vmax=1.0,
            interpolation="nearest",
        )
        ax.set_xticks(range(len(chars)))
        ax.set_xticklabels(chars, fontsize=7, family="monospace")
        for pos, color in marks.items():
            ax.get_xticklabels()[pos].set_color(color)
            ax.get_xticklabels()[pos].set_fontweight("bold")
        ax.set_yticks(range(cfg.n_layer * cfg.n_head))
        ax.set_yticklabels([f"L{i} H{h}" for i in range(cfg.n_layer) for h in range(cfg.n_head)], fontsize=7)
        for i in range(1, cfg.n_layer):
            ax.axhline(i * cfg.n_head - 0.5, color="white", lw=0.8)
        name = os.path.basename(os.path.normpath(run))
        ok = "right" if decode([pred]) == tgt else "wrong"
        ax.set_title(
            f"{name} ({cfg.pos_encoding}): predicts {decode([pred])!r} (p={probs[pred]:.2f}), answer {tgt!r}: {ok}",
            fontsize=9,
        )
    fig.colorbar(im, ax=axes.ravel().tolist(), label="attention weight of the final token")
    fig.suptitle(
        f"final token's attention on {row[:-1]}?  (last query {src},{shift:+d}: source blue, target red)", fontsize=9
    )
    _save(fig, path)
    plt.close(fig)
    return path, weights


def _save(fig, path):
    with atomic_open(path) as f:
        fig.savefig(f, format="png", dpi=120, bbox_inches="tight")


@exit_on_user_error
def main(argv):
    if not argv or argv[0] not in OUTPUTS:
        raise UserError(
            "usage: python study/analyze_indirect.py curves|attention RUN [RUN ...] [--out=PNG] (see its docstring)"
        )
    command, rest = argv[0], argv[1:]
    runs = [a for a in rest if not a.startswith("--")]
    cfg = configure(DEFAULTS, [a for a in rest if a.startswith("--")])
    if not runs:
        raise UserError(
            f"give one or more run folders (or docs/runs/NAME.json records): "
            f"python study/analyze_indirect.py {command} out-a out-b"
        )
    out = cfg["out"] or OUTPUTS[command]
    if command == "curves":
        path = plot_curves(runs, out, cfg["ckpt"])
    else:
        path, _ = plot_attention(
            runs, out, cfg["ckpt"], cfg["example"], cfg["text"], cfg["split"], cfg["data_root"], cfg["device"]
        )
    print(path)
    return path


if __name__ == "__main__":
    main(sys.argv[1:])
