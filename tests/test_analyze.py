"""study/analyze.py: PNGs are written, and the numbers behind them equal a direct computation from the weights."""

import math
import os
from dataclasses import asdict

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import analyze
from checkpoint import load_codec
from model import GPT, GPTConfig

TEXTS = [
    "Shall I compare thee to a summer's day?\nThou art more lovely and more temperate:",
    "From fairest creatures we desire increase",
]  # different lengths: texts are averaged, not tokens


def save_run(folder, pos_encoding, tokenizer=None, **kw):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=16, pos_encoding=pos_encoding, **kw))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))  # norms far from uniform across frequencies
    model.clamp_pope_delta_()
    os.makedirs(folder, exist_ok=True)
    torch.save(
        {
            "model": model.state_dict(),
            "model_args": asdict(model.config),
            "config": {},
            "tokenizer": {
                "dataset": "x",
                "vocab_size": 50257,
                "pad_id": None,
                "tokenizer": tokenizer or {"kind": "gpt2"},
            },
        },
        os.path.join(folder, "best.pt"),
    )
    return model


@torch.no_grad()
def layer0_usage(model, ids, magnitude=None):
    """(q, k) usage per frequency of layer 0 for one text, from the weights in float64; PoPE with
    `magnitude` (default: the model's pope_magnitude)."""
    cfg, attn, ln = model.config, model.transformer.h[0].attn, model.transformer.h[0].ln_1
    x = model.transformer.wte.weight.double()[ids]
    h = F.rms_norm(x, (cfg.n_embd,), ln.weight.double(), ln.eps)
    q, k, _ = (h @ attn.c_attn.weight.double().T).split(cfg.n_embd, dim=-1)
    d = cfg.n_embd // cfg.n_head
    out = []
    for t in (q, k):
        t = t.view(len(ids), cfg.n_head, d)
        if cfg.pos_encoding == "rope":
            u = torch.stack([torch.hypot(t[..., c], t[..., c + d // 2]) for c in range(d // 2)], dim=-1)
        elif (magnitude or cfg.pope_magnitude) == "relu":
            u = torch.where(t > 0, t, 0.0)
        elif (magnitude or cfg.pope_magnitude) == "identity":
            u = t
        else:
            u = torch.log1p(torch.exp(t))  # softplus
        out.append(u.mean(dim=(0, 1)).numpy())
    return out


@pytest.mark.parametrize("pos_encoding", ["rope", "pope"])
def test_analyze_writes_pngs_and_the_numbers_match_the_weights(pos_encoding, tmp_path, monkeypatch):
    monkeypatch.setenv("GPT2_BPE_SOURCE", "local")
    run = str(tmp_path / f"run-{pos_encoding}")
    model = save_run(run, pos_encoding)
    texts = tmp_path / "texts.txt"
    texts.write_text("\n\n".join(TEXTS) + "\n")
    paths = analyze.main([run, f"--texts={texts}"])
    out = os.path.join(run, "analysis")
    want = [os.path.join(out, "frequency_usage.png")]
    want += [os.path.join(out, "delta.png")] if pos_encoding == "pope" else []
    assert paths == want
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    data = np.load(os.path.join(out, "frequency_usage.npz"))
    encode, _ = load_codec({"tokenizer": {"kind": "gpt2"}})
    per_text = [layer0_usage(model, encode(t)) for t in TEXTS]
    d = model.config.n_embd // model.config.n_head
    n_freq = d // 2 if pos_encoding == "rope" else d
    assert data["q"].shape == data["k"].shape == (model.config.n_layer, n_freq)
    np.testing.assert_allclose(data["q"][0], np.mean([u[0] for u in per_text], axis=0), rtol=1e-5)
    np.testing.assert_allclose(data["k"][0], np.mean([u[1] for u in per_text], axis=0), rtol=1e-5)
    step = 2 if pos_encoding == "rope" else 1  # RoPE theta_c = base^(-2c/d), PoPE base^(-c/d)
    np.testing.assert_allclose(data["wavelength"], 2 * math.pi * 10000.0 ** (np.arange(0, d, step) / d))
    if pos_encoding == "pope":
        delta = torch.stack([b.attn.pope_delta.detach() for b in model.transformer.h]).numpy()
        np.testing.assert_array_equal(data["delta"], delta)
    else:
        assert "delta" not in data


def test_bad_input_exits_2(tmp_path, capsys):
    char_run = str(tmp_path / "char")
    save_run(char_run, "rope", {"kind": "char", "itos": list("ab")})
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    cases = [
        ([str(tmp_path / "nothing")], "no checkpoint at"),
        ([char_run], "give --texts=FILE"),
        ([char_run, f"--texts={empty}"], "holds no text"),
        ([char_run, f"--texts={tmp_path / 'missing.txt'}"], "cannot read --texts"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            analyze.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and err.count("\n") == 1, err


def _usage(run, monkeypatch):
    """analyze.frequency_usage of a run folder's model on TEXTS (the numbers behind the plots)."""
    from checkpoint import load_run

    monkeypatch.setenv("GPT2_BPE_SOURCE", "local")
    encode, _ = load_codec({"tokenizer": {"kind": "gpt2"}})
    return analyze.frequency_usage(load_run(run)[0], [encode(t) for t in TEXTS])


def test_yarn_run_wavelengths_are_the_scaled_ones(tmp_path, monkeypatch):
    """The paper's ramp (rope_yarn_ramp='paper', the run's own, not the default).
    s = 4, L = 16, head_dim 8: theta_i = 10^-i; r_i = 16 theta_i / (2 pi) = 2.546, 0.2546, ...;
    gamma_i = clamp((r_i - 1) / 31, 0, 1) = 0.049886, 0, 0, 0; theta'_i = (1 - gamma_i) theta_i / 4
    + gamma_i theta_i = 0.287415, 0.025, 0.0025, 0.00025; wavelength 2 pi / theta'_i."""
    run = str(tmp_path / "run-yarn")
    save_run(run, "rope", rope_scaling=4.0, rope_original_block_size=16, rope_yarn_ramp="paper")
    data = _usage(run, monkeypatch)
    theta = 10.0 ** -np.arange(4)
    gamma = np.clip((16 * theta / (2 * math.pi) - 1) / 31, 0, 1)
    scaled = (1 - gamma) * theta / 4 + gamma * theta
    np.testing.assert_allclose(scaled, [0.2874148, 0.025, 0.0025, 0.00025], rtol=1e-6)
    np.testing.assert_allclose(data["wavelength"], 2 * math.pi / scaled, rtol=1e-12)


@pytest.mark.parametrize("magnitude", ["relu", "identity"])
def test_pope_magnitude_ablations_are_measured_with_their_own_function(magnitude, tmp_path, monkeypatch):
    """PoPE's relu / identity ablations: the usage is mean relu(q_c) / mean q_c, not softplus."""
    run = str(tmp_path / f"run-{magnitude}")
    model = save_run(run, "pope", pope_magnitude=magnitude)
    data = _usage(run, monkeypatch)
    encode, _ = load_codec({"tokenizer": {"kind": "gpt2"}})
    per_text = [layer0_usage(model, encode(t)) for t in TEXTS]
    for j, key in enumerate(("q", "k")):
        want = np.mean([u[j] for u in per_text], axis=0)
        np.testing.assert_allclose(data[key][0], want, rtol=1e-5, atol=1e-8)
    softplus = np.mean([layer0_usage(model, encode(t), "softplus")[1] for t in TEXTS], axis=0)
    assert np.abs(want - softplus).max() > 0.1  # the functions give other numbers on these weights
