"""PoPE's maths in plain PyTorch: frequencies, the polar-to-Cartesian transform, attention, the cached key form.

Paper: Gopalakrishnan, Csordas, Schmidhuber, Mozer, "Decoupling the What and Where with Polar
Coordinate Positional Embedding", ICML 2026, Method section. For head dimension d, each of the d
channels of a query at position t and of a key at position s becomes a complex number

    q~_c = softplus(q_c) exp(i t theta_c),    k~_c = softplus(k_c) exp(i (s theta_c + delta_c)),
    theta_c = rope_theta^(-(c-1)/d) radians per token,

and the attention logit is sm_scale Re[q~^H k~] = sm_scale sum_c mu_q mu_k cos((s - t) theta_c + delta_c).
With x = mu cos(phi) and y = mu sin(phi) this is a real dot product of width 2d between the Cartesian
forms [x, y] of query and key. Both backends compute that transform here, once per call (O(T d)), from
rows of a float32 rotation table [cos s theta | sin s theta] (pope_rotation_table; GPT keeps one as
GPT.rotation) with delta by angle addition, and then run ordinary softmax attention of width 2d for q/k
and d for v:
    'torch'   F.scaled_dot_product_attention (CPU or GPU), v zero-padded to 2d so SDPA keeps its
              fused O(T)-memory kernels;
    'triton'  pope_kernel.py's FlashAttention-2 kernels (CUDA; on CPU under TRITON_INTERPRET=1); the transform
              stays PyTorch, which torch.compile fuses, under a selective checkpoint (it is recomputed for
              the backward, never saved).
Decoding moves delta to the query: conj(mu_q e^{i(t theta - delta)}) mu_k e^{i s theta} has real part
mu_q mu_k cos((s - t) theta + delta), the same score. So the KV cache stores mu_k (d wide, RoPE's bytes)
for both backends and rotates it at attention time (pope_key_magnitude, pope_attention_decode).

Public API
    pope_attention(q, k, v, delta, *, causal, rope_theta, sm_scale, q_offset, magnitude, backend, rotation,
                   document_ids, position_ids, mask)   packed documents: block-causal mask, positions per token
    document_mask(document_ids, Tq, q_offset, causal, flex), masked_attention(q, k, v, mask, sm_scale, score_mod),
    check_document_ids(...), check_positions(position_ids, n_rows)
    pope_attention_decode(q, mu_k, v, delta, *, rotation, ...)   decoding over cached key magnitudes
    pope_decode_step(q, mu_all, v_all, delta, rotation, at, seen)  one token over a static cache (compiled decoding)
    pope_key_magnitude(k, magnitude)       the key form the KV cache stores (mu_k, d wide)
    pope_query_decode_form(q, q_offset, delta, ...), pope_rotation_table(n_positions, head_dim, rope_theta)
    polar_to_cartesian(x, positions, freqs, delta, magnitude, dtype, scale)
    pope_cartesian(x, rows, delta, magnitude, scale, dtype)   the transform both backends run, from table rows
    pope_frequencies(head_dim, rope_theta), pope_magnitude(x, magnitude), MAGNITUDES
    pope_attention_reference(...)   float64 reference straight from the polar formula (tests)
    pope_attention_triton(...), pope_backend(q, k, v, backend), triton_unsupported_reason(q, k, v),
    triton_supported(q, k, v), TRITON_HEAD_DIMS, compute_dtype(q, v)
    sdpa_attention(q, k, v, *, causal, sm_scale, q_offset), sdpa_gqa(q, k, v, masked), causal_mask(Tq, Tk, q_offset),
    flash_sdpa_accepts(q, k, v, masked)
Grouped-query attention: k, v and delta may have H_kv heads for H query heads (H a multiple of H_kv);
query head h uses key/value head h // (H / H_kv).
This module imports without Triton; only backend='triton' needs it.
"""

import logging
import math
import warnings

import torch
import torch.nn.functional as F

try:
    import pope_kernel

    _KERNEL_IMPORT_ERROR = None
except Exception as _e:  # pragma: no cover - triton missing (macOS, Windows) or broken
    pope_kernel = None
    _KERNEL_IMPORT_ERROR = _e

MAGNITUDES = ("softplus", "relu", "identity")
TRITON_HEAD_DIMS = (16, 32, 64, 128)  # raw head dims d (and dv) the Triton backend takes
TENSOR_CORE_CAPABILITY = (8, 0)  # Triton's tl.dot runs on tensor cores (mma) from sm_80; backend='auto' needs it
LOG2E = 1.4426950408889634
_THETA_WARNED = []


def _rope_theta(rope_theta, theta):
    """The frequency base, accepting the keyword `theta` of earlier versions with a one-time DeprecationWarning."""
    if theta is None:
        return rope_theta
    if not _THETA_WARNED:
        _THETA_WARNED.append(True)
        warnings.warn(
            "the PoPE keyword 'theta' is now 'rope_theta' (as in GPTConfig); 'theta' will be removed",
            DeprecationWarning,
            stacklevel=3,
        )
    return theta


def pope_frequencies(head_dim, rope_theta=10000.0, device=None, *, theta=None):
    """The d PoPE frequencies theta_c = rope_theta^(-(c-1)/d), c = 1..d, as float32 radians per token.

    Shape (head_dim,). They lie in (rope_theta^(-1+1/d), 1], like RoPE's. The paper prints the exponent
    without its minus sign; frequencies above 1 rad/token would alias, so the sign is restored here.
    `theta` is the deprecated name of rope_theta. Raises ValueError for head_dim < 1 or rope_theta <= 1.
    """
    rope_theta = _rope_theta(rope_theta, theta)
    if head_dim < 1 or rope_theta <= 1:
        raise ValueError(f"need head_dim >= 1 and rope_theta > 1, got head_dim={head_dim}, rope_theta={rope_theta}")
    c = torch.arange(head_dim, device=device, dtype=torch.float64)
    return (rope_theta ** (-c / head_dim)).to(torch.float32)


def pope_magnitude(x, magnitude="softplus"):
    """mu = softplus(x) (the paper), or the ablations relu(x) and x ('identity'). Raises ValueError otherwise."""
    if magnitude == "softplus":
        return F.softplus(x)
    if magnitude == "relu":
        return F.relu(x)
    if magnitude == "identity":
        return x
    raise ValueError(f"magnitude must be one of {MAGNITUDES}, got {magnitude!r}")


def _phase_cos_sin(positions, freqs, delta):
    """float32 cos and sin of positions * freqs (+ delta) radians: (T, d), or (H, T, d) with delta (H, d).

    The phase is formed in float64 and rounded to float32 only after cos/sin, so it is the exact product
    s * theta_c of the float32 table: a float32 product is off by up to ~4e-3 rad at 1e5 tokens.
    """
    phase = positions.double()[:, None] * freqs.double()
    if delta is not None:
        phase = phase + delta.double()[:, None, :]
    return torch.cos(phase).float(), torch.sin(phase).float()


def polar_to_cartesian(x, positions, freqs, delta=None, magnitude="softplus", dtype=None, scale=1.0):
    """Raw queries or keys -> their Cartesian form, differentiable in x and delta.

    x (B, H, T, d) raw (before the magnitude function); positions (T,) absolute token positions; freqs (d,)
    radians per token (pope_frequencies); delta (H, d) radians or None. Returns (B, H, T, 2d)
    scale * [mu cos(phi), mu sin(phi)], mu = magnitude(x), phi = position * theta_c (+ delta_c), in `dtype`
    (default x's). Magnitudes, phases and products stay float32 (phases formed in float64) even under
    bf16 autocast.
    """
    with torch.autocast(device_type=x.device.type, enabled=False):
        mu = pope_magnitude(x.float(), magnitude)
        if scale != 1.0:
            mu = mu * scale
        cos, sin = _phase_cos_sin(positions, freqs, delta)
        out = torch.cat((mu * cos, mu * sin), dim=-1)
    return out.to(dtype or x.dtype)


def pope_cartesian(x, rows, delta=None, magnitude="softplus", scale=1.0, dtype=None):
    """Raw x (B, H, T, d) and the rotation table's rows for its positions (T, 2d) float32 [cos(s theta) |
    sin(s theta)] (pope_rotation_table), or per-token rows (B, 1, T, 2d) broadcast over heads (position_ids:
    rotation[position_ids].unsqueeze(1)) -> (B, H, T, 2d) scale * mu [cos(phi), sin(phi)] in `dtype` (default
    x's), mu = magnitude(x), phi = s theta_c + delta_c: delta (H, d) radians (or None) enters by angle addition,
    cos(a + b) = cos a cos b - sin a sin b, so the only trigonometry is cos/sin of delta's H * d entries.
    Computed in float32 (float64 for float64 x) under any autocast and rounded once to `dtype`; O(T d).

    Differentiable in x and delta, twice (the rows get no gradient), with the chain rule written out (_Cartesian)
    so that torch.compile makes one pass per direction (bench.py --only=bytes, docs/kernel.md): the forward one
    pointwise kernel writing the result once; the backward one pointwise kernel reading the 2d-wide gradient and x,
    writing dx, and for delta one reduction over batch and positions. The backward is itself differentiable
    (create_graph=True: Hessian-vector products, gradient penalties, torch.autograd.gradgradcheck), in x, delta and
    the upstream gradient; cos and sin of delta are formed here with their graph, so its second derivatives
    through delta are autograd's chain through them (issue 75)."""
    ct = torch.promote_types(x.dtype, torch.float32)
    with torch.autocast(device_type=x.device.type, enabled=False):
        cos_delta = sin_delta = None
        if delta is not None:  # not detached: the backward's formulas depend on delta through them (2nd order)
            cos_delta, sin_delta = torch.cos(delta.to(ct)), torch.sin(delta.to(ct))
        return _Cartesian.apply(x, rows, delta, cos_delta, sin_delta, magnitude, float(scale), dtype or x.dtype)


def _magnitude_grad(x, magnitude):
    """d magnitude(x) / dx (pope_magnitude): sigmoid(x) for softplus (torch's, whose linear branch above 20 has
    slope 1 = sigmoid(x) in float32), the step x > 0 for relu, 1 for identity."""
    if magnitude == "softplus":
        return torch.sigmoid(x)
    if magnitude == "relu":
        return (x > 0).to(x.dtype)
    return torch.ones_like(x)


def _pair_rotations(rows, cos_delta, sin_delta, ct):
    """Table rows (..., T, 2d) -> (..., T, 2, d) [cos phi, sin phi] in ct; with delta's cos/sin (H, d), phi gains
    delta by angle addition: [cos, sin] cos(delta) + [-sin, cos] sin(delta), (H, T, 2, d) or (B, H, T, 2, d)."""
    rot = rows.to(ct).unflatten(-1, (2, rows.shape[-1] // 2))
    if cos_delta is None:
        return rot
    sign = torch.tensor([-1.0, 1.0], dtype=ct, device=rows.device).unsqueeze(-1)  # [-sin, cos] = sign * flip
    return rot * cos_delta[:, None, None, :] + rot.flip(-2) * sign * sin_delta[:, None, None, :]


def _pair_magnitudes(x, magnitude, scale, ct):
    """scale * magnitude(x) over (..., 2, d), one per half of the Cartesian form: the same values either way (to one
    ulp where the CPU's vectorised softplus leaves a scalar tail). Under
    torch.compile x is broadcast before the magnitude function, not its result: Inductor's CPU heuristic stores a
    broadcast softplus (exp, log1p: "heavy" ops) in a float32 buffer of its own, a write and a read of 4 bytes per
    element that the CUDA backend does not make. In eager mode the broadcast would materialise x twice in float32
    and run the magnitude on both copies, so there the result is broadcast (a view)."""
    if not torch.compiler.is_compiling():
        return (pope_magnitude(x.to(ct), magnitude) * scale).unsqueeze(-2)
    pairs = x.unsqueeze(-2).expand(*x.shape[:-1], 2, x.shape[-1]).to(ct)
    return pope_magnitude(pairs, magnitude) * scale


class _Cartesian(torch.autograd.Function):
    """pope_cartesian's transform with its chain rule written out. For an upstream gradient g = [g_x, g_y] (the
    2d-wide gradient of the result) and mu = scale * magnitude(x):
        dx     = (g_x cos phi + g_y sin phi) scale magnitude'(x)
        ddelta = sum over batch and positions of mu (g_y cos phi - g_x sin phi)        (d phi / d delta = 1)
    Autograd's own backward of the broadcast product writes d(mu) and d(rotation) tensors and sums them (five
    kernels, issue 67); this one reads g and x once for dx, and once more for delta's reduction.

    Inputs: x (B, H, T, d), rows (T, 2d) or (B, 1, T, 2d), delta (H, d) or None (only to ask for its gradient),
    cos_delta and sin_delta (H, d) in the compute dtype ct (float32, float64 for float64 x), or None. The gradient
    of delta is returned for delta and None for cos_delta, sin_delta, which pope_cartesian forms from delta without
    detaching them: the backward's formulas are differentiable ops on the saved x, cos_delta, sin_delta and g, so a
    second derivative (create_graph=True) flows to x directly and to delta through cos and sin, exactly. Both
    directions compute in ct whatever x's and g's dtypes (bf16 under autocast): dx is rounded once to x's dtype,
    d(delta) is returned in ct."""

    @staticmethod
    def forward(ctx, x, rows, delta, cos_delta, sin_delta, magnitude, scale, dtype):
        ct = torch.promote_types(x.dtype, torch.float32)
        ctx.save_for_backward(x, rows, cos_delta, sin_delta)
        ctx.args = (magnitude, scale)
        out = _pair_magnitudes(x, magnitude, scale, ct) * _pair_rotations(rows, cos_delta, sin_delta, ct)
        return out.to(dtype).flatten(-2)

    @staticmethod
    def backward(ctx, grad):
        x, rows, cos_delta, sin_delta = ctx.saved_tensors
        magnitude, scale = ctx.args
        ct = torch.promote_types(x.dtype, torch.float32)
        g = grad.unflatten(-1, (2, x.shape[-1]))  # bf16 / fp16: each product with rot (ct) promotes it, exactly
        if torch.is_grad_enabled() or torch.promote_types(g.dtype, ct) != ct:
            g = g.to(ct)  # create_graph (one cast for the second derivative to flow through), or g wider than ct
        rot = _pair_rotations(rows, cos_delta, sin_delta, ct)
        xf = x.to(ct)
        dx = ddelta = None
        if ctx.needs_input_grad[0]:
            dx = ((g * rot).sum(-2) * (scale * _magnitude_grad(xf, magnitude))).to(x.dtype)
        if ctx.needs_input_grad[2]:
            mu = pope_magnitude(xf, magnitude) * scale
            dphi = mu * (g[..., 1, :] * rot[..., 0, :] - g[..., 0, :] * rot[..., 1, :])  # (B, H, T, d)
            ddelta = dphi.sum([i for i in range(dphi.dim()) if i not in (dphi.dim() - 3, dphi.dim() - 1)])
        return dx, None, ddelta, None, None, None, None, None


def _rotation_rows(rotation, n_positions, head_dim, rope_theta, device):
    """`rotation` checked to hold n_positions rows of width 2 * head_dim, or a new pope_rotation_table."""
    if rotation is None:
        return pope_rotation_table(n_positions, head_dim, rope_theta, device=device)
    if rotation.dim() != 2 or rotation.shape[0] < n_positions or rotation.shape[1] != 2 * head_dim:
        raise ValueError(
            f"rotation must be (>= {n_positions}, {2 * head_dim}) (pope_rotation_table rows for positions "
            f"0..{n_positions - 1}), got {tuple(rotation.shape)}"
        )
    return rotation


def pope_rotation_table(n_positions, head_dim, rope_theta=10000.0, device=None):
    """The keys' rotations e^{i s theta_c} for s = 0..n_positions-1: (n_positions, 2 * head_dim) float32
    [cos(s theta_c) | sin(s theta_c)], phases formed in float64 (pope_frequencies' float32 theta_c).

    The same for every head, layer and batch row: KVCache keeps one per (head_dim, rope_theta, device), and
    both decoding backends read it (pope_attention_decode; the Triton kernel only its rows 0..BLOCK_N-1 and
    one row per key tile, by the angle-addition formula).
    """
    freqs = pope_frequencies(head_dim, rope_theta, device=device)
    cos, sin = _phase_cos_sin(torch.arange(n_positions, device=device), freqs, None)
    return torch.cat((cos, sin), dim=-1)


def pope_key_magnitude(k, magnitude="softplus", dtype=None):
    """The form the KV cache stores for PoPE, both backends: mu_k = magnitude(k) of raw keys (B, H_kv, T, d),
    d wide as RoPE's keys, in `dtype` (default: the autocast dtype under autocast, else k's).

    The key's phase s theta_c is rotated in at attention time (pope_attention_decode) and delta rides on the
    query (pope_query_decode_form), so a cached entry depends neither on its position nor on delta. Stored
    after the magnitude function (not raw k), so a decoding step spends no softplus on the cached keys.
    """
    with torch.autocast(device_type=k.device.type, enabled=False):
        mu = pope_magnitude(k.float(), magnitude)
    return mu.to(dtype or compute_dtype(k, k))


def pope_query_decode_form(
    q, q_offset, delta, rope_theta=10000.0, magnitude="softplus", dtype=None, scale=1.0, rotation=None
):
    """Raw queries (B, H, Tq, d) at positions q_offset.. -> (B, H, Tq, 2d) scale * [mu_q cos(psi), mu_q sin(psi)],
    psi = t theta_c - delta_c radians, delta (H_kv, d) of the query's key/value head (query head h uses
    h // (H / H_kv)), or None for 0. Its dot product with a key's [mu_k cos(s theta), mu_k sin(s theta)] is
    mu_q mu_k cos((s - t) theta_c + delta_c): PoPE's score with delta moved from the key to the query.
    rotation: pope_rotation_table with >= q_offset + Tq rows (None: built here). Phases from the table (delta by
    angle addition), products in float32, result in `dtype` (default q's). Raises ValueError for a short table.
    """
    H, Tq, d = q.shape[1], q.shape[2], q.shape[-1]
    rotation = _rotation_rows(rotation, q_offset + Tq, d, rope_theta, q.device)
    neg = None if delta is None else -delta.repeat_interleave(H // delta.shape[0], dim=0)
    return pope_cartesian(q, rotation[q_offset : q_offset + Tq], neg, magnitude, scale, dtype)


def compute_dtype(q, v):
    """The dtype attention runs in: the autocast dtype under autocast on q's device, else v's dtype."""
    dev = q.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else v.dtype


def causal_mask(Tq, Tk, q_offset, device=None):
    """Boolean (Tq, Tk) mask, True where query i (at absolute position q_offset + i) may see key j,
    i.e. j <= q_offset + i. Keys sit at absolute positions 0..Tk-1."""
    i = torch.arange(Tq, device=device).unsqueeze(1)
    j = torch.arange(Tk, device=device).unsqueeze(0)
    return j <= i + q_offset


def document_mask(document_ids, Tq=None, q_offset=0, *, causal=True, flex=None):
    """The block-causal mask of packed documents (torchtitan's attn_mask_type='block_causal').

    document_ids: (B, Tk) int32, non-decreasing along Tk: the document of each key; query i sits at position
    q_offset + i and takes the id document_ids[:, q_offset + i]. Query i sees key j iff both ids are equal and
    (causal) j <= q_offset + i. Tq: queries (default Tk - q_offset). flex: True gives a FlexAttention BlockMask
    (B, 1, Tq, Tk) whose mask_mod is that predicate, so flex_attention skips every tile without a visible pair;
    False a boolean (B, 1, Tq, Tk) tensor, True where attention is allowed (SDPA's attn_mask); None (default):
    a BlockMask on CUDA, the boolean tensor elsewhere. Build it once per step and pass it to every layer
    (GPT.forward does); masked_attention runs either. Every query sees itself, so no row is fully masked.
    """
    B, Tk = document_ids.shape
    Tq = Tk - q_offset if Tq is None else Tq
    if flex if flex is not None else document_ids.is_cuda:
        return _document_block_mask(document_ids, Tq, q_offset, causal)
    qd = document_ids[:, q_offset : q_offset + Tq]
    allowed = qd[:, None, :, None] == document_ids[:, None, None, :]
    if causal:
        allowed = allowed & causal_mask(Tq, Tk, q_offset, device=document_ids.device)
    return allowed


@torch.compiler.disable  # built eagerly once per step, then an input of the compiled graph (torchtitan's pattern)
def _document_block_mask(document_ids, Tq, q_offset, causal):
    from torch.nn.attention.flex_attention import create_block_mask

    B, Tk = document_ids.shape

    def mask_mod(b, h, q_idx, kv_idx):
        same = document_ids[b, q_idx + q_offset] == document_ids[b, kv_idx]
        return same & (kv_idx <= q_idx + q_offset) if causal else same

    compiled = document_ids.is_cuda  # the mask built by a compiled kernel: no (B, Tq, Tk) tensor in memory
    return create_block_mask(mask_mod, B, None, Tq, Tk, device=document_ids.device, _compile=compiled)


_FLEX = {}


def _flex_attention(device):
    """flex_attention, compiled on CUDA (its fused kernels; inlined when the caller is compiled already), eager
    elsewhere (the unfused reference: correct, O(Tq Tk) memory; used on CPU only when asked for, e.g. tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if "cuda" not in _FLEX:
        _FLEX["cuda"] = torch.compile(flex_attention)  # as torchtitan; shapes go dynamic after the first change
    return _FLEX["cuda"]


def masked_attention(q, k, v, mask, *, sm_scale=None, score_mod=None):
    """Softmax attention under a document_mask: q (B, H, Tq, dk), k (B, H_kv, Tk, dk), v (B, H_kv, Tk, dv)
    -> (B, H, Tq, dv). mask: document_mask's boolean (B, 1, Tq, Tk) tensor (F.scaled_dot_product_attention,
    grouped heads through sdpa_gqa) or its BlockMask (flex_attention with enable_gqa, tiles skipped). score_mod:
    flex_attention's score_mod (BlockMask only; for the boolean mask give SDPA a float bias instead).
    sm_scale defaults to 1/sqrt(dk)."""
    if isinstance(mask, torch.Tensor):
        if score_mod is not None:
            raise ValueError("score_mod needs a BlockMask (flex); with a boolean mask pass a float bias to SDPA")
        k, v, gqa = sdpa_gqa(q, k, v, masked=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sm_scale, **gqa)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return _flex_attention(q.device)(
            q, k, v, score_mod=score_mod, block_mask=mask, scale=sm_scale, enable_gqa=q.shape[1] != k.shape[1]
        )


def check_document_ids(document_ids, position_ids, B, Tk, device, order=True):
    """Validate pope_attention's document_ids ((B, Tk) int32, non-decreasing along Tk, on `device`) and
    position_ids ((B, Tk) int64 on `device`); None passes. Raises ValueError with one line. The non-decreasing
    test reads the ids (a host sync), so it runs in eager mode only, not while torch.compile traces, and only
    with order=True (False: the caller checked it, as GPT.forward does once per forward for every layer)."""
    for name, t, dtype in (("document_ids", document_ids, torch.int32), ("position_ids", position_ids, torch.int64)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (B, Tk) or t.dtype != dtype:
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a (B, Tk) = {(B, Tk)} {dtype} tensor (one per key), got {got}")
        if t.device != device:
            raise ValueError(f"{name} must be on the device of q, k, v ({device}), got {t.device}")
    if (
        document_ids is not None
        and Tk > 1
        and order
        and document_ids.device.type != "meta"
        and not torch.compiler.is_compiling()
        and bool((document_ids[:, 1:] < document_ids[:, :-1]).any())
    ):
        raise ValueError("document_ids must be non-decreasing along each row (a document is one contiguous run)")


def sdpa_gqa(q, k, v, masked):
    """Grouped-query attention for F.scaled_dot_product_attention -> (k, v, kwargs): k, v as given with
    {"enable_gqa": True}, or repeated to the query heads with {}.

    q (B, H, Tq, dk), k (B, H_kv, Tk, dk), v (B, H_kv, Tk, dv); masked: an attn_mask will be passed.
    On CUDA, SDPA's flash kernel takes enable_gqa; its memory-efficient kernel does not in PyTorch 2.13,
    so where flash cannot run the call lands in the O(T^2) math kernel. There k and v are expanded
    (H / H_kv copies of the cache, O(T) memory) so the memory-efficient kernel runs: wherever
    flash_sdpa_accepts says no (an attn_mask, a float32 compute dtype, a GPU below sm_80 such as a V100
    or T4, ...). Elsewhere (CPU's fused kernel takes enable_gqa with masks and fp32; CUDA where flash
    runs) enable_gqa stays.
    """
    H, H_kv = q.shape[1], k.shape[1]
    if H == H_kv:
        return k, v, {}
    if q.is_cuda and not flash_sdpa_accepts(q, k, v, masked):
        G = H // H_kv
        return k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1), {}
    return k, v, {"enable_gqa": True}


FLASH_SDPA_CAPABILITIES = ((8, 0), (12, 1))  # SDPA's flash kernel runs from sm_80 to sm_121 (sdp_utils.cpp)
FLASH_SDPA_MAX_HEAD_DIM = 256


def flash_sdpa_accepts(q, k, v, masked):
    """True if CUDA SDPA's flash kernel takes a dense call on these (B, H, T, d) tensors, by the rules of
    PyTorch's can_use_flash_attention (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) for the calls
    sdpa_attention makes (no dropout; is_causal only with Tq = Tk): no attn_mask (`masked` False); a compute
    dtype (q's, or autocast's) of float16 or bfloat16; one head dim for q, k and v, at most 256; flash
    enabled (torch.backends.cuda.flash_sdp_enabled); and the GPU of q's own device in sm_80..sm_121, where
    sm_86..sm_89 and sm_120/121 refuse training (grad enabled and an input that requires grad) at head dims
    in (192, 224]. Asks nothing of a GPU when the tensors rule flash out."""
    if masked or compute_dtype(q, q) not in (torch.float16, torch.bfloat16):
        return False
    d = q.shape[-1]
    if not (d == k.shape[-1] == v.shape[-1] and d <= FLASH_SDPA_MAX_HEAD_DIM):
        return False
    training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return _flash_sdpa_device(q.device, d, training)


@torch.compiler.assume_constant_result  # under torch.compile: evaluated once while tracing, a constant
def _flash_sdpa_device(device, head_dim, training):
    """The device half of flash_sdpa_accepts, for CUDA `device` (that device, not the current one)."""
    if not torch.backends.cuda.flash_sdp_enabled():
        return False
    capability = torch.cuda.get_device_capability(device)
    lo, hi = FLASH_SDPA_CAPABILITIES
    if not lo <= capability <= hi:
        return False
    no_192_224_training = (8, 6) <= capability <= (8, 9) or (12, 0) <= capability <= (12, 1)
    return not (training and no_192_224_training and 192 < head_dim <= 224)


def sdpa_attention(q, k, v, *, causal=True, sm_scale=None, q_offset=0, mask=None):
    """Softmax attention through F.scaled_dot_product_attention with PoPE's position convention.

    q (B, H, Tq, dk), k (B, H_kv, Tk, dk), v (B, H_kv, Tk, dv) -> (B, H, Tq, dv); H a multiple of H_kv
    (grouped-query attention: sdpa_gqa). Query i sits at absolute position q_offset + i,
    key j at position j; with causal=True query i sees keys j <= q_offset + i. q_offset = 0 with Tq = Tk
    is ordinary training; q_offset = Tk - Tq is decoding with a KV cache (bottom-right alignment).
    sm_scale defaults to 1/sqrt(dk). The common cases (Tq = Tk and q_offset = 0, or non-causal) keep
    SDPA's O(T) fused kernels; any other q_offset materialises a (Tq, Tk) boolean mask, small when decoding, but on
    CUDA at q_offset = Tk - Tq with Tq > 1 (a context-parallel chunk) lower_right_attention runs without one.
    mask: a document_mask (boolean tensor or BlockMask) built for these queries; it replaces the causal
    mask (masked_attention).
    """
    if mask is not None:
        return masked_attention(q, k, v, mask, sm_scale=sm_scale)
    Tq, Tk = q.shape[-2], k.shape[-2]
    if not causal or (Tq == 1 and q_offset >= Tk - 1):  # a single new token sees every cached key
        k, v, gqa = sdpa_gqa(q, k, v, masked=False)
        return F.scaled_dot_product_attention(q, k, v, scale=sm_scale, **gqa)
    if q_offset == 0 and Tq == Tk:
        k, v, gqa = sdpa_gqa(q, k, v, masked=False)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=sm_scale, **gqa)
    if q.is_cuda and Tq > 1 and q_offset == Tk - Tq:  # a context-parallel chunk, a prompt continuing a cache
        return lower_right_attention(q, k, v, sm_scale)
    k, v, gqa = sdpa_gqa(q, k, v, masked=True)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_mask(Tq, Tk, q_offset, device=q.device), scale=sm_scale, **gqa
    )


def lower_right_attention(q, k, v, sm_scale=None):
    """Causal attention of the last Tq of Tk positions (q_offset = Tk - Tq, bottom-right alignment) without a (Tq, Tk)
    mask tensor: SDPA with torch.nn.attention.bias.causal_lower_right, which runs the flash or memory-efficient kernel
    with that alignment (a context-parallel rank's query chunk against the keys up to its end: a boolean mask there
    is chunk x end bytes per layer, 512 MB at 8k x 64k). Grouped heads: k, v repeated to the query heads, G x the
    gathered keys' bytes. (torch 2.13's CausalBias._dispatch passes enable_gqa to its flash check but then calls
    aten's flash and memory-efficient kernels directly, and the memory-efficient call does not expand k, v to the
    query heads: enable_gqa without the copy would be safe only where flash is chosen, and whether that raw flash
    call groups heads is unchecked on a GPU, so the copy stays.) q (B, H, Tq, dk), k (B, H_kv, Tk, dk), v (B, H_kv,
    Tk, dv)."""
    from torch.nn.attention.bias import causal_lower_right

    G = q.shape[1] // k.shape[1]
    if G > 1:
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    bias = causal_lower_right(q.shape[-2], k.shape[-2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=sm_scale)


def _check(q, k, v, delta, q_offset, magnitude, document_ids=None, position_ids=None, order=True):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be (B, H, T, d); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    (B, H, _, d), (Bk, H_kv, Tk, dk), (Bv, Hv, Tv, _) = q.shape, k.shape, v.shape
    if not (B == Bk == Bv and d == dk and (Hv, Tv) == (H_kv, Tk) and H_kv >= 1 and H % H_kv == 0):
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; expected "
            "q (B, H, Tq, d), k (B, H_kv, Tk, d), v (B, H_kv, Tk, dv) with H a multiple of H_kv"
        )
    if delta is not None and tuple(delta.shape) != (H_kv, d):
        raise ValueError(
            f"delta must be (H_kv, d) = {(H_kv, d)} (one phase per key head and channel), got {tuple(delta.shape)}"
        )
    if q_offset < 0:
        raise ValueError(f"q_offset must be >= 0 (absolute position of the first query), got {q_offset}")
    if magnitude not in MAGNITUDES:
        raise ValueError(f"magnitude must be one of {MAGNITUDES}, got {magnitude!r}")
    if document_ids is not None or position_ids is not None:
        if q_offset + q.shape[2] > Tk:
            raise ValueError(
                f"with document_ids or position_ids the queries must be keys too: q_offset + Tq = "
                f"{q_offset + q.shape[2]} > Tk = {Tk}"
            )
        check_document_ids(document_ids, position_ids, B, Tk, q.device, order)


def check_positions(position_ids, n_rows):
    """Validate position_ids against a rotation table of n_rows rows (positions 0..n_rows-1): every position
    must be >= 0 and < n_rows (a negative one would read the table's last rows, one past it raise IndexError).
    Reads the ids (one host sync), so it runs in eager mode only: skipped while torch.compile traces, on the
    meta device, and for None. Raises ValueError with one line that says what to pass."""
    if position_ids is None or torch.compiler.is_compiling() or position_ids.device.type == "meta":
        return
    if not position_ids.numel():
        return
    lo, hi = (int(v) for v in position_ids.aminmax())
    if lo < 0:
        raise ValueError(f"position_ids must be >= 0 (token positions), got {lo}")
    if hi >= n_rows:
        raise ValueError(
            f"position_ids reach {hi}, past the rotation table's {n_rows} rows (positions 0..{n_rows - 1}): pass "
            f"rotation=pope_rotation_table({hi + 1}, head_dim) or longer (GPT.ensure_positions grows GPT.rotation)"
        )


def _position_rows(rotation, position_ids, q_offset, Tq, Tk):
    """Rotation rows for the queries and keys: the table's rows q_offset.. and 0.. ((Tq, 2d), (Tk, 2d)), or with
    position_ids (B, Tk) int64 the rows of each token's own position, (B, 1, Tq, 2d) and (B, 1, Tk, 2d)."""
    if position_ids is None:
        return rotation[q_offset : q_offset + Tq], rotation[:Tk]
    return rotation[position_ids[:, q_offset : q_offset + Tq]].unsqueeze(1), rotation[position_ids].unsqueeze(1)


def pope_attention(
    q,
    k,
    v,
    delta=None,
    *,
    causal=True,
    rope_theta=10000.0,
    sm_scale=None,
    q_offset=0,
    magnitude="softplus",
    backend="auto",
    rotation=None,
    theta=None,
    document_ids=None,
    position_ids=None,
    mask=None,
    ids_checked=False,
):
    """PoPE softmax attention (paper, Method section, the score equation).

    Args:
        q: (B, H, Tq, d) raw queries, before the magnitude function.
        k: (B, H_kv, Tk, d) raw keys, before the magnitude function; H a multiple of H_kv.
        v: (B, H_kv, Tk, dv) values.
        delta: (H_kv, d) per-head phase bias in radians added to the key phases, or None for 0.
            model.py keeps it inside [-2*pi, 0]; this function does not clamp it.
        causal: if True, query i sees keys j <= q_offset + i.
        rope_theta: frequency base; theta_c = rope_theta^(-(c-1)/d) radians per token. (`theta`: its
            deprecated name, still accepted.)
        sm_scale: logit scale, default 1/sqrt(d) with d the raw head dim (not 2d).
        q_offset: absolute position of the first query relative to the first key, in tokens
            (Tk - Tq when decoding with a KV cache).
        magnitude: 'softplus' (the paper), or the ablations 'relu' and 'identity'.
        backend: 'auto' (default): the Triton kernel for CUDA tensors whose compute dtype is fp16/bf16
            and that it supports (pope_backend), else 'torch'. 'triton': pope_attention_triton (on CPU only
            under TRITON_INTERPRET=1, slow, for tests). 'torch': the Cartesian forms and SDPA.
        rotation: (>= max(q_offset + Tq, Tk), 2d) float32 pope_rotation_table, the phases s theta_c of
            positions 0.. (GPT.rotation); None builds one for this call (cos/sin of T * d phases in float64).
        document_ids: (B, Tk) int32, non-decreasing: packed documents (block_causal). Query i (at
            q_offset + i, which must be < Tk) sees only keys j <= q_offset + i with the same id. None: one document.
        position_ids: (B, Tk) int64 absolute position of each key (e.g. restarting at 0 in each document); query
            i's is position_ids[:, q_offset + i]; the rotation table must hold max + 1 rows. None: 0..Tk-1.
        mask: the torch path's document_mask(document_ids, Tq, q_offset, causal=causal), built once and shared
            by every layer; None builds it here from document_ids. The Triton backend reads document_ids only.
        ids_checked: True where the caller has checked the ids (GPT.forward, once per forward): that document_ids
            never decrease and that position_ids lie in the table (check_positions); skips both tests, which read
            the ids (a host sync per call on a GPU, in eager mode; under torch.compile they never run).

    Returns:
        (B, H, Tq, dv) in v's dtype (in the autocast dtype under autocast, for both backends),
        differentiable in q, k, v and delta.

    Raises:
        ValueError on shape, magnitude, q_offset or backend errors, for a negative position or one past the
        rotation table (check_positions; eager mode), and for backend='triton' on cases the kernel does not
        support (see pope_attention_triton).
    """
    rope_theta = _rope_theta(rope_theta, theta)
    _check(q, k, v, delta, q_offset, magnitude, document_ids, position_ids, order=not ids_checked)
    if not ids_checked:
        n_rows = rotation.shape[0] if rotation is not None else max(q_offset + q.shape[2], k.shape[2])
        check_positions(position_ids, n_rows)
    documents = document_ids is not None or position_ids is not None
    backend = pope_backend(q, k, v, backend)
    if backend == "triton":
        return pope_attention_triton(
            q,
            k,
            v,
            delta,
            causal=causal,
            rope_theta=rope_theta,
            sm_scale=sm_scale,
            q_offset=q_offset,
            magnitude=magnitude,
            rotation=rotation,
            **(dict(document_ids=document_ids, position_ids=position_ids, ids_checked=True) if documents else {}),
        )
    if backend != "torch":
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    d, dv, Tq, Tk = q.shape[-1], v.shape[-1], q.shape[-2], k.shape[-2]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    rotation = _rotation_rows(rotation, max(q_offset + Tq, Tk), d, rope_theta, q.device)
    dtype = compute_dtype(q, v)
    rows_q, rows_k = _position_rows(rotation, position_ids, q_offset, Tq, Tk)
    qc = pope_cartesian(q, rows_q, None, magnitude, 1.0, dtype)
    kc = pope_cartesian(k, rows_k, delta, magnitude, 1.0, dtype)
    if mask is None and document_ids is not None:
        mask = document_mask(document_ids, Tq, q_offset, causal=causal)
    if mask is not None and not isinstance(mask, torch.Tensor):  # a BlockMask: flex takes v of width d
        return masked_attention(qc, kc, v.to(dtype), mask, sm_scale=sm_scale)
    v_pad = F.pad(v.to(dtype), (0, 2 * d - dv)) if dv < 2 * d else v.to(dtype)
    return sdpa_attention(qc, kc, v_pad, causal=causal, sm_scale=sm_scale, q_offset=q_offset, mask=mask)[..., :dv]


def pope_attention_decode(
    q,
    mu_k,
    v,
    delta=None,
    *,
    rotation=None,
    causal=True,
    rope_theta=10000.0,
    sm_scale=None,
    q_offset=0,
    magnitude="softplus",
    backend="auto",
    n_split=0,
):
    """PoPE attention of raw queries over cached key magnitudes (decoding with a KV cache).

    Args:
        q: (B, H, Tq, d) raw queries at absolute positions q_offset..q_offset+Tq-1.
        mu_k: (B, H_kv, Tk, d) key magnitudes (pope_key_magnitude) at positions 0..Tk-1; a slice of the cache.
        v: (B, H_kv, Tk, dv) values.
        delta: (H_kv, d) radians or None; it goes into the queries (pope_query_decode_form).
        rotation: (>= max(Tk, q_offset + Tq), 2d) float32 pope_rotation_table, or None to build one for this call.
        n_split: Triton only: cache splits (0: pope_kernel.decode_splits).
        Others as pope_attention.
    Returns:
        (B, H, Tq, dv) in the compute dtype (compute_dtype(q, v)); equal to pope_attention on the raw keys.
    The torch backend rotates the cached magnitudes into [mu cos s theta, mu sin s theta] (one product with
    the table) and attends through two matmuls for one new token, else SDPA (v padded to 2d). The Triton
    backend runs pope_kernel.decode (rotation in registers, grouped heads, split cache) when
    G * Tq <= pope_kernel.DECODE_MAX_ROWS, else the prefill kernel on keys rotated in torch.
    Raises:
        ValueError on shapes, magnitude, q_offset, backend, or cases the Triton backend does not take.
    """
    B, H, Tq, d = q.shape
    _check(q, mu_k, v, delta, q_offset, magnitude)
    H_kv, Tk, dv = mu_k.shape[1], mu_k.shape[2], v.shape[-1]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    rotation = _rotation_rows(rotation, max(Tk, q_offset + Tq), d, rope_theta, q.device)
    dtype = compute_dtype(q, v)
    backend = pope_backend(q, mu_k, v, backend)
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    mu_k, v = mu_k.to(dtype), v.to(dtype)
    if backend == "triton":
        _triton_ready(q, mu_k, v)
        qd = pope_query_decode_form(q, q_offset, delta, rope_theta, magnitude, dtype, sm_scale * LOG2E, rotation)
        if (H // H_kv) * Tq <= pope_kernel.DECODE_MAX_ROWS:
            return pope_kernel.decode(qd, mu_k, v, rotation, causal=causal, q_offset=q_offset, n_split=n_split)[0]
        return pope_kernel.attention(qd, _rotate_keys(mu_k, rotation), v, causal=causal, q_offset=q_offset)[0]
    qd = pope_query_decode_form(q, q_offset, delta, rope_theta, magnitude, dtype, rotation=rotation)
    if Tq == 1 and (not causal or q_offset >= Tk - 1):  # one new token that sees every cached key
        qd, chunk = qd.view(B, H_kv, H // H_kv, 2 * d), _decode_chunk(mu_k)
        scores = torch.cat(
            [
                _rotated_scores(qd, mu_k[:, :, a : a + chunk], rotation[a : min(a + chunk, Tk)])
                for a in range(0, Tk, chunk)
            ],
            dim=-1,
        )
        return (torch.softmax(scores.float() * sm_scale, dim=-1).to(v.dtype) @ v).view(B, H, 1, dv)
    v = F.pad(v, (0, 2 * d - dv)) if dv < 2 * d else v  # one width for q/k and v: SDPA's fused O(T) kernels
    return sdpa_attention(qd, _rotate_keys(mu_k, rotation), v, causal=causal, sm_scale=sm_scale, q_offset=q_offset)[
        ..., :dv
    ]


def pope_decode_step(
    q, mu_all, v_all, delta, rotation, at, seen, *, sm_scale=None, magnitude="softplus", backend="torch"
):
    """PoPE attention of one raw query per row at position `at` over a whole static cache: the step that
    GPT.decode_step compiles (torch ops only: no host sync, no Python int of the position).

    Args:
        q: (B, H, 1, d) raw queries. mu_all: (B, H_kv, L, d) key magnitudes (pope_key_magnitude) of the whole
            preallocated cache, positions 0..L-1. v_all: (B, H_kv, L, dv). delta: (H_kv, d) radians or None (it
            rides on the query, as in pope_attention_decode). rotation: (>= L, 2d) pope_rotation_table.
        at: (1,) int64 tensor, the query's position. seen: (L,) bool, the cached keys the query sees (the others
            get no weight; the Triton kernel masks the keys past `at` itself). sm_scale: default 1/sqrt(d).
            magnitude: as pope_attention. backend: 'torch', or 'triton' (pope_kernel.decode_at; the caller has
            checked the tensors once with decode_step_backend).
    Returns:
        (B, H_kv, G, dv) in v_all's dtype, G = H / H_kv: query head h_kv * G + g at [:, h_kv, g].
    'torch': the scores of pope_attention_decode's torch path (rotated magnitudes, two matmuls), over all L keys;
    'triton': pope_kernel.decode_at, the decode kernel over the whole cache with the position read on the device.
    """
    B, H, _, d = q.shape
    H_kv, L = mu_all.shape[1], mu_all.shape[2]
    _check_step_table(rotation, L, d)
    G = H // H_kv
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    neg = None if delta is None else -delta.repeat_interleave(G, dim=0)
    rows = rotation.index_select(0, at)
    if backend == "triton":  # pope_kernel.decode_at: keys rotated in registers, the position read on the device
        qd = pope_cartesian(q, rows, neg, magnitude, sm_scale * LOG2E, mu_all.dtype)
        o = pope_kernel.decode_at(qd, mu_all, v_all, rotation, at, 0)[0]  # (B, H, 1, dv)
        return o.view(B, H_kv, G, -1)
    qd = pope_cartesian(q, rows, neg, magnitude, 1.0, mu_all.dtype)  # (B, H, 1, 2d)
    scores = _rotated_scores(qd.view(B, H_kv, G, 2 * d), mu_all, rotation[:L]).float() * sm_scale
    scores = scores.masked_fill(~seen, float("-inf"))
    return torch.softmax(scores, dim=-1).to(v_all.dtype) @ v_all


def _check_step_table(rotation, L, d):
    """pope_decode_step's table: float32 (pope_rotation_table; the decode kernel reads float32 only, and a 16-bit
    table rounds cos/sin to 8 or 11 bits) with >= L rows of width 2d. Checked on shapes and dtype only: no sync,
    nothing a compiled step keeps. Raises ValueError saying which."""
    if rotation.dtype != torch.float32 or rotation.dim() != 2 or rotation.shape[0] < L or rotation.shape[1] != 2 * d:
        raise ValueError(
            f"the decoding step needs a float32 rotation table (pope_rotation_table) of >= {L} rows (the cache's "
            f"positions) and width {2 * d}, got {tuple(rotation.shape)} {rotation.dtype}; keep GPT.rotation float32 "
            "(GPT casts keep it) and grow it with GPT.ensure_positions"
        )


def decode_step_backend(q, mu_all, v_all, backend="auto"):
    """The backend pope_decode_step runs for these tensors, checked once (GPT.compiled_decode_step asks when it
    builds the step): 'triton' where pope_attention_decode would run pope_kernel.decode (pope_backend; the group
    G = H / H_kv within DECODE_MAX_ROWS), else 'torch'. Raises ValueError as pope_attention_decode for a
    backend='triton' the kernel does not take, and for a cache past the kernel's limits (check_limits)."""
    backend = pope_backend(q, mu_all, v_all, backend)
    if backend == "triton":
        _triton_ready(q, mu_all, v_all)
        if q.shape[1] // mu_all.shape[1] > pope_kernel.DECODE_MAX_ROWS:
            return "torch"
        L = mu_all.shape[2]  # every position the step can be asked for: 0..L-1
        pope_kernel.check_limits(q.shape[0], q.shape[1], 1, L, L - 1, (mu_all.stride(2), v_all.stride(2)))
    return backend


def _decode_chunk(mu_k):
    """Keys per chunk of the torch path's single-token step: about 2^18 rotated numbers per half (1 MB in fp32),
    so the rotated keys of a chunk stay in the CPU's cache between their product and their matmul."""
    B, H_kv, _, d = mu_k.shape
    return max(256, 1 << ((1 << 18) // max(B * H_kv * d, 1)).bit_length() - 1)


def _rotated_scores(qd, mu_k, rotation):
    """(B, H_kv, G, 2d) query forms and (B, H_kv, n, d) magnitudes with their table rows (n, 2d) -> (B, H_kv, G, n)
    dot products with the rotated keys: qx . (mu cos s theta) + qy . (mu sin s theta), without concatenating."""
    d = mu_k.shape[-1]
    mu = mu_k if mu_k.dtype == torch.float32 else mu_k.float()  # 16-bit caches: rotate in float32, then round
    kx, ky = ((mu * rotation[:, :d]).to(qd.dtype), (mu * rotation[:, d:]).to(qd.dtype))
    return qd[..., :d] @ kx.transpose(-1, -2) + qd[..., d:] @ ky.transpose(-1, -2)


def _rotate_keys(mu_k, rotation):
    """(B, H_kv, Tk, d) magnitudes -> (B, H_kv, Tk, 2d) [mu cos(s theta), mu sin(s theta)] in mu_k's dtype: one
    broadcast product with the table's first Tk rows (float32 under a 16-bit mu_k, then rounded)."""
    Tk, d = mu_k.shape[-2], mu_k.shape[-1]
    rot = rotation[:Tk].view(Tk, 2, d)
    if mu_k.dtype != torch.float32:
        return (mu_k.unsqueeze(-2).float() * rot).flatten(-2).to(mu_k.dtype)
    return (mu_k.unsqueeze(-2) * rot).flatten(-2)


def pope_backend(q, k, v, backend="auto"):
    """The backend pope_attention runs for these tensors: 'triton' or 'torch' ('auto' resolved).

    'auto' picks the Triton kernel for CUDA tensors whose compute dtype (v's dtype, or the autocast dtype)
    is fp16 or bf16, that the kernel supports (triton_supported), on a GPU of compute capability >= 8.0
    (below, V100 / T4, Triton's tl.dot compiles to FMA loops, no tensor cores) whose shared memory fits
    its tiles (pope_kernel.device_unsupported_reason); each query names q's device. fp32 goes to the torch
    path. Other values are returned as given (pope_attention checks them).
    """
    if backend != "auto":
        return backend
    dtype = compute_dtype(q, v)
    use = (
        q.is_cuda
        and triton_supported(q, k, v)
        and dtype != torch.float32
        and _tensor_core_dot(q.device)
        and pope_kernel.device_unsupported_reason(q.device, dtype, 2 * q.shape[-1], v.shape[-1]) is None
    )
    return "triton" if use else "torch"


@torch.compiler.assume_constant_result  # under torch.compile: evaluated once while tracing, a constant
def _tensor_core_dot(device):
    """True if CUDA `device` (that device, not the current one) has compute capability >= 8.0."""
    return torch.cuda.get_device_capability(device) >= TENSOR_CORE_CAPABILITY


def triton_unsupported_reason(q, k, v):
    """None if the Triton backend handles these raw (B, H, T, d) tensors, else a sentence saying why not.

    Supported: pope_kernel (triton) importable; d and dv in TRITON_HEAD_DIMS = (16, 32, 64, 128); compute
    dtype float16, bfloat16 or float32; Tk >= 1. The device is not checked.
    """
    if pope_kernel is None:
        return f"triton is not importable ({_KERNEL_IMPORT_ERROR!r}); use backend='torch'"
    d, dv = q.shape[-1], v.shape[-1]
    if d not in TRITON_HEAD_DIMS or dv not in TRITON_HEAD_DIMS:
        return (
            f"the Triton PoPE kernel supports head dims {TRITON_HEAD_DIMS} for q/k and v, got d={d}, dv={dv}; "
            "use backend='torch' for other head dims"
        )
    if compute_dtype(q, v) not in pope_kernel.DTYPES:
        return (
            f"the Triton PoPE kernel supports float16, bfloat16 and float32, got {compute_dtype(q, v)}; "
            "use backend='torch'"
        )
    if k.shape[-2] < 1:
        return "the Triton PoPE kernel needs at least one key (Tk >= 1)"
    return None


def triton_supported(q, k, v):
    """True if backend='triton' accepts these tensors' shapes and dtype (triton_unsupported_reason); the
    device check (CUDA, or CPU under TRITON_INTERPRET=1) is separate."""
    return triton_unsupported_reason(q, k, v) is None


def _triton_ready(q, k, v):
    reason = triton_unsupported_reason(q, k, v)
    if reason is not None:
        raise ValueError(reason)
    if not q.is_cuda and not pope_kernel.INTERPRETING:
        raise ValueError(
            f"backend='triton' needs CUDA tensors, got device {q.device}. Use backend='auto' or "
            "'torch' on CPU, or set TRITON_INTERPRET=1 before importing pope / pope_kernel to run "
            "the kernel in the (slow) Triton interpreter, e.g. for tests"
        )
    if q.is_cuda:
        reason = pope_kernel.device_unsupported_reason(q.device, compute_dtype(q, v), 2 * q.shape[-1], v.shape[-1])
        if reason is not None:
            raise ValueError(reason)


# ---- the Triton backend: the transform in PyTorch (fused by torch.compile), recomputed for the backward ------
# The Cartesian q~, k~ are pointwise functions of the raw q, k (rows of the rotation table, softplus, delta by
# angle addition): _triton_region forms them and calls pope_kernel's attention op. Under torch.compile Inductor
# fuses each side into one generated kernel and the chain rule (pope._Cartesian's: dx in one pointwise pass, delta's
# gradient one reduction over batch and positions: deterministic, no atomics) into the backward's; the only eager
# work around the kernels is their outputs' allocation inside pope_kernel's ops (6 aten ops per call, forward and
# backward: bench.py --only=ops).
# A selective checkpoint keeps q~, k~ out of what the forward saves: every op of the region is recomputed in the
# backward except the attention op, whose o and lse are kept. Without it autograd (eager) or the min-cut
# partitioner (compiled; docs/kernel.md) would save q~, k~: two (B, H, T, 2d) tensors per layer.


class _QuietCheckpointNote(logging.Filter):
    """Drops Dynamo's one-time note that a checkpoint with context_fn must hold no in-place op (this one holds none)."""

    def filter(self, record):
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


logging.getLogger("torch._higher_order_ops.wrap").addFilter(_QuietCheckpointNote())


def _recompute_all_but_attention():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    # the kernel's o and lse, and cos/sin of delta (H_kv * d numbers): saved, they are buffers that the fused
    # kernels read, where Inductor would otherwise inline the trigonometry into every element of k~ and its gradient
    save = (torch.ops.pope.attention_forward.default, torch.ops.aten.cos.default, torch.ops.aten.sin.default)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.MUST_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _triton_region(q, k, v, delta, rows_q, rows_k, causal, q_offset, magnitude, scale, dtype, docs=None, pos=None):
    if pos is not None:  # position_ids (B, Tk): each token's table row, (B, 1, T, 2d), recomputed in the backward
        rows_q = rows_q[pos[:, q_offset : q_offset + q.shape[2]]].unsqueeze(1)
        rows_k = rows_k[pos].unsqueeze(1)
    qc = pope_cartesian(q, rows_q, None, magnitude, scale, dtype)
    kc = pope_cartesian(k, rows_k, delta, magnitude, 1.0, dtype)
    extra = () if docs is None else (docs,)  # without documents: today's call, argument for argument
    return pope_kernel.attention_forward(qc, kc, v.to(dtype), causal, q_offset, *extra)[0]


def _triton_documents(q, k, q_offset, document_ids, position_ids):
    """document_ids and position_ids checked for the Triton path -> the kernels' document table
    (pope_kernel.document_bounds) or None. Raises ValueError in one line for a wrong shape, dtype or device."""
    if position_ids is not None:
        B, Tk = q.shape[0], k.shape[2]
        if not isinstance(position_ids, torch.Tensor) or position_ids.shape != (B, Tk):
            raise ValueError(f"position_ids must be (B, Tk) = ({B}, {Tk}) int64 positions, one per key")
        if position_ids.dtype != torch.int64 or position_ids.device != q.device:
            raise ValueError(
                f"position_ids must be int64 on q's device {q.device}, "
                f"got {position_ids.dtype} on {position_ids.device}"
            )
    if document_ids is None:
        return None
    reason = pope_kernel.document_ids_reason(document_ids, q, k, q_offset)
    if reason is not None:
        raise ValueError(reason)
    return pope_kernel.document_bounds(document_ids)


def pope_attention_triton(
    q,
    k,
    v,
    delta=None,
    *,
    causal=True,
    rope_theta=10000.0,
    sm_scale=None,
    q_offset=0,
    magnitude="softplus",
    rotation=None,
    theta=None,
    document_ids=None,
    position_ids=None,
    ids_checked=False,
):
    """PoPE attention through pope_kernel's FlashAttention-2 kernels (pope_attention(..., backend='triton')).

    Arguments, result and errors as pope_attention. The Cartesian q~ (pre-scaled by sm_scale * log2(e))
    and k~ are formed from the rotation table's rows in float32 (pope_cartesian), then cast to the compute dtype
    (v's dtype, or the autocast dtype); the kernels never see positions or delta. Differentiable in q, k, v
    and delta; the forward saves the raw q, k, v, delta and the kernel's o, lse, and the backward recomputes
    q~, k~ (a selective checkpoint). Supported: d, dv in TRITON_HEAD_DIMS; float16 / bfloat16 / float32
    (backend='auto' sends fp32 to the torch path); any Tq, Tk >= 1; CUDA tensors, or CPU under
    TRITON_INTERPRET=1. Determinism and limits: pope_kernel.attention.

    document_ids: None, or (B, Tk) int32 on q's device, non-decreasing along Tk (pope_attention checks that; here
    a host sync per call would be too dear): query row i has the id document_ids[:, q_offset + i] (so q_offset + Tq
    <= Tk) and sees key s iff the ids are equal and (causal) s <= q_offset + i: block-causal. The kernels skip every
    tile that holds no key of a query tile's documents (docs/kernel.md); the document table they read
    (pope_kernel.document_bounds, 3 int32 per key) is formed once per call, outside the checkpointed region, and
    kept for the backward. position_ids: None (positions 0..Tk-1, query rows from q_offset), or (B, Tk) int64
    positions per key (query row i: position_ids[:, q_offset + i]), each below max(q_offset + Tq, Tk) unless
    `rotation` has more rows (positions that restart at each document always are). Raises ValueError (one line) for
    document_ids or position_ids of the wrong shape, dtype or device, and (unless ids_checked, as pope_attention)
    for a negative position or one past the table (check_positions).
    """
    rope_theta = _rope_theta(rope_theta, theta)
    _check(q, k, v, delta, q_offset, magnitude)
    _triton_ready(q, k, v)
    if not (q.device == k.device == v.device) or (delta is not None and delta.device != q.device):
        raise ValueError("q, k, v and delta must be on the same device")
    Tq, Tk, d = q.shape[2], k.shape[2], q.shape[-1]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    rotation = _rotation_rows(rotation, max(q_offset + Tq, Tk), d, rope_theta, q.device)
    if not ids_checked:
        check_positions(position_ids, rotation.shape[0])
    pope_kernel.check_limits(q.shape[0], q.shape[1], Tq, Tk, q_offset, (v.stride(2),))
    docs = _triton_documents(q, k, q_offset, document_ids, position_ids)
    rows = (rotation[q_offset : q_offset + Tq], rotation[:Tk]) if position_ids is None else (rotation, rotation)
    args = (q, k, v, delta, *rows, bool(causal), int(q_offset), magnitude, sm_scale * LOG2E, compute_dtype(q, v))
    if docs is not None or position_ids is not None:
        args = args + (docs, position_ids)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, delta)):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(
            _triton_region,
            *args,
            use_reentrant=False,
            context_fn=_recompute_all_but_attention,
            preserve_rng_state=False,
            determinism_check="none",
        )
    return _triton_region(*args)


def pope_attention_reference(
    q, k, v, delta=None, *, causal=True, rope_theta=10000.0, sm_scale=None, q_offset=0, magnitude="softplus", theta=None
):
    """Float64 reference of pope_attention straight from the polar score formula, for tests.

    logits[b,h,i,j] = sm_scale * sum_c mu_q[i,c] mu_k[j,c] cos((j - (q_offset+i)) theta_c + delta[h,c]);
    same arguments and shapes as pope_attention (k, v, delta of a key/value head are repeated over its
    query heads), returns float64 (B, H, Tq, dv). theta_c is the float32 table pope_frequencies (the
    model's definition, used by both backends), so the float64 phases are exact for it. Materialises the
    (H, Tq, Tk, d) cosine tensor, so keep it to small shapes.
    """
    rope_theta = _rope_theta(rope_theta, theta)
    _check(q, k, v, delta, q_offset, magnitude)
    (_, H, Tq, d), (H_kv, Tk) = q.shape, k.shape[1:3]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    G = H // H_kv
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    delta = (
        torch.zeros(H, d, dtype=torch.float64, device=q.device)
        if delta is None
        else delta.double().repeat_interleave(G, dim=0)
    )
    freqs = pope_frequencies(d, rope_theta, device=q.device).double()
    mu_q, mu_k = pope_magnitude(q.double(), magnitude), pope_magnitude(k.double(), magnitude)
    rel = (torch.arange(Tk, device=q.device) - (q_offset + torch.arange(Tq, device=q.device)).unsqueeze(1)).double()
    angle = rel[None, :, :, None] * freqs + delta[:, None, None, :]  # (H, Tq, Tk, d) radians
    logits = sm_scale * torch.einsum("bhic,bhjc,hijc->bhij", mu_q, mu_k, torch.cos(angle))
    if causal:
        logits = logits.masked_fill(~causal_mask(Tq, Tk, q_offset, device=q.device), float("-inf"))
    return torch.softmax(logits, dim=-1) @ v.double()
