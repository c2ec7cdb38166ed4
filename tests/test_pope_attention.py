"""pope.py: pope_attention (torch path) against PoPE's score formula in float64; the cached key form and the
identity behind it; the API."""

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pope import (
    polar_to_cartesian,
    pope_attention,
    pope_attention_decode,
    pope_attention_reference,
    pope_frequencies,
    pope_key_magnitude,
    pope_query_decode_form,
    pope_rotation_table,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def formula_attention(q, k, v, delta, q_offset, causal, magnitude="softplus", theta=10000.0):
    """Paper, Method: logit(t, s) = sum_c mu_q mu_k cos((s - t) theta_c + delta_c) / sqrt(d), written as
    explicit loops over heads and channels in float64 (independent of pope.py's vectorised code)."""
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
    (9, 9, 0, True),
    (9, 9, 0, False),
    (3, 11, 8, True),
    (4, 11, 2, True),
    (1, 6, 5, True),
    (5, 12, 30, False),
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
        qc = polar_to_cartesian(q, pos + shift, freqs, None, "softplus", torch.float32)
        kc = polar_to_cartesian(k, pos + shift, freqs, delta, "softplus", torch.float32)
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


@pytest.mark.parametrize("H, H_kv", [(2, 2), (6, 2), (4, 1)])
def test_delta_moved_to_the_query_is_the_same_score_in_float64(H, H_kv):
    """The identity behind the d-wide cache: Re[conj(mu_q e^{i(t theta - delta)}) mu_k e^{i s theta}] =
    mu_q mu_k cos((s - t) theta + delta). Built from complex numbers in float64 (query heads take their
    key/value head's delta), attention over it equals pope_attention_reference to 1e-12, with delta spread
    over all of [-2 pi, 0] (both ends included), causal with the queries at the keys' end, a large base."""
    g = torch.Generator().manual_seed(11)
    B, Tq, Tk, d = 2, 3, 40, 16
    q = 3 * torch.randn(B, H, Tq, d, generator=g, dtype=torch.float64)
    k = 3 * torch.randn(B, H_kv, Tk, d, generator=g, dtype=torch.float64)
    v = torch.randn(B, H_kv, Tk, 8, generator=g, dtype=torch.float64)
    delta = -2 * math.pi * torch.rand(H_kv, d, generator=g, dtype=torch.float64)
    delta[0, 0], delta[-1, -1] = -2 * math.pi, 0.0
    theta = pope_frequencies(d, 500.0).double()
    t = torch.arange(Tk - Tq, Tk, dtype=torch.float64)
    s = torch.arange(Tk, dtype=torch.float64)
    G = H // H_kv
    dq = delta.repeat_interleave(G, 0)  # (H, d): each query head's key/value head's delta
    qz = F.softplus(q) * torch.exp(1j * (t[:, None] * theta - dq[:, None, :]))  # (B, H, Tq, d) complex
    kz = F.softplus(k) * torch.exp(1j * s[:, None] * theta)  # (B, H_kv, Tk, d)
    kz, vv = kz.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    logits = torch.einsum("bhic,bhjc->bhij", qz.conj(), kz).real / math.sqrt(d)
    logits = logits.masked_fill(s[None, :] > t[:, None], float("-inf"))
    got = torch.softmax(logits, -1) @ vv
    want = pope_attention_reference(q, k, v, delta, q_offset=Tk - Tq, rope_theta=500.0)
    assert logits[torch.isfinite(logits)].std() > 1  # peaked: a wrong phase moves the output
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize(
    "H, H_kv, Tq, Tk, q_offset",
    [(2, 2, 1, 9, 8), (4, 2, 1, 9, 8), (4, 1, 5, 12, 7), (2, 2, 12, 12, 0), (4, 2, 3, 12, 4)],
)
@pytest.mark.parametrize("magnitude, with_delta", [("softplus", True), ("relu", True), ("identity", False)])
def test_decoding_over_key_magnitudes_equals_pope_attention(H, H_kv, Tq, Tk, q_offset, magnitude, with_delta):
    """Decoding over the cached key form (pope_key_magnitude, appended in two pieces as a cache fills, with a
    rotation table longer than the cache) equals pope_attention on the raw keys and the float64 reference:
    one new token (two matmuls), a chunk, grouped heads, keys past the queries unseen, each magnitude, no delta."""
    g = torch.Generator().manual_seed(4)
    q = 3 * torch.randn(1, H, Tq, 16, generator=g)  # scaled: peaked attention, so wrong phases show
    k, v = 3 * torch.randn(1, H_kv, Tk, 16, generator=g), torch.randn(1, H_kv, Tk, 8, generator=g)
    delta = -2 * math.pi * torch.rand(H_kv, 16, generator=g) if with_delta else None
    kw = dict(q_offset=q_offset, rope_theta=500.0, magnitude=magnitude)
    want = pope_attention(q, k, v, delta, backend="torch", **kw)
    mu = torch.cat([pope_key_magnitude(k[:, :, :3], magnitude), pope_key_magnitude(k[:, :, 3:], magnitude)], dim=2)
    assert mu.shape == k.shape
    got = pope_attention_decode(q, mu, v, delta, rotation=pope_rotation_table(Tk + 5, 16, 500.0), backend="torch", **kw)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    ref = pope_attention_reference(q, k, v, delta, **kw)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


def test_query_decode_form_carries_minus_delta_of_its_key_head():
    """pope_query_decode_form: [mu cos(t theta - delta), mu sin(t theta - delta)] with the key/value head's delta
    (query heads 0, 1 -> key/value head 0; 2, 3 -> 1), against the formula in float64."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 2, 8, generator=g)
    delta = -2 * math.pi * torch.rand(2, 8, generator=g)
    got = pope_query_decode_form(q, 30, delta, 100.0, "softplus", torch.float64)
    theta = pope_frequencies(8, 100.0).double()
    psi = torch.arange(30, 32, dtype=torch.float64)[:, None] * theta - delta.double().repeat_interleave(2, 0)[:, None]
    mu = F.softplus(q.double())
    torch.testing.assert_close(got, torch.cat((mu * torch.cos(psi), mu * torch.sin(psi)), -1), atol=1e-6, rtol=1e-6)


def test_theta_keyword_still_works_with_one_deprecation_warning():
    """rope_theta was called theta: old callers keep working, warned once per process."""
    code = (
        f"import sys, warnings, torch; sys.path.insert(0, {REPO!r})\n"
        "warnings.simplefilter('always')\n"
        "import pope\n"
        "q = torch.randn(1, 2, 5, 8)\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    a = pope.pope_frequencies(8, theta=500.0)\n"
        "    b = pope.pope_attention(q, q, q, theta=500.0, backend='torch')\n"
        "    c = pope.pope_attention_reference(q, q, q, theta=500.0)\n"
        "assert torch.equal(a, pope.pope_frequencies(8, rope_theta=500.0))\n"
        "assert torch.equal(b, pope.pope_attention(q, q, q, rope_theta=500.0, backend='torch'))\n"
        "assert torch.equal(c, pope.pope_attention_reference(q, q, q, rope_theta=500.0))\n"
        "assert not torch.equal(b, pope.pope_attention(q, q, q, backend='torch'))\n"
        "dep = [x for x in w if issubclass(x.category, DeprecationWarning) and 'rope_theta' in str(x.message)]\n"
        "assert len(dep) == 1, [str(x.message) for x in w]\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


def test_pope_imports_and_runs_without_triton():
    """pope.py is the maths and the torch path: it must import and run where triton is missing (macOS)."""
    code = (
        f"import sys; sys.path.insert(0, {REPO!r}); sys.modules['triton'] = None\n"
        "import torch, pope, model\n"
        "assert pope.pope_kernel is None\n"
        "q = torch.randn(1, 2, 5, 16)\n"
        "assert pope.pope_attention(q, q, q).shape == (1, 2, 5, 16)\n"
        "assert 'triton is not importable' in pope.triton_unsupported_reason(q, q, q)\n"
        "print('ok')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


def test_single_token_decoding_over_several_key_chunks(monkeypatch):
    """The torch path's single-token step walks the cache in chunks of pope._decode_chunk keys (set to 256 here;
    8192 for this cache's size): over 600 keys (three chunks, the last one ragged) with grouped heads it equals
    the float64 reference."""
    import pope

    g = torch.Generator().manual_seed(8)
    q, k = 3 * torch.randn(1, 4, 1, 16, generator=g), 3 * torch.randn(1, 2, 600, 16, generator=g)
    v, delta = torch.randn(1, 2, 600, 16, generator=g), -2 * math.pi * torch.rand(2, 16, generator=g)
    assert pope._decode_chunk(k) == 8192
    monkeypatch.setattr(pope, "_decode_chunk", lambda mu_k: 256)
    got = pope_attention_decode(q, pope_key_magnitude(k), v, delta, q_offset=599, rope_theta=500.0, backend="torch")
    ref = pope_attention_reference(q, k, v, delta, q_offset=599, rope_theta=500.0)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    assert (ref - v.double().mean(2, keepdim=True).repeat_interleave(2, 1)).abs().max() > 0.3  # peaked
