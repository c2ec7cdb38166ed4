"""YaRN frequencies and the appendix baselines (rope_half, alibi_half, learned, sinusoidal), each
checked against a float64 formula written out here, plus causality, KV-cache decoding and a step."""

import math

import pytest
import torch

from model import GPT, GPTConfig, KVCache, rope_frequencies, yarn_attention_factor, yarn_ramp

V = 37


def tiny(pos_encoding, n_head=4, n_embd=32, block_size=24, **kw):
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=block_size, vocab_size=V, n_layer=2, n_head=n_head, n_embd=n_embd,
                    pos_encoding=pos_encoding, attn_backend="torch", **kw)
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
    torch.testing.assert_close(yarn_ramp(r), torch.tensor([1.0, 0.173103, 0.0, 0.0], dtype=torch.float64),
                               atol=1e-6, rtol=0)
    got = rope_frequencies(8, 10000.0, scaling=4.0, original_block_size=400)
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


@pytest.mark.parametrize("kw,message", [
    (dict(pos_encoding="rope", rope_scaling=0.5), "must be >= 1"),
    (dict(pos_encoding="rope", rope_scaling=4.0), "rope_original_block_size > 0"),
    (dict(pos_encoding="pope", rope_scaling=4.0, rope_original_block_size=16), "pos_encoding='rope' only"),
])
def test_yarn_config_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(n_layer=1, n_head=2, n_embd=16, **kw)


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
            z = torch.complex(t[..., :n], t[..., n:2 * n]) * turn
            return torch.cat((z.real, z.imag, t[..., 2 * n:]), dim=-1)
        q, k = rot(q) * mscale, rot(k) * mscale
    s = q @ k.transpose(-1, -2) / math.sqrt(d)
    if slopes is not None:
        s = s - torch.as_tensor(slopes, dtype=torch.float64)[:, None, None] * (pos[:, None] - pos[None, :])
    s = s.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    y = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(B, T, C)
    return y @ attn.c_proj.weight.double().T


def test_yarn_attention_matches_float64_formula():
    """s = 4, L = 8, head_dim 8: theta_i = 10^(-i), r_i = 8 theta_i / 2pi, the ramp and the q, k factor
    0.1 ln 4 + 1 written out here."""
    model = tiny("rope", rope_scaling=4.0, rope_original_block_size=8)
    freqs = []
    for i in range(4):
        th = 10000.0 ** (-2 * i / 8)
        g = min(max((8 * th / (2 * math.pi) - 1) / 31, 0.0), 1.0)
        freqs.append((1 - g) * th / 4 + g * th)
    x = torch.randn(2, 30, 32)
    attn = model.transformer.h[0].attn
    want = reference_attention(attn, x, freqs, mscale=0.1 * math.log(4) + 1)
    torch.testing.assert_close(attn(x).double(), want, atol=1e-4, rtol=1e-4)
    plain = reference_attention(attn, x, [10.0 ** -i for i in range(4)])
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
