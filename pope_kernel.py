"""PoPE attention: the one place where Polar Coordinate Position Embedding meets softmax attention.

Paper: Gopalakrishnan, Csordas, Schmidhuber, Mozer, "Decoupling the What and Where with Polar
Coordinate Positional Embedding", ICML 2026, Method section. For head dimension d, every one of
the d channels of a query at position t and a key at position s becomes a complex number

    q~_c = softplus(q_c) * exp(i * t * theta_c)
    k~_c = softplus(k_c) * exp(i * (s * theta_c + delta_c)),   theta_c = base^(-(c-1)/d)

and the attention logit is sm_scale * Re[q~^H k~] = sm_scale * sum_c mu_q mu_k cos((s-t) theta_c + delta_c).
Writing x = mu cos(phi), y = mu sin(phi) turns that into a real dot product over 2d channels, which
is what the PyTorch path below hands to scaled_dot_product_attention.

Public API
    pope_attention(q, k, v, delta, *, causal, theta, sm_scale, q_offset, magnitude)  -> (B, H, Tq, d)
    pope_attention_reference(...)  float64 polar-form reference for tests (O(T^2) memory)
    sdpa_attention(q, k, v, *, causal, sm_scale, q_offset)  plain attention with the same
        causal/q_offset convention, used by the RoPE and NoPE paths of model.py
    pope_frequencies(head_dim, theta)  the d frequencies theta_c, in radians per token
"""

import math

import torch
import torch.nn.functional as F

MAGNITUDES = ("softplus", "relu", "identity")


def pope_frequencies(head_dim, theta=10000.0, device=None):
    """The d PoPE frequencies theta_c = theta^(-(c-1)/d), c = 1..d, as float32 radians per token.

    Shape (head_dim,). They lie in (theta^(-1+1/d), 1], like RoPE's. The paper prints the exponent
    without its minus sign; frequencies above 1 rad/token would alias, so the sign is restored here.
    Raises ValueError for head_dim < 1 or theta <= 1.
    """
    if head_dim < 1 or theta <= 1:
        raise ValueError(f"need head_dim >= 1 and theta > 1, got head_dim={head_dim}, theta={theta}")
    c = torch.arange(head_dim, device=device, dtype=torch.float64)
    return (theta ** (-c / head_dim)).to(torch.float32)


def _magnitude(x, magnitude):
    if magnitude == "softplus":
        return F.softplus(x)
    if magnitude == "relu":
        return F.relu(x)
    if magnitude == "identity":
        return x
    raise ValueError(f"magnitude must be one of {MAGNITUDES}, got {magnitude!r}")


def _check(q, k, v, delta, q_offset):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be (B, H, T, d); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; "
                         "expected q (B, H, Tq, d), k (B, H, Tk, d), v (B, H, Tk, dv)")
    if delta is not None and tuple(delta.shape) != (q.shape[1], q.shape[-1]):
        raise ValueError(f"delta must be (H, d) = {(q.shape[1], q.shape[-1])}, got {tuple(delta.shape)}")
    if q_offset < 0:
        raise ValueError(f"q_offset must be >= 0 (absolute position of the first query), got {q_offset}")


def causal_mask(Tq, Tk, q_offset, device=None):
    """Boolean (Tq, Tk) mask, True where query i (at absolute position q_offset + i) may see key j,
    i.e. j <= q_offset + i. Keys sit at absolute positions 0..Tk-1."""
    i = torch.arange(Tq, device=device).unsqueeze(1)
    j = torch.arange(Tk, device=device).unsqueeze(0)
    return j <= i + q_offset


def sdpa_attention(q, k, v, *, causal=True, sm_scale=None, q_offset=0):
    """Softmax attention through F.scaled_dot_product_attention with PoPE's position convention.

    q (B, H, Tq, dk), k (B, H, Tk, dk), v (B, H, Tk, dv) -> (B, H, Tq, dv).
    Query i sits at absolute position q_offset + i, key j at position j; with causal=True query i
    sees keys j <= q_offset + i. q_offset = 0 with Tq = Tk is ordinary training; q_offset = Tk - Tq
    is decoding with a KV cache (bottom-right alignment). sm_scale defaults to 1/sqrt(dk).
    The common cases (Tq = Tk and q_offset = 0, or non-causal) keep SDPA's O(T) fused kernels;
    any other q_offset materialises a (Tq, Tk) boolean mask, which is small when decoding.
    """
    Tq, Tk = q.shape[-2], k.shape[-2]
    if not causal:
        return F.scaled_dot_product_attention(q, k, v, scale=sm_scale)
    if q_offset == 0 and Tq == Tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=sm_scale)
    if Tq == 1 and q_offset >= Tk - 1:  # one new token that sees every cached key
        return F.scaled_dot_product_attention(q, k, v, scale=sm_scale)
    mask = causal_mask(Tq, Tk, q_offset, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sm_scale)


def _polar_to_cartesian(x, positions, freqs, delta, magnitude, out_dtype):
    """x (B, H, T, d) raw -> (B, H, T, 2d) [mu cos(phi), mu sin(phi)], phi = pos * freq (+ delta).

    Phases and cos/sin are computed in float32 even under bf16 autocast: at 10k tokens the phase
    reaches 1e4 rad and bf16 would keep no fractional digits of it.
    """
    with torch.autocast(device_type=x.device.type, enabled=False):
        mu = _magnitude(x.float(), magnitude)
        phase = positions.float().unsqueeze(-1) * freqs  # (T, d), radians
        if delta is not None:
            phase = phase + delta.float().unsqueeze(1)  # (H, T, d)
        out = torch.cat((mu * torch.cos(phase), mu * torch.sin(phase)), dim=-1)
    return out.to(out_dtype)


def pope_attention(q, k, v, delta=None, *, causal=True, theta=10000.0, sm_scale=None, q_offset=0,
                   magnitude="softplus", backend="torch"):
    """PoPE softmax attention (paper, Method section, the score equation).

    Args:
        q: (B, H, Tq, d) raw queries, before the magnitude function.
        k: (B, H, Tk, d) raw keys, before the magnitude function.
        v: (B, H, Tk, dv) values.
        delta: (H, d) per-head phase bias in radians added to the key phases, or None for 0.
            model.py keeps it inside [-2*pi, 0]; this function does not clamp it.
        causal: if True, query i sees keys j <= q_offset + i.
        theta: frequency base; theta_c = theta^(-(c-1)/d) radians per token.
        sm_scale: logit scale, default 1/sqrt(d) with d the raw head dim (not 2d).
        q_offset: absolute position of the first query relative to the first key, in tokens
            (Tk - Tq when decoding with a KV cache).
        magnitude: 'softplus' (the paper), or the ablations 'relu' and 'identity'.
        backend: 'torch' (this file's SDPA path).

    Returns:
        (B, H, Tq, dv) in v's dtype.

    The torch path builds the 2d-wide Cartesian q~, k~ and pads v with zeros to 2d so that SDPA can
    use its fused O(T)-memory kernel (SDPA falls back to the O(T^2) math kernel when the q/k and v
    head dims differ). Raises ValueError on shape, magnitude or q_offset errors.
    """
    _check(q, k, v, delta, q_offset)
    if backend != "torch":
        raise ValueError(f"backend must be 'torch', got {backend!r}")
    d, dv, Tq, Tk = q.shape[-1], v.shape[-1], q.shape[-2], k.shape[-2]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    freqs = pope_frequencies(d, theta, device=q.device)
    dtype = v.dtype if not torch.is_autocast_enabled(q.device.type) else torch.get_autocast_dtype(q.device.type)
    q_pos = torch.arange(q_offset, q_offset + Tq, device=q.device)
    k_pos = torch.arange(Tk, device=q.device)
    qc = _polar_to_cartesian(q, q_pos, freqs, None, magnitude, dtype)
    kc = _polar_to_cartesian(k, k_pos, freqs, delta, magnitude, dtype)
    v_pad = F.pad(v.to(dtype), (0, 2 * d - dv)) if dv < 2 * d else v.to(dtype)
    out = sdpa_attention(qc, kc, v_pad, causal=causal, sm_scale=sm_scale, q_offset=q_offset)
    return out[..., :dv]


def pope_attention_reference(q, k, v, delta=None, *, causal=True, theta=10000.0, sm_scale=None,
                             q_offset=0, magnitude="softplus"):
    """Float64 reference of pope_attention straight from the polar score formula, for tests.

    logits[b,h,i,j] = sm_scale * sum_c mu_q[i,c] mu_k[j,c] cos((j - (q_offset+i)) theta_c + delta[h,c]);
    same arguments and shapes as pope_attention, returns float64 (B, H, Tq, dv). Materialises the
    (B, H, Tq, Tk, d) cosine tensor, so keep it to small shapes.
    """
    _check(q, k, v, delta, q_offset)
    d, Tq, Tk = q.shape[-1], q.shape[-2], k.shape[-2]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    freqs = theta ** (-torch.arange(d, dtype=torch.float64, device=q.device) / d)
    mu_q = _magnitude(q.double(), magnitude)
    mu_k = _magnitude(k.double(), magnitude)
    rel = (torch.arange(Tk, device=q.device) - (q_offset + torch.arange(Tq, device=q.device)).unsqueeze(1)).double()
    delta = torch.zeros(q.shape[1], d, dtype=torch.float64, device=q.device) if delta is None else delta.double()
    angle = rel[None, :, :, None] * freqs + delta[:, None, None, :]  # (H, Tq, Tk, d) radians
    logits = sm_scale * torch.einsum("bhic,bhjc,hijc->bhij", mu_q, mu_k, torch.cos(angle))
    if causal:
        logits = logits.masked_fill(~causal_mask(Tq, Tk, q_offset, device=q.device), float("-inf"))
    return torch.softmax(logits, dim=-1) @ v.double()
