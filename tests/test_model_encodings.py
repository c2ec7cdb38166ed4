"""YaRN frequencies and the appendix baselines (rope_half, alibi_half, learned, sinusoidal), each
checked against a float64 formula written out here, plus causality, KV-cache decoding and a step."""

import math

import pytest
import torch

from model import GPT, GPTConfig, KVCache, alibi_slopes, rope_frequencies, yarn_attention_factor, yarn_ramp

V = 37
NEW = ["rope_half", "alibi_half", "learned", "sinusoidal"]


def tiny(pos_encoding, n_head=4, n_embd=32, block_size=24, **kw):
    torch.manual_seed(0)
    cfg = GPTConfig(
        block_size=block_size,
        vocab_size=V,
        n_layer=2,
        n_head=n_head,
        n_embd=n_embd,
        pos_encoding=pos_encoding,
        attn_backend="torch",
        **kw,
    )
    model = GPT(cfg).eval()
    with torch.no_grad():  # sharper attention than the 0.02 init, so positions change the outputs
        for block in model.transformer.h:
            block.attn.c_attn.weight.mul_(25.0)
    return model


# ---- YaRN ------------------------------------------------------------------------------------


def test_yarn_ramp_and_frequencies_match_hand_values():
    """head_dim 8, theta 10^4: theta_i = 1, 0.1, 0.01, 0.001 rad/token. L = 400, s = 4.
    r_i = L theta_i / (2 pi) = 63.662, 6.3662, 0.63662, 0.063662 rotations in L.
    gamma = clamp((r - 1) / 31, 0, 1) = 1, 0.173103, 0, 0.
    theta'_1 = (1 - 0.173103) * 0.1 / 4 + 0.173103 * 0.1 = 0.0206724 + 0.0173103 = 0.0379827."""
    r = torch.tensor([63.662, 6.3662, 0.63662, 0.063662], dtype=torch.float64)
    torch.testing.assert_close(
        yarn_ramp(r), torch.tensor([1.0, 0.173103, 0.0, 0.0], dtype=torch.float64), atol=1e-6, rtol=0
    )
    got = rope_frequencies(8, 10000.0, scaling=4.0, original_block_size=400, ramp="paper")
    want = torch.tensor([1.0, 0.0379827, 0.0025, 0.00025], dtype=torch.float64)
    torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-6)
    assert yarn_attention_factor(4.0) == pytest.approx(1.1386294, abs=1e-7)  # 0.1 ln 4 + 1
    assert yarn_attention_factor(1.0) == 1.0


def test_yarn_at_scale_one_is_rope_bit_for_bit():
    base = tiny("rope")
    same = tiny("rope", rope_scaling=1.0, rope_original_block_size=24)
    idx = torch.randint(0, V, (2, 30))
    assert torch.equal(base(idx)[0], same(idx)[0])
    freqs = rope_frequencies(8, 10000.0)
    assert torch.equal(freqs, torch.tensor([10000.0 ** (-2 * i / 8) for i in range(4)], dtype=torch.float64))
    assert torch.equal(rope_frequencies(8, 10000.0, 1.0, 400), freqs)


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(pos_encoding="rope", rope_scaling=0.5), "must be >= 1"),
        (dict(pos_encoding="rope", rope_scaling=4.0), "rope_original_block_size > 0"),
        (dict(pos_encoding="pope", rope_scaling=4.0, rope_original_block_size=16), "pos_encoding='rope' only"),
    ],
)
def test_yarn_config_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(n_layer=1, n_head=2, n_embd=16, **kw)


def test_rope_frequencies_refuse_what_yarn_cannot_scale():
    """rope_frequencies itself (not only GPTConfig) refuses YaRN without its L (original_block_size <= 0: every
    pair would count as turning less than once and be interpolated), a scale below 1, and an odd head_dim."""
    for kw in (
        dict(scaling=4.0, original_block_size=0),
        dict(scaling=4.0, original_block_size=-8),
        dict(scaling=0.5, original_block_size=400),
    ):
        with pytest.raises(ValueError, match="YaRN needs"):
            rope_frequencies(8, 10000.0, **kw)
    with pytest.raises(ValueError, match="even head_dim"):
        rope_frequencies(7, 10000.0)


def reference_attention(attn, x, freqs=None, mscale=1.0, slopes=None):
    """Float64 causal self-attention of module `attn` on x (B, T, C), written independently of model.py:
    the first 2 len(freqs) channels of q and k rotated as complex numbers (c + i (c + len(freqs))) by
    exp(i t freqs), q and k times mscale, logits / sqrt(d) minus slope_h * (query pos - key pos)."""
    B, T, C = x.shape
    H, d = attn.n_head, attn.head_dim
    q, k, v = (t.reshape(B, T, H, d).transpose(1, 2) for t in (x.double() @ attn.c_attn.weight.double().T).split(C, -1))
    pos = torch.arange(T, dtype=torch.float64)
    if freqs is not None:
        n = len(freqs)
        turn = torch.exp(1j * pos[:, None] * torch.as_tensor(freqs, dtype=torch.float64))

        def rot(t):
            z = torch.complex(t[..., :n], t[..., n : 2 * n]) * turn
            return torch.cat((z.real, z.imag, t[..., 2 * n :]), dim=-1)

        q, k = rot(q) * mscale, rot(k) * mscale
    s = q @ k.transpose(-1, -2) / math.sqrt(d)
    if slopes is not None:
        s = s - torch.as_tensor(slopes, dtype=torch.float64)[:, None, None] * (pos[:, None] - pos[None, :])
    s = s.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    y = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, T, C)
    return y @ attn.c_proj.weight.double().T


@pytest.mark.parametrize("ramp", ["paper", "code"])
def test_yarn_attention_matches_float64_formula(ramp):
    """s = 4, L = 8, head_dim 8: theta_i = 10^(-i), r_i = 8 theta_i / 2pi, the ramp and the q, k factor
    0.1 ln 4 + 1 written out here. 'paper': clamp((r - 1) / 31); 'code': its pair range is
    (floor(8 ln(8 / 64pi) / 2 ln 10^4), ceil(8 ln(8 / 2pi) / 2 ln 10^4)) = (floor(-1.40), ceil(0.105)) -> (0, 1),
    so gamma = 1, 0, 0, 0: the model must read GPTConfig.rope_yarn_ramp."""
    model = tiny("rope", rope_scaling=4.0, rope_original_block_size=8, rope_yarn_ramp=ramp)
    freqs = []
    for i in range(4):
        th = 10000.0 ** (-2 * i / 8)
        g = min(max((8 * th / (2 * math.pi) - 1) / 31, 0.0), 1.0) if ramp == "paper" else float(i == 0)
        freqs.append((1 - g) * th / 4 + g * th)
    x = torch.randn(2, 30, 32)
    attn = model.transformer.h[0].attn
    want = reference_attention(attn, x, freqs, mscale=0.1 * math.log(4) + 1)
    torch.testing.assert_close(attn(x).double(), want, atol=1e-4, rtol=1e-4)
    plain = reference_attention(attn, x, [10.0**-i for i in range(4)])
    assert (want - plain).abs().max() > 1e-2  # YaRN changes this layer's output


def decode_in_pieces(model, idx, stops):
    cache, pieces, start = KVCache(model.config.n_layer, idx.shape[1]), [], 0
    for stop in stops:
        pieces.append(model(idx[:, start:stop], kv_cache=cache)[0])
        start = stop
    return torch.cat(pieces, 1)


def test_yarn_kv_cache_decoding_equals_full_forward():
    model = tiny("rope", rope_scaling=4.0, rope_original_block_size=8)
    idx = torch.randint(0, V, (2, 20))
    torch.testing.assert_close(decode_in_pieces(model, idx, (7, 8, 9, 14, 20)), model(idx)[0], atol=1e-4, rtol=1e-4)


# ---- appendix baselines ----------------------------------------------------------------------


def test_rope_half_matches_float64_formula():
    """head_dim 8: channels 0..3 rotated as pairs (0, 2), (1, 3) at 10^4^(-2i/4) = 1, 0.01 rad/token;
    channels 4..7 untouched."""
    model = tiny("rope_half")
    attn, x = model.transformer.h[0].attn, torch.randn(2, 20, 32)
    want = reference_attention(attn, x, [1.0, 0.01])
    torch.testing.assert_close(attn(x).double(), want, atol=1e-4, rtol=1e-4)
    assert (want - reference_attention(attn, x, [1.0, 0.1, 0.01, 0.001])).abs().max() > 1e-2  # not full RoPE


def test_alibi_half_matches_float64_formula():
    """4 heads: ALiBi on heads 0, 1 with the standard slopes for 2 heads, 2^(-8h/2) = 1/16, 1/256;
    heads 2, 3 have none. Also the slopes of 8 heads (1/2 .. 1/256) and of 6 (Press et al.'s recipe)."""
    assert alibi_slopes(8).tolist() == [2.0**-k for k in range(1, 9)]
    assert alibi_slopes(6).tolist() == [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    model = tiny("alibi_half")
    attn, x = model.transformer.h[0].attn, torch.randn(2, 20, 32) * 3
    want = reference_attention(attn, x, slopes=[1 / 16, 1 / 256, 0.0, 0.0])
    torch.testing.assert_close(attn(x).double(), want, atol=1e-4, rtol=1e-4)
    assert (want - reference_attention(attn, x)).abs().max() > 1e-3  # the bias matters here


def test_absolute_embeddings_match_formula_and_refuse_positions_past_block_size():
    sin = tiny("sinusoidal")
    table = torch.tensor(
        [
            [
                math.sin(p / 10000 ** (c / 32)) if c % 2 == 0 else math.cos(p / 10000 ** ((c - 1) / 32))
                for c in range(32)
            ]
            for p in range(24)
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(sin.wpe_sinusoidal.double(), table, atol=1e-6, rtol=0)
    learned = tiny("learned")
    assert learned.transformer.wpe.weight.shape == (24, 32) and "transformer.wpe.weight" in learned.state_dict()
    assert not [k for k in sin.state_dict() if "sinusoidal" in k]  # fixed: not stored in checkpoints
    idx = torch.randint(0, V, (1, 5))
    for model, wpe in ((sin, table.float()), (learned, learned.transformer.wpe.weight)):
        with torch.no_grad(), __import__("unittest").mock.patch.object(model.transformer, "h", torch.nn.ModuleList()):
            hidden = model.hidden_states(idx)  # no blocks: ln_f(token + position embedding)
        torch.testing.assert_close(hidden, model.transformer.ln_f(model.transformer.wte(idx) + wpe[:5]))
        with pytest.raises(ValueError, match="block_size"):
            model(torch.randint(0, V, (1, 25)))
        cache = KVCache(2, 30)
        model(torch.randint(0, V, (1, 20)), kv_cache=cache)
        with pytest.raises(ValueError, match="block_size"):
            model(torch.randint(0, V, (1, 5)), kv_cache=cache)  # positions 20..24
        with pytest.raises(ValueError, match="block_size"):
            model.generate(idx, 20)


@pytest.mark.parametrize("pos_encoding", ["learned", "sinusoidal"])
def test_absolute_embeddings_take_exactly_block_size_positions_and_refuse_one_more(pos_encoding):
    """block_size 24: positions 0..23 exist. A context of exactly 24 tokens runs (ln_f(token + position rows 0..23),
    no blocks), 25 is refused; a cache prefilled with 20 takes 4 more (positions 20..23: the full forward's logits)
    and refuses 5; position_ids whose largest is 23 read row 23, 24 is refused; generate may reach exactly 24
    tokens (5 + 19) and refuses 5 + 20. Each refusal is one ValueError line that names block_size."""
    model = tiny(pos_encoding)
    wpe = model.wpe_sinusoidal if pos_encoding == "sinusoidal" else model.transformer.wpe.weight
    torch.manual_seed(1)
    idx = torch.randint(0, V, (1, 25))

    def refused(call):
        with pytest.raises(ValueError, match="block_size") as e:
            call()
        assert "\n" not in str(e.value)

    with torch.no_grad():
        with __import__("unittest").mock.patch.object(model.transformer, "h", torch.nn.ModuleList()):
            hidden = model.hidden_states(idx[:, :24])
            torch.testing.assert_close(hidden, model.transformer.ln_f(model.transformer.wte(idx[:, :24]) + wpe[:24]))
            pos = torch.tensor([[0, 1, 2, 23]])
            hidden = model.hidden_states(idx[:, :4], position_ids=pos)
            torch.testing.assert_close(hidden, model.transformer.ln_f(model.transformer.wte(idx[:, :4]) + wpe[pos[0]]))
        refused(lambda: model.hidden_states(idx[:, :4], position_ids=torch.tensor([[0, 1, 2, 24]])))
        full = model(idx[:, :24])[0]
        refused(lambda: model(idx))
        cache = KVCache(2, 30)
        model(idx[:, :20], kv_cache=cache)
        torch.testing.assert_close(model(idx[:, 20:24], kv_cache=cache)[0][0, -1], full[0, -1], atol=1e-5, rtol=1e-5)
        cache = KVCache(2, 30)
        model(idx[:, :20], kv_cache=cache)
        refused(lambda: model(idx[:, 20:25], kv_cache=cache))
    assert model.generate(idx[:, :5], 19, temperature=0).shape == (1, 24)
    refused(lambda: model.generate(idx[:, :5], 20, temperature=0))


@pytest.mark.parametrize("pos_encoding", NEW)
def test_new_encodings_causal_decode_and_train(pos_encoding):
    model = tiny(pos_encoding)
    idx = torch.randint(0, V, (2, 20))
    changed = idx.clone()
    changed[:, 12:] = (changed[:, 12:] + 1) % V
    a, b = model(idx)[0], model(changed)[0]
    torch.testing.assert_close(a[:, :12], b[:, :12])  # the future does not leak into the past
    assert (a[:, 12:] - b[:, 12:]).abs().max() > 1e-3
    torch.testing.assert_close(decode_in_pieces(model, idx, (7, 8, 9, 14, 20)), a, atol=1e-4, rtol=1e-4)
    out = model.generate(idx[:, :5], 6, temperature=0)
    assert torch.equal(out[:, 5:], model(out[:, :-1])[0][:, 4:].argmax(-1))
    model.train()
    opt = model.configure_optimizers(0.01, 1e-2, (0.9, 0.99), "cpu")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    opt.step()
    assert math.isfinite(loss.item())
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())  # every parameter learns


def test_sample_applies_checkpoint_settings_and_refuses_past_block_size(tmp_path, capsys):
    """sample.py reads YaRN settings from model_args; an absolute model asked past block_size exits 2."""
    import dataclasses

    import sample

    for enc, kw in (("rope", dict(rope_scaling=4.0, rope_original_block_size=8)), ("learned", {})):
        model = tiny(enc, **kw)
        torch.save(
            {
                "model": model.state_dict(),
                "model_args": dataclasses.asdict(model.config),
                "tokenizer": {"dataset": "x", "vocab_size": V, "pad_id": None, "tokenizer": {"kind": "none"}},
            },
            tmp_path / "best.pt",
        )
        argv = [
            f"--out_dir={tmp_path}",
            '--start="[1, 2, 3]"',
            "--temperature=0",
            "--device=cpu",
            "--attn_backend=torch",
        ]
        out = sample.main(argv + ["--max_new_tokens=4"])
        want = model.generate(torch.tensor([[1, 2, 3]]), 4, temperature=0)[0].tolist()
        assert out == [" ".join(map(str, want))]
    with pytest.raises(SystemExit) as e:
        sample.main(argv + ["--max_new_tokens=30"])
    assert e.value.code == 2 and "block_size" in capsys.readouterr().err
