"""pope_attention (torch path) against PoPE's score formula computed independently in float64."""

import math

import pytest
import torch
import torch.nn.functional as F

from pope_kernel import _polar_to_cartesian, pope_attention, pope_attention_reference, pope_frequencies


def formula_attention(q, k, v, delta, q_offset, causal, magnitude="softplus", theta=10000.0):
    """Paper, Method: logit(t, s) = sum_c mu_q mu_k cos((s - t) theta_c + delta_c) / sqrt(d), written as
    explicit loops over heads and channels in float64 (independent of pope_kernel's vectorised code)."""
    q, k, v = q.double(), k.double(), v.double()
    B, H, Tq, d = q.shape
    Tk = k.shape[2]
    act = {"softplus": F.softplus, "relu": F.relu, "identity": lambda x: x}[magnitude]
    mq, mk = act(q), act(k)
    t = torch.arange(q_offset, q_offset + Tq, dtype=torch.float64)[:, None]
    s = torch.arange(Tk, dtype=torch.float64)[None, :]
    out = torch.empty(B, H, Tq, v.shape[-1], dtype=torch.float64)
    for h in range(H):
        logits = torch.zeros(B, Tq, Tk, dtype=torch.float64)
        for c in range(d):
            theta_c = theta ** (-c / d)  # c is 0-based: theta^(-(c-1)/d) for 1-based c
            phase = (s - t) * theta_c + float(delta[h, c])
            logits += mq[:, h, :, c, None] * mk[:, h, None, :, c] * torch.cos(phase)
        logits /= math.sqrt(d)
        if causal:
            logits = logits.masked_fill(s > t, float("-inf"))
        out[:, h] = torch.softmax(logits, -1) @ v[:, h]
    return out


CASES = [  # (Tq, Tk, q_offset, causal)
    (9, 9, 0, True), (9, 9, 0, False), (3, 11, 8, True), (4, 11, 2, True), (1, 6, 5, True), (5, 12, 30, False),
]


@pytest.mark.parametrize("Tq,Tk,q_offset,causal", CASES)
@pytest.mark.parametrize("magnitude", ["softplus", "relu", "identity"])
def test_forward_matches_formula(Tq, Tk, q_offset, causal, magnitude):
    g = torch.Generator().manual_seed(Tq * 100 + Tk)
    q, k, v = (torch.randn(2, 3, T, 16, generator=g) for T in (Tq, Tk, Tk))
    delta = -2 * math.pi * torch.rand(3, 16, generator=g)
    want = formula_attention(q, k, v, delta, q_offset, causal, magnitude)
    got = pope_attention(q, k, v, delta, causal=causal, q_offset=q_offset, magnitude=magnitude, backend="torch")
    ref = pope_attention_reference(q, k, v, delta, causal=causal, q_offset=q_offset, magnitude=magnitude)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(ref, want, atol=1e-6, rtol=1e-6)


def test_frequencies_lie_in_unit_interval():
    f = pope_frequencies(64, 10000.0).double()
    assert f[0] == 1.0 and torch.all(f[1:] < f[:-1]) and f[-1] > 0
    torch.testing.assert_close(f, 10000.0 ** (-torch.arange(64, dtype=torch.float64) / 64))


def test_gradients_match_reference():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, T, 8, generator=g, dtype=torch.float64, requires_grad=True) for T in (5, 7, 7))
    delta = (-torch.rand(2, 8, generator=g, dtype=torch.float64)).requires_grad_()
    dout = torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64)
    grads = []
    for fn in (pope_attention, pope_attention_reference):
        out = fn(q, k, v, delta, causal=True, q_offset=2)
        grads.append(torch.autograd.grad(out, (q, k, v, delta), dout))
    for a, b, name in zip(*grads, "q k v delta".split()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)
        assert b.abs().sum() > 0, name


def test_scores_invariant_to_a_common_shift():
    """Re[q~^H k~] depends on s - t only: shifting every position by P leaves the scores unchanged."""
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 2, 6, 16, generator=g), torch.randn(1, 2, 6, 16, generator=g)
    delta, freqs, pos = -torch.rand(2, 16, generator=g), pope_frequencies(16), torch.arange(6)
    scores = []
    for shift in (0, 37, 1000):
        qc = _polar_to_cartesian(q, pos + shift, freqs, None, "softplus", torch.float32)
        kc = _polar_to_cartesian(k, pos + shift, freqs, delta, "softplus", torch.float32)
        scores.append(qc @ kc.transpose(-1, -2))
    torch.testing.assert_close(scores[1], scores[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(scores[2], scores[0], atol=2e-3, rtol=1e-3)  # fp32 phases at t ~ 1e3 rad


def test_bad_inputs_raise():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="delta must be"):
        pope_attention(q, q, q, torch.zeros(3, 8), backend="torch")
    with pytest.raises(ValueError, match="magnitude"):
        pope_attention(q, q, q, magnitude="exp", backend="torch")
    with pytest.raises(ValueError, match="q_offset"):
        pope_attention(q, q, q, q_offset=-1, backend="torch")


def test_bf16_autocast_keeps_fp32_phases():
    """Under bf16 autocast the phases stay fp32: queries 10^4 tokens after the keys still match the
    float64 formula to bf16 precision (bf16 phases at 1e4 rad would be off by up to 32 rad)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 4, 16, generator=g) for _ in range(3))
    delta = -torch.rand(2, 16, generator=g)
    want = formula_attention(q, k, v, delta, 10_000, causal=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = pope_attention(q, k, v, delta, causal=False, q_offset=10_000, backend="torch")
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)
