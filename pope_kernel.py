"""PoPE attention: the one place where Polar Coordinate Position Embedding meets softmax attention.

Paper: Gopalakrishnan, Csordas, Schmidhuber, Mozer, "Decoupling the What and Where with Polar
Coordinate Positional Embedding", ICML 2026, Method section. For head dimension d, every one of
the d channels of a query at position t and a key at position s becomes a complex number

    q~_c = softplus(q_c) * exp(i * t * theta_c)
    k~_c = softplus(k_c) * exp(i * (s * theta_c + delta_c)),   theta_c = base^(-(c-1)/d)

and the attention logit is sm_scale * Re[q~^H k~] = sm_scale * sum_c mu_q mu_k cos((s-t) theta_c + delta_c).
Writing x = mu cos(phi), y = mu sin(phi) turns that into a real dot product over 2d channels, which
is what the PyTorch path below hands to scaled_dot_product_attention. The Triton path (second half of
this file) fuses all of it into one FlashAttention-2 style kernel that never stores the 2d-wide
Cartesian tensors.

Public API
    pope_attention(q, k, v, delta, *, causal, theta, sm_scale, q_offset, magnitude, backend='auto')
        -> (B, H, Tq, dv); backend 'auto' = Triton kernel for CUDA tensors, torch path otherwise
    pope_attention_triton(...)  the fused Triton kernel (torch.library custom op pope::attention_fwd
        with its backward pope::attention_bwd, so torch.compile keeps it in the graph)
    triton_supported(q, k, v), triton_unsupported_reason(q, k, v), TRITON_HEAD_DIMS
    pope_attention_reference(...)  float64 polar-form reference for tests (O(T^2) memory)
    sdpa_attention(q, k, v, *, causal, sm_scale, q_offset)  plain attention with the same
        causal/q_offset convention, used by the RoPE and NoPE paths of model.py
    pope_frequencies(head_dim, theta)  the d frequencies theta_c, in radians per token
"""

import math
import os
import types
from typing import Optional, Tuple

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
    """x (B, H, T, d) raw -> (B, H, T, 2d) [mu cos(phi), mu sin(phi)], phi = pos * freq (+ delta) radians.

    The phase table (T, d) (or (H, T, d) with delta) is formed in float64 and rounded to float32 only
    after cos/sin, so the phase is the exact pos * theta_c of the float32 frequency table (the Triton
    kernel's phases are the same): a float32 product would be off by up to ~4e-3 rad at 1e5 tokens.
    Magnitudes and the products stay float32 even under bf16 autocast.
    """
    with torch.autocast(device_type=x.device.type, enabled=False):
        mu = _magnitude(x.float(), magnitude)
        phase = positions.double().unsqueeze(-1) * freqs.double()  # (T, d), radians, exact
        if delta is not None:
            phase = phase + delta.double().unsqueeze(1)  # (H, T, d)
        cos, sin = torch.cos(phase).float(), torch.sin(phase).float()
        out = torch.cat((mu * cos, mu * sin), dim=-1)
    return out.to(out_dtype)


def pope_attention(q, k, v, delta=None, *, causal=True, theta=10000.0, sm_scale=None, q_offset=0,
                   magnitude="softplus", backend="auto"):
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
        backend: 'auto' (default): the fused Triton kernel when the tensors are on CUDA in fp16/bf16 (or
            under fp16/bf16 autocast), Triton imports and the kernel supports the case (see
            triton_supported), else 'torch' (fp32 included).
            'triton': the fused Triton kernel (pope_attention_triton); on CPU tensors only under
            the Triton interpreter (os.environ['TRITON_INTERPRET'] == '1', slow, for tests).
            'torch': this file's SDPA path.

    Returns:
        (B, H, Tq, dv) in v's dtype (in the autocast dtype under autocast, for both backends).

    The torch path builds the 2d-wide Cartesian q~, k~ and pads v with zeros to 2d so that SDPA can
    use its fused O(T)-memory kernel (SDPA falls back to the O(T^2) math kernel when the q/k and v
    head dims differ). Raises ValueError on shape, magnitude, q_offset or backend errors, and for
    backend='triton' on cases the kernel does not support (see pope_attention_triton).
    """
    _check(q, k, v, delta, q_offset)
    if magnitude not in MAGNITUDES:
        raise ValueError(f"magnitude must be one of {MAGNITUDES}, got {magnitude!r}")
    backend = pope_backend(q, k, v, backend)
    if backend == "triton":
        return pope_attention_triton(q, k, v, delta, causal=causal, theta=theta, sm_scale=sm_scale,
                                     q_offset=q_offset, magnitude=magnitude)
    if backend != "torch":
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
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


def pope_backend(q, k, v, backend="auto"):
    """The backend pope_attention runs for these tensors: 'triton' or 'torch' ('auto' resolved).

    'auto' picks the fused Triton kernel for CUDA tensors whose compute dtype (v's dtype, or the autocast
    dtype) is fp16 or bf16 and that the kernel supports (triton_supported); fp32 goes to the torch path,
    since the kernel's IEEE-fp32 tiles spill. Other values are returned as given (pope_attention checks them).
    """
    if backend != "auto":
        return backend
    use = q.is_cuda and triton_supported(q, k, v) and _compute_dtype(q, v) != torch.float32
    return "triton" if use else "torch"


def pope_attention_reference(q, k, v, delta=None, *, causal=True, theta=10000.0, sm_scale=None,
                             q_offset=0, magnitude="softplus"):
    """Float64 reference of pope_attention straight from the polar score formula, for tests.

    logits[b,h,i,j] = sm_scale * sum_c mu_q[i,c] mu_k[j,c] cos((j - (q_offset+i)) theta_c + delta[h,c]);
    same arguments and shapes as pope_attention, returns float64 (B, H, Tq, dv). theta_c is the float32
    table pope_frequencies (the model's definition, used by both backends), so the float64 phases are
    exact for it. Materialises the (B, H, Tq, Tk, d) cosine tensor, so keep it to small shapes.
    """
    _check(q, k, v, delta, q_offset)
    d, Tq, Tk = q.shape[-1], q.shape[-2], k.shape[-2]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    freqs = pope_frequencies(d, theta, device=q.device).double()
    mu_q = _magnitude(q.double(), magnitude)
    mu_k = _magnitude(k.double(), magnitude)
    rel = (torch.arange(Tk, device=q.device) - (q_offset + torch.arange(Tq, device=q.device)).unsqueeze(1)).double()
    delta = torch.zeros(q.shape[1], d, dtype=torch.float64, device=q.device) if delta is None else delta.double()
    angle = rel[None, :, :, None] * freqs + delta[:, None, None, :]  # (H, Tq, Tk, d) radians
    logits = sm_scale * torch.einsum("bhic,bhjc,hijc->bhij", mu_q, mu_k, torch.cos(angle))
    if causal:
        logits = logits.masked_fill(~causal_mask(Tq, Tk, q_offset, device=q.device), float("-inf"))
    return torch.softmax(logits, dim=-1) @ v.double()


# =============================================================================================
# Triton path: one fused FlashAttention-2 style kernel that never materialises the 2d-wide
# Cartesian q~, k~ in GPU memory.
#
# Per tile, in fp32 registers: mu = magnitude(raw), phase = position * theta_c (+ delta_c for keys),
# X = mu cos(phase), Y = mu sin(phase); then
# S = X_q X_k^T + Y_q Y_k^T as two tl.dot's of width d, with sm_scale * log2(e) folded into X_q, Y_q
# so that the online softmax runs in base 2. V, O and dO keep their own width dv.
#
# Phases (all kernels alike, no sin/cos in-kernel): the host passes cos/sin tables of s * theta_c
# formed in float64 from the float32 frequency table pope_frequencies (fine rows s = 0..143, coarse
# rows every 16 tokens, _trig_tables) and cos/sin(delta) (H, d). A row s = start + j of a tile (start a
# multiple of 16; queries add q_offset % 16 to j) gets cos/sin(start theta_c + (j theta_c [+ delta_c])) by
# angle addition of one coarse (D,) row per tile and a (rows, D) fine table loaded once per program (with
# delta folded in for keys): about two fp32 roundings from the exact phase at any position, so the
# forward and both backward kernels, whatever their tile sizes, and the float64 torch path agree to fp32
# rounding (an fp32 product s * theta_c is off by ~4e-3 rad at 1e5 tokens). softplus = max(x, 0) +
# log1p(exp(-|x|)): one exp2 and one log2 (hardware lg2.approx on CUDA, see _tl_magnitude).
# The cost table below predates the host tables (it counts in-kernel sin/cos per tile, now 2 (D,) loads).
#
# Cost of one forward tile, BLOCK_M x BLOCK_N = 128 x 64, per key element of the BLOCK_N x d tile
# (on paper) and per tile (SASS, sm_90, bf16, 8 warps, unmasked loop body, x 256 threads):
#                          MUFU / key elem   FMA-pipe / key elem   per tile: MUFU | FMA-pipe | instr/thread
#   before, d = 64         4 + FRND          ~12                   25.1k | 83k  | 686
#   after,  d = 64         1 (+ 2d / tile)   ~16                   16.9k | 102k | 698   (polynomial log1p)
#   shipped, d = 64        2 (+ 2d / tile)   ~8                    ~21k  | -    | 602   (hardware lg2)
#   before, d = 128        4 + FRND          ~12                   41.5k | 149k | 1200
#   after,  d = 128        1 (+ 2d / tile)   ~16                   21.0k | 176k | 1152
#   FA (same tile, Triton) softmax only: 128 x 64 exp2 (+ row rescale): 8.7k MUFU; 286 / 344 instr
# (MUFU per tile include the softmax's 8.7k. Triton replicates the per-tile (D,) sin/cos over the 32 (d=64)
# / 16 (d=128) threads that share a column: 4k MUFU per tile instead of 2d.) H100 (MUFU 16/clk/SM,
# 4 x 1 instr issue/clk/SM, 989 TFLOP/s bf16 = 4094 FLOP/clk/SM at 1.83 GHz), per tile, bound = max:
#   d = 64:  FA 572 clk (issue; MUFU 544, MMA 512). PoPE before 1568 (MUFU) = 2.7x FA; after 1396
#            (issue; MUFU 1056, MMA 768) = 2.4x.  d = 128: FA 1024 (MMA); before 2592 = 2.5x; after 2304 = 2.25x.
# The forward is now issue-bound, not MUFU-bound: the key-side transform is redone for every query
# block, so the shipped variant (hardware lg2, ~14% fewer instructions than the polynomial) is ~2.1x
# FA at d = 64 by this count. Reaching ~1.35x needs the key-side transform out of the loop: a pre-pass
# writing bf16 X_k, Y_k once (2x K's bytes), i.e. the Cartesian variant for K only. Estimates only;
# nothing here was timed on a GPU.
#
# Backward (FlashAttention-2): a preprocess kernel computes Di = rowsum(dO * O); one kernel per key
# block accumulates dV, dX_k, dY_k over query blocks and turns them into dK and per-block partial sums
# of d(delta); one kernel per query block accumulates dX_q, dY_q over key blocks and turns them into dQ.
# No atomics: d(delta) partials go to a (B, n_key_blocks, H, d) buffer that torch sums.
#
# Chain rule (per channel c; X = mu cos a, Y = mu sin a):
#   d mu = cos(a) dX + sin(a) dY,   d raw = d mu * magnitude'(raw),
#   d a  = mu (-sin(a) dX + cos(a) dY),   d delta_c = sum over batch and keys of d a_k.
#
# The raw kernel bodies below are plain Python functions; they are wrapped lazily at call time, as
# triton.jit (+ autotune) kernels on CUDA, or as interpreter functions when TRITON_INTERPRET=1 (that
# choice is made per call, so the interpreter works even if triton was imported before the flag was set).
# =============================================================================================

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice as _libdevice
    from triton.runtime.jit import JITFunction as _JITFunction
    _TRITON_IMPORT_ERROR = None
except Exception as _e:  # pragma: no cover - depends on the environment
    triton = None
    _TRITON_IMPORT_ERROR = _e

    class tl:  # minimal stand-in so that the kernel definitions below still parse
        constexpr = None

TRITON_HEAD_DIMS = (16, 32, 64, 128)
TRIG_STEP = 16  # host cos/sin table: coarse rows every 16 tokens ...
TRIG_FINE_ROWS = 128 + TRIG_STEP  # ... after fine rows j = 0..143 (j * theta_c): see _trig_tables
PART_KEYS = 16  # keys per row of the d(delta) partial-sum buffer, for every BLOCK_N (a multiple of it)
MAX_POSITION = 2 ** 31 - 1  # int32 positions (q_offset + Tq, Tk) in the kernels
if triton is not None:
    _TRIG_FINE = tl.constexpr(TRIG_FINE_ROWS)
    _TRIG_STEP = tl.constexpr(TRIG_STEP)
    _PART_KEYS = tl.constexpr(PART_KEYS)
_MAG_CODE = {"softplus": 0, "relu": 1, "identity": 2}
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---- device helpers (inlined into the kernels) ---------------------------------------------------

def _tl_magnitude(x, MAG: tl.constexpr, FAST: tl.constexpr):
    """mu = magnitude(x) for an fp32 tile; softplus in the stable form max(x, 0) + log1p(exp(-|x|)).

    One exp2 and one log2 per element. FAST (CUDA) takes the hardware lg2.approx (absolute error
    ~1e-7 on (1, 2]); below e = 1e-4 the series e - e^2/2 keeps the relative accuracy for x << 0.
    A degree-6 polynomial log1p (FMAs only) was tried: the kernel is instruction-issue bound once
    the phases use angle addition, and the polynomial compiled to ~8% more instructions per tile.
    """
    if MAG == 0:
        e = tl.exp2(tl.abs(x) * -1.4426950408889634)  # exp(-|x|) in (0, 1]
        if FAST:
            l2 = _libdevice.fast_log2f(1.0 + e)
        else:
            l2 = tl.log2(1.0 + e)
        mu = tl.maximum(x, 0.0) + tl.where(e < 1e-4, e - 0.5 * e * e, l2 * 0.6931471805599453)
    elif MAG == 1:
        mu = tl.maximum(x, 0.0)
    else:
        mu = x
    return mu


def _tl_magnitude_grad(x, MAG: tl.constexpr):
    """d magnitude / dx for an fp32 tile: sigmoid(x) (stable), 1[x > 0], or 1."""
    if MAG == 0:
        e = tl.exp2(-tl.abs(x) * 1.4426950408889634)
        r = 1.0 / (1.0 + e)
        g = tl.where(x >= 0, r, e * r)
    elif MAG == 1:
        g = tl.where(x > 0, 1.0, 0.0)
    else:
        g = tl.full(x.shape, 1.0, tl.float32)
    return g


def _tl_rotate(cos_a, sin_a, tab_c, tab_s):
    """cos and sin of a[None, :] + b for a (D,) angle given by cos_a, sin_a and a (ROWS, D) table
    tab_c, tab_s = cos b, sin b: angle addition, one mul + one fma per output element."""
    ca = cos_a[None, :]
    sa = sin_a[None, :]
    return ca * tab_c - sa * tab_s, sa * tab_c + ca * tab_s


def _tl_table(COS_T, SIN_T, r0, ROWS: tl.constexpr, offs_d, D: tl.constexpr):
    """(ROWS, D) cos and sin of (r0 + j) * theta_c, j = 0..ROWS-1: fine rows of the host table (r0 < 16)."""
    rows = r0 + tl.arange(0, ROWS)
    return (tl.load(COS_T + rows[:, None] * D + offs_d[None, :]),
            tl.load(SIN_T + rows[:, None] * D + offs_d[None, :]))


def _tl_coarse(COS_T, SIN_T, pos0, offs_d, D: tl.constexpr):
    """(D,) cos and sin of pos0 * theta_c for a position pos0 that is a multiple of 16 (tokens): one coarse row."""
    row = tl.cast(pos0 // _TRIG_STEP + _TRIG_FINE, tl.int64) * D
    return tl.load(COS_T + row + offs_d), tl.load(SIN_T + row + offs_d)


def _tl_delta_table(DCS, COS_T, SIN_T, H, h, ROWS: tl.constexpr, offs_d, D: tl.constexpr, HAS_DELTA: tl.constexpr):
    """(ROWS, D) cos and sin of j * theta_c + delta_c, j = 0..ROWS-1: the per-program table of a key tile
    (delta from the host's (2, H, D) cos/sin table DCS, applied once by angle addition)."""
    tab_c, tab_s = _tl_table(COS_T, SIN_T, 0, ROWS, offs_d, D)
    if HAS_DELTA:
        cd = tl.load(DCS + h * D + offs_d)
        sd = tl.load(DCS + (H + h) * D + offs_d)
        tab_c, tab_s = _tl_rotate(cd, sd, tab_c, tab_s)
    return tab_c, tab_s


def _tl_key_range(Tk, q_offset, m0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Key blocks a query block starting at row m0 visits: [0, n_full) need no mask, [n_full, hi) need
    the causal and/or key-boundary mask, and key blocks past hi are fully masked and skipped."""
    if CAUSAL:
        hi = tl.minimum(Tk, q_offset + m0 + BLOCK_M)
        n_full = tl.minimum((q_offset + m0 + 1) // BLOCK_N, Tk // BLOCK_N) * BLOCK_N
    else:
        hi = Tk
        n_full = (Tk // BLOCK_N) * BLOCK_N
    return n_full, hi


def _tl_key_tile(k_base, v_base, start_n, offs_j, offs_d, offs_dv, stride_kn, stride_vn, Tk, COS_T, SIN_T,
                 tab_c, tab_s, MASKED: tl.constexpr, MAG: tl.constexpr, FAST: tl.constexpr, DT: tl.constexpr,
                 D: tl.constexpr):
    """Load the key/value tile of rows s = start_n + j (j = offs_j) and return (X_k, Y_k, V) in DT: the keys'
    magnitude times cos/sin of s theta_c + delta_c, by angle addition of the tile's coarse row
    (start_n theta_c) and the per-program table cos/sin(j theta_c + delta_c). Row offsets: int64 tile base +
    int32 in-tile."""
    start = tl.cast(start_n, tl.int64)
    k_ptrs = (k_base + start * stride_kn) + (offs_j[:, None] * stride_kn + offs_d[None, :])
    v_ptrs = (v_base + start * stride_vn) + (offs_j[:, None] * stride_vn + offs_dv[None, :])
    if MASKED:
        col_ok = (start_n + offs_j) < Tk
        k = tl.load(k_ptrs, mask=col_ok[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=col_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    mu_k = _tl_magnitude(k.to(tl.float32), MAG, FAST)
    ca, sa = _tl_coarse(COS_T, SIN_T, start_n, offs_d, D)
    ck, sk = _tl_rotate(ca, sa, tab_c, tab_s)
    return (mu_k * ck).to(DT), (mu_k * sk).to(DT), v


def _tl_sum(x, AXIS: tl.constexpr):
    """tl.sum without going through triton.language.standard's jit wrapper (see _tl_rowmax)."""
    return tl.reduce(x, AXIS, tl.standard._sum_combine)


def _tl_rowmax(x):
    """Max over axis 1. tl.max, tl.sum and tl.zeros are @jit functions, built as compiler or interpreter
    functions when triton is imported, so an interpreter launch after a non-interpreter import cannot
    call them. tl.reduce is a builtin, and the interpreter maps these two combine functions to numpy."""
    return tl.reduce(x, 1, tl.standard._elementwise_max)


def _tl_split_pid(n_blocks, H):
    """The 1-D grid's program id -> (block index, b, h, b * H + h). Blocks of one head are adjacent, so they
    share its K/V in L2; a 1-D grid has room for 2^31 - 1 programs (CUDA's axis 1 only for 65,535)."""
    pid = tl.program_id(0)
    pid_bh = pid // n_blocks
    return pid % n_blocks, (pid_bh // H).to(tl.int64), (pid_bh % H).to(tl.int64), pid_bh


# ---- forward ------------------------------------------------------------------------------------

def _pope_fwd_kernel(
    Q, K, V, DCS, COS_T, SIN_T, O, LSE,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    H, Tq, Tk, q_offset, qk_scale,
    TQ_BUCKET, TK_BUCKET,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, MAG: tl.constexpr, HAS_DELTA: tl.constexpr, DOT_PREC: tl.constexpr,
    FAST: tl.constexpr,
):
    pid_m, b, h, pid_bh = _tl_split_pid((Tq + BLOCK_M - 1) // BLOCK_M, H)
    DT = Q.dtype.element_ty
    m0 = pid_m * BLOCK_M
    q_base = Q + b * stride_qb + h * stride_qh + m0.to(tl.int64) * stride_qm
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh

    offs_i = tl.arange(0, BLOCK_M)
    offs_m = m0 + offs_i
    offs_j = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)

    # query tile -> scaled Cartesian components, kept in registers for the whole loop
    row_ok = offs_m < Tq
    q = tl.load(q_base + offs_i[:, None] * stride_qm + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    mu_q = _tl_magnitude(q.to(tl.float32), MAG, FAST)
    # query phase (m0 + q_offset + i) theta_c = coarse row of m0 + q_offset - r, plus fine row r + i, r = q_offset % 16
    r = q_offset % _TRIG_STEP
    qc, qs = _tl_coarse(COS_T, SIN_T, m0 + q_offset - r, offs_d, D)
    tq_c, tq_s = _tl_table(COS_T, SIN_T, r, BLOCK_M, offs_d, D)
    cq, sq = _tl_rotate(qc, qs, tq_c, tq_s)
    xq = (mu_q * cq * qk_scale).to(DT)
    yq = (mu_q * sq * qk_scale).to(DT)
    # cos, sin of j * theta_c + delta_c for the rows j = 0..BLOCK_N-1 of a key tile, once per program; the key
    # at s = start_n + j then has phase start_n theta_c + (j theta_c + delta_c) (angle addition)
    tab_c, tab_s = _tl_delta_table(DCS, COS_T, SIN_T, H, h, BLOCK_N, offs_d, D, HAS_DELTA)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, DV], 0.0, tl.float32)

    n_full, hi = _tl_key_range(Tk, q_offset, m0, BLOCK_M, BLOCK_N, CAUSAL)
    for phase in tl.static_range(2):
        if phase == 0:
            lo_n = 0
            hi_n = n_full
        else:
            lo_n = n_full
            hi_n = hi
        for start_n in range(lo_n, hi_n, BLOCK_N):
            xk, yk, v = _tl_key_tile(k_base, v_base, start_n, offs_j, offs_d, offs_dv, stride_kn, stride_vn, Tk,
                                     COS_T, SIN_T, tab_c, tab_s, phase == 1, MAG, FAST, DT, D)
            s = tl.dot(xq, tl.trans(xk), input_precision=DOT_PREC)
            s = tl.dot(yq, tl.trans(yk), s, input_precision=DOT_PREC)  # logits * log2(e)
            if phase == 1:
                offs_n = start_n + offs_j
                ok = offs_n[None, :] < Tk
                if CAUSAL:
                    ok = ok & (offs_n[None, :] <= (offs_m + q_offset)[:, None])
                s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, _tl_rowmax(s))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + _tl_sum(p, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(DT), v, acc, input_precision=DOT_PREC)
            m_i = m_new

    out = acc / l_i[:, None]
    o_base = O + b * stride_ob + h * stride_oh + m0.to(tl.int64) * stride_om
    tl.store(o_base + offs_i[:, None] * stride_om + offs_dv[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None])
    lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # nats
    tl.store(LSE + pid_bh.to(tl.int64) * Tq + offs_m, lse, mask=row_ok)


# ---- backward -----------------------------------------------------------------------------------

def _pope_bwd_pre_kernel(
    O, DO, DI,
    stride_ob, stride_oh, stride_om,
    stride_dob, stride_doh, stride_dom,
    H, Tq,
    DV: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid_m, b, h, pid_bh = _tl_split_pid((Tq + BLOCK_M - 1) // BLOCK_M, H)
    m0 = pid_m * BLOCK_M
    offs_i = tl.arange(0, BLOCK_M)
    offs_m = m0 + offs_i
    offs_dv = tl.arange(0, DV)
    row_ok = offs_m < Tq
    o = tl.load(O + b * stride_ob + h * stride_oh + m0.to(tl.int64) * stride_om + offs_i[:, None] * stride_om
                + offs_dv[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + b * stride_dob + h * stride_doh + m0.to(tl.int64) * stride_dom + offs_i[:, None] * stride_dom
                 + offs_dv[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    tl.store(DI + pid_bh.to(tl.int64) * Tq + offs_m, _tl_sum(o * do, 1), mask=row_ok)


def _pope_bwd_dkdv_kernel(
    Q, K, V, DCS, COS_T, SIN_T, DO, LSE, DI, DK, DV_, DDELTA_PART,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    H, Tq, Tk, q_offset, qk_scale, n_part_rows, remat_zero,
    TQ_BUCKET, TK_BUCKET,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, MAG: tl.constexpr, HAS_DELTA: tl.constexpr, DOT_PREC: tl.constexpr,
    FAST: tl.constexpr,
):
    pid_n, b, h, pid_bh = _tl_split_pid((Tk + BLOCK_N - 1) // BLOCK_N, H)
    DT = Q.dtype.element_ty
    q_base = Q + b * stride_qb + h * stride_qh
    do_base = DO + b * stride_dob + h * stride_doh
    row_base = pid_bh.to(tl.int64) * Tq

    n0 = pid_n * BLOCK_N
    offs_j = tl.arange(0, BLOCK_N)
    offs_n = n0 + offs_j
    offs_i = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    col_ok = offs_n < Tk

    k_ptrs = K + b * stride_kb + h * stride_kh + n0.to(tl.int64) * stride_kn + offs_j[:, None] * stride_kn + offs_d[None, :]
    k = tl.load(k_ptrs, mask=col_ok[:, None], other=0.0).to(tl.float32)
    v = tl.load(V + b * stride_vb + h * stride_vh + n0.to(tl.int64) * stride_vn + offs_j[:, None] * stride_vn
                + offs_dv[None, :], mask=col_ok[:, None], other=0.0)
    mu_k = _tl_magnitude(k, MAG, FAST)
    kc, ks = _tl_coarse(COS_T, SIN_T, n0, offs_d, D)
    tk_c, tk_s = _tl_delta_table(DCS, COS_T, SIN_T, H, h, BLOCK_N, offs_d, D, HAS_DELTA)
    ck, sk = _tl_rotate(kc, ks, tk_c, tk_s)
    xk = (mu_k * ck).to(DT)
    yk = (mu_k * sk).to(DT)

    # cos, sin of (r + i) * theta_c, r = q_offset % 16, for the rows i of a query tile: a query at
    # start_m + q_offset + i has phase (start_m + q_offset - r) theta_c (one coarse row) + (r + i) theta_c
    r = q_offset % _TRIG_STEP
    tab_c, tab_s = _tl_table(COS_T, SIN_T, r, BLOCK_M, offs_d, D)

    dxk = tl.full([BLOCK_N, D], 0.0, tl.float32)
    dyk = tl.full([BLOCK_N, D], 0.0, tl.float32)
    dv = tl.full([BLOCK_N, DV], 0.0, tl.float32)

    # query blocks: [lo, mid) straddle the causal diagonal (masked), [mid, full_hi) are unmasked,
    # [max(mid, full_hi), Tq) hold the query boundary (masked). Queries i < lo see none of these keys.
    if CAUSAL:
        lo = (tl.maximum(n0 - q_offset, 0) // BLOCK_M) * BLOCK_M
        mid = ((tl.maximum(n0 + BLOCK_N - 1 - q_offset, 0) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    else:
        lo = 0
        mid = 0
    full_hi = (Tq // BLOCK_M) * BLOCK_M
    for phase in tl.static_range(3):
        if phase == 0:
            lo_m = lo
            hi_m = tl.minimum(mid, Tq)
        elif phase == 1:
            lo_m = mid
            hi_m = full_hi
        else:
            lo_m = tl.maximum(mid, full_hi)
            hi_m = Tq
        for start_m in range(lo_m, hi_m, BLOCK_M):
            offs_m = start_m + offs_i
            q_ptrs = (q_base + tl.cast(start_m, tl.int64) * stride_qm) + (offs_i[:, None] * stride_qm + offs_d[None, :])
            do_ptrs = (do_base + tl.cast(start_m, tl.int64) * stride_dom) + (offs_i[:, None] * stride_dom
                                                                            + offs_dv[None, :])
            if phase == 1:
                q = tl.load(q_ptrs)
                do = tl.load(do_ptrs)
                lse = tl.load(LSE + row_base + offs_m)
                di = tl.load(DI + row_base + offs_m)
            else:
                row_ok = offs_m < Tq
                q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
                do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
                lse = tl.load(LSE + row_base + offs_m, mask=row_ok, other=float("inf"))
                di = tl.load(DI + row_base + offs_m, mask=row_ok, other=0.0)
            mu_q = _tl_magnitude(q.to(tl.float32), MAG, FAST)
            ca, sa = _tl_coarse(COS_T, SIN_T, start_m + q_offset - r, offs_d, D)  # (D,)
            cq, sq = _tl_rotate(ca, sa, tab_c, tab_s)
            xq = (mu_q * cq * qk_scale).to(DT)
            yq = (mu_q * sq * qk_scale).to(DT)
            s_t = tl.dot(xk, tl.trans(xq), input_precision=DOT_PREC)
            s_t = tl.dot(yk, tl.trans(yq), s_t, input_precision=DOT_PREC)  # (BLOCK_N, BLOCK_M), base 2
            p_t = tl.exp2(s_t - lse[None, :] * 1.4426950408889634)
            if phase != 1:
                ok = offs_m[None, :] < Tq
                if CAUSAL:
                    ok = ok & (offs_n[:, None] <= (offs_m + q_offset)[None, :])
                p_t = tl.where(ok, p_t, 0.0)
            dv = tl.dot(p_t.to(DT), do, dv, input_precision=DOT_PREC)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
            ds_t = (p_t * (dp_t - di[None, :])).to(DT)
            dxk = tl.dot(ds_t, xq, dxk, input_precision=DOT_PREC)
            dyk = tl.dot(ds_t, yq, dyk, input_precision=DOT_PREC)

    # xq carried sm_scale * log2(e); multiplying by ln 2 leaves sm_scale * dS^T Xq
    dxk = dxk * 0.6931471805599453
    dyk = dyk * 0.6931471805599453
    # Recompute k, mu_k, cos, sin rather than keeping them live through the loop (3-4 fp32 tiles of
    # registers), with the same operations as the prologue. remat_zero is a runtime 0, so the compiler
    # cannot merge this with the prologue (CSE).
    k = tl.load(k_ptrs + remat_zero, mask=col_ok[:, None], other=0.0).to(tl.float32)
    mu_k = _tl_magnitude(k, MAG, FAST)
    kc, ks = _tl_coarse(COS_T, SIN_T, n0 + remat_zero, offs_d, D)
    tk_c, tk_s = _tl_delta_table(DCS, COS_T + remat_zero, SIN_T, H, h, BLOCK_N, offs_d, D, HAS_DELTA)
    ck, sk = _tl_rotate(kc, ks, tk_c, tk_s)
    dmu = ck * dxk + sk * dyk
    dk = dmu * _tl_magnitude_grad(k, MAG)
    tl.store(DK + b * stride_dkb + h * stride_dkh + n0.to(tl.int64) * stride_dkn + offs_j[:, None] * stride_dkn
             + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV_ + b * stride_dvb + h * stride_dvh + n0.to(tl.int64) * stride_dvn + offs_j[:, None] * stride_dvn
             + offs_dv[None, :], dv.to(DV_.dtype.element_ty), mask=col_ok[:, None])
    if HAS_DELTA:
        # d(delta) partial sums, one row per _PART_KEYS keys whatever BLOCK_N is: every launch writes every row
        # its keys cover, so rows left by an earlier launch with another BLOCK_N (autotuning) are overwritten
        dphase = mu_k * (ck * dyk - sk * dxk)
        dphase = tl.where(col_ok[:, None], dphase, 0.0)
        part = _tl_sum(tl.reshape(dphase, (BLOCK_N // _PART_KEYS, _PART_KEYS, D)), 1)
        rows = pid_n * (BLOCK_N // _PART_KEYS) + tl.arange(0, BLOCK_N // _PART_KEYS)
        tl.store(DDELTA_PART + ((b * n_part_rows + rows[:, None]) * H + h) * D + offs_d[None, :], part)


def _pope_bwd_dq_kernel(
    Q, K, V, DCS, COS_T, SIN_T, DO, LSE, DI, DQ,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    H, Tq, Tk, q_offset, qk_scale, sm_scale, remat_zero,
    TQ_BUCKET, TK_BUCKET,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, MAG: tl.constexpr, HAS_DELTA: tl.constexpr, DOT_PREC: tl.constexpr,
    FAST: tl.constexpr,
):
    pid_m, b, h, pid_bh = _tl_split_pid((Tq + BLOCK_M - 1) // BLOCK_M, H)
    DT = Q.dtype.element_ty
    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    row_base = pid_bh.to(tl.int64) * Tq

    m0 = pid_m * BLOCK_M
    offs_i = tl.arange(0, BLOCK_M)
    offs_m = m0 + offs_i
    offs_j = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    row_ok = offs_m < Tq
    r = q_offset % _TRIG_STEP

    q_ptrs = Q + b * stride_qb + h * stride_qh + m0.to(tl.int64) * stride_qm + offs_i[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
    mu_q = _tl_magnitude(q, MAG, FAST)
    qc, qs = _tl_coarse(COS_T, SIN_T, m0 + q_offset - r, offs_d, D)
    tq_c, tq_s = _tl_table(COS_T, SIN_T, r, BLOCK_M, offs_d, D)
    cq, sq = _tl_rotate(qc, qs, tq_c, tq_s)
    xq = (mu_q * cq * qk_scale).to(DT)
    yq = (mu_q * sq * qk_scale).to(DT)
    do = tl.load(DO + b * stride_dob + h * stride_doh + m0.to(tl.int64) * stride_dom + offs_i[:, None] * stride_dom
                 + offs_dv[None, :], mask=row_ok[:, None], other=0.0)
    lse2 = tl.load(LSE + row_base + offs_m, mask=row_ok, other=float("inf")) * 1.4426950408889634
    di = tl.load(DI + row_base + offs_m, mask=row_ok, other=0.0)
    tab_c, tab_s = _tl_delta_table(DCS, COS_T, SIN_T, H, h, BLOCK_N, offs_d, D, HAS_DELTA)  # as in the forward

    dxq = tl.full([BLOCK_M, D], 0.0, tl.float32)
    dyq = tl.full([BLOCK_M, D], 0.0, tl.float32)
    n_full, hi = _tl_key_range(Tk, q_offset, m0, BLOCK_M, BLOCK_N, CAUSAL)
    for phase in tl.static_range(2):
        if phase == 0:
            lo_n = 0
            hi_n = n_full
        else:
            lo_n = n_full
            hi_n = hi
        for start_n in range(lo_n, hi_n, BLOCK_N):
            xk, yk, v = _tl_key_tile(k_base, v_base, start_n, offs_j, offs_d, offs_dv, stride_kn, stride_vn, Tk,
                                     COS_T, SIN_T, tab_c, tab_s, phase == 1, MAG, FAST, DT, D)
            s = tl.dot(xq, tl.trans(xk), input_precision=DOT_PREC)
            s = tl.dot(yq, tl.trans(yk), s, input_precision=DOT_PREC)
            p = tl.exp2(s - lse2[:, None])
            if phase == 1:
                offs_n = start_n + offs_j
                ok = offs_n[None, :] < Tk
                if CAUSAL:
                    ok = ok & (offs_n[None, :] <= (offs_m + q_offset)[:, None])
                p = tl.where(ok, p, 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
            ds = (p * (dp - di[:, None])).to(DT)
            dxq = tl.dot(ds, xk, dxq, input_precision=DOT_PREC)
            dyq = tl.dot(ds, yk, dyq, input_precision=DOT_PREC)

    # recompute q, cos, sin (see the dkdv epilogue) instead of keeping them live through the loop
    q = tl.load(q_ptrs + remat_zero, mask=row_ok[:, None], other=0.0).to(tl.float32)
    qc, qs = _tl_coarse(COS_T, SIN_T, m0 + q_offset - r + remat_zero, offs_d, D)
    tq_c, tq_s = _tl_table(COS_T, SIN_T, r + remat_zero, BLOCK_M, offs_d, D)
    cq, sq = _tl_rotate(qc, qs, tq_c, tq_s)
    dmu = (cq * dxq + sq * dyq) * sm_scale
    dq = dmu * _tl_magnitude_grad(q, MAG)
    tl.store(DQ + b * stride_dqb + h * stride_dqh + m0.to(tl.int64) * stride_dqm + offs_i[:, None] * stride_dqm
             + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=row_ok[:, None])


# ---- kernel objects, built lazily per execution mode -------------------------------------------

_HELPERS = ("_tl_magnitude", "_tl_magnitude_grad", "_tl_rotate", "_tl_table", "_tl_coarse", "_tl_delta_table",
            "_tl_key_range", "_tl_key_tile", "_tl_sum", "_tl_rowmax", "_tl_split_pid")
_HELPER_FNS = {name: globals()[name] for name in _HELPERS}
_KERNEL_FNS = {"fwd": _pope_fwd_kernel, "pre": _pope_bwd_pre_kernel,
               "dkdv": _pope_bwd_dkdv_kernel, "dq": _pope_bwd_dq_kernel}
_BUILT = {}

# Block sizes used under the interpreter (no autotuning there). Deliberately small and unequal so
# that the CPU tests cross several blocks, the causal diagonal and the sequence boundaries.
# (BLOCK_M, BLOCK_N): queries x keys per tile.
_INTERPRET_BLOCKS = {"fwd": (32, 16), "dkdv": (16, 32), "dq": (32, 16), "pre": (32, 0)}

# Autotune candidates (BLOCK_M, BLOCK_N, num_warps, num_stages) for A100 / H100, per kernel and per
# head-dim class (d, dv <= 64 or up to 128). BLOCK_M counts queries and BLOCK_N keys in all three
# kernels. Chosen by compiling every candidate for sm_80 and sm_90 with Triton 3.7.1's ptxas, bf16,
# causal softplus with delta (`python bench_kernel.py --spills`, no GPU needed; nothing was timed on a
# GPU): every candidate kept has at most 40 local-memory instructions inside its loops on both
# architectures (most have 0-2; spills outside the loops, in prologue and epilogue, go up to ~930 B).
# Dropped after the host phase tables (loop local ops sm_80 / sm_90): fwd d64 (128, 64, 4, 3) 95 / 136,
# (128, 128, 8, 3) 85 / 67; fwd d128 (128, 64, 8, 3) 0 / 161, (128, 64, 8, 2) 0 / 167, (64, 64, 8, 3)
# 159 / 124, (64, 32, 8, 3) 78 / 0; dkdv d64 (64, 64, 8, 3) 246 / 2; dq d64 (128, 64, 8, 3) 409 / 3,
# (64, 32, 4, 3) 74 / 0, (64, 64, 4, 3) 650 / 97; dq d128 (32, 64, 8, 3) 40 / 226. Added: fwd d128
# (128, 32, 8, 3) 0 / 6 and (128, 32, 8, 2) 0 / 0. The 16/32-row tiles serve decoding and short prefills.
_CONFIGS = {
    "fwd": {64: [(128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 4), (16, 64, 4, 2), (32, 64, 4, 2)],
            128: [(128, 32, 8, 3), (128, 32, 8, 2), (16, 64, 8, 2), (32, 64, 8, 2)]},
    "dkdv": {64: [(32, 128, 8, 3), (32, 64, 8, 3), (32, 32, 4, 3), (16, 64, 8, 2), (16, 32, 4, 2)],
             128: [(16, 32, 8, 2), (32, 32, 8, 3)]},
    "dq": {64: [(128, 32, 8, 3), (64, 32, 8, 3), (16, 64, 4, 2), (32, 64, 4, 2)],
           128: [(32, 32, 8, 3), (16, 64, 8, 2)]},
}


def _interpret_mode():
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pow2_bucket(n):
    return 1 << max(int(n) - 1, 0).bit_length()


def _prune(role):
    """Autotune pre-filter: the head-dim class's candidates, minus tiles much larger than the problem."""
    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        tq, tk, d, dv = args["TQ_BUCKET"], args["TK_BUCKET"], args["D"], args["DV"]
        allowed = set(_CONFIGS[role][64 if max(d, dv) <= 64 else 128])
        keep = []
        for c in configs:
            bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
            if (bm, bn, c.num_warps, c.num_stages) not in allowed:
                continue
            if bm > max(16, tq) or bn > max(16, tk):
                continue
            if role != "dkdv" and tq >= 512 and bm < 64 and max(d, dv) <= 64:  # long prefill, d <= 64
                continue
            keep.append(c)
        if not keep:
            keep = [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                    in allowed][-1:]
        return keep
    return prune


def _with_helpers(raw, wrap):
    """Copy of the raw kernel (or helper) function whose globals map the device helpers it calls to
    wrap(helper), recursively, so helpers may call helpers (_tl_key_tile does).

    The module's own globals keep the plain helpers, so the jit and interpreter builds never interfere.
    """
    g = dict(raw.__globals__)
    for name in _HELPERS:
        if name in raw.__code__.co_names:
            g[name] = wrap(_with_helpers(_HELPER_FNS[name], wrap))
    fn = types.FunctionType(raw.__code__, g, raw.__name__, raw.__defaults__, raw.__closure__)
    fn.__annotations__ = dict(raw.__annotations__)
    fn.__doc__, fn.__module__, fn.__qualname__ = raw.__doc__, raw.__module__, raw.__qualname__
    return fn


def _make_autotuned(name, raw):
    arg_names = raw.__code__.co_varnames[:raw.__code__.co_argcount]
    no_spec = [a for a in ("Tq", "Tk", "q_offset", "n_part_rows", "remat_zero") if a in arg_names]  # decoding: no recompiles
    jit = _JITFunction(_with_helpers(raw, _JITFunction), do_not_specialize=no_spec)
    if name == "pre":
        return jit
    pinned = pinned_configs().get(name)
    table = [pinned] if pinned else sorted(set(_CONFIGS[name][64]) | set(_CONFIGS[name][128]), reverse=True)
    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in table]
    # cache_results: the timings go to Triton's cache dir, so later processes on this machine reuse the choice
    return triton.autotune(configs, key=["TQ_BUCKET", "TK_BUCKET", "D", "DV", "CAUSAL", "MAG", "HAS_DELTA"],
                           prune_configs_by={"early_config_prune": _prune(name)}, cache_results=True)(jit)


PIN_ENV = "POPE_TRITON_CONFIG"


def pinned_configs():
    """Configs pinned by the environment variable POPE_TRITON_CONFIG, read when the kernels are first built.

    Format: "fwd=128,64,8,3;dkdv=32,64,8,3;dq=64,32,8,3" (BLOCK_M, BLOCK_N, num_warps, num_stages per kernel;
    any subset of the three). A pinned kernel is not autotuned, so every process and DDP rank runs the same
    tiles and gets bitwise the same dq, dk and d(delta). Returns {role: (bm, bn, warps, stages)}.
    Raises ValueError for a malformed value: BLOCK_M, BLOCK_N must be powers of two in 16..128.
    """
    spec = os.environ.get(PIN_ENV, "").strip()
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        role, _, vals = item.partition("=")
        try:
            cfg = tuple(int(x) for x in vals.split(","))
        except ValueError:
            cfg = ()
        ok = (role.strip() in ("fwd", "dkdv", "dq") and len(cfg) == 4
              and all(b in (16, 32, 64, 128) for b in cfg[:2]) and cfg[2] in (1, 2, 4, 8, 16) and cfg[3] >= 1)
        if not ok:
            raise ValueError(f"{PIN_ENV}={spec!r}: expected e.g. 'fwd=128,64,8,3;dkdv=32,64,8,3;dq=64,32,8,3' "
                             "(BLOCK_M,BLOCK_N,num_warps,num_stages per kernel; blocks in 16..128, powers of two)")
        out[role.strip()] = cfg
    return out


def _make_interpreted(raw):
    from triton.runtime.interpreter import InterpretedFunction
    return InterpretedFunction(_with_helpers(raw, InterpretedFunction))


def _kernels():
    """The four kernels, as interpreter functions if TRITON_INTERPRET=1 now, else jit + autotune.

    Returns (dict name -> kernel, interpreting: bool). Raises RuntimeError if triton is not importable.
    """
    if triton is None:
        raise RuntimeError(f"triton is not importable: {_TRITON_IMPORT_ERROR!r}")
    interpreting = _interpret_mode()
    if interpreting not in _BUILT:
        _BUILT[interpreting] = {n: (_make_interpreted(f) if interpreting else _make_autotuned(n, f))
                                for n, f in _KERNEL_FNS.items()}
    return _BUILT[interpreting], interpreting


# ---- launchers ------------------------------------------------------------------------------------

_LOG2E = 1.4426950408889634


def _fp32_matmul_allows_tf32():
    """True if torch lets fp32 CUDA matmuls use TF32, read through the API that works in this process.

    torch >= 2.9 has torch.backends.cuda.matmul.fp32_precision ('ieee' | 'tf32' | 'none' = inherit
    torch.backends.fp32_precision); once it has been set, reading the legacy allow_tf32 raises. The
    legacy setter updates fp32_precision too, so reading the new attribute is right under both APIs.
    """
    mm = torch.backends.cuda.matmul
    prec = getattr(mm, "fp32_precision", None)
    if prec is None:  # torch < 2.9
        return bool(mm.allow_tf32)
    if prec == "none":
        prec = getattr(torch.backends, "fp32_precision", "none")
    return prec == "tf32"


def _dot_precision(dtype):
    """tl.dot input precision: fp32 operands use IEEE fp32 unless torch allows TF32 matmuls."""
    if dtype == torch.float32 and not _fp32_matmul_allows_tf32():
        return "ieee"
    return "tf32"  # ignored for fp16 / bf16 operands


def _common_meta(q, v, delta, causal, magnitude, interpreting):
    fast = not interpreting and torch.version.hip is None  # libdevice fast lg2: NVIDIA only
    return dict(D=q.shape[-1], DV=v.shape[-1], CAUSAL=bool(causal), MAG=_MAG_CODE[magnitude],
                HAS_DELTA=delta is not None, DOT_PREC=_dot_precision(q.dtype), FAST=fast)


def _launch(kernel, grid_fn, role, interpreting, device, args, meta):
    if interpreting:
        bm, bn = _INTERPRET_BLOCKS[role]
        blocks = {"BLOCK_M": bm} if role == "pre" else {"BLOCK_M": bm, "BLOCK_N": bn}
        kernel[grid_fn(blocks)](*args, **meta, **blocks)
    else:
        if role == "pre":
            meta = dict(meta, BLOCK_M=64)
        with torch.cuda.device(device):
            kernel[grid_fn if role != "pre" else grid_fn(meta)](*args, **meta)


_TRIG_CACHE = {}


def _trig_tables(D, theta, max_pos, device):
    """Host cos/sin tables of the kernels' phases, (TRIG_FINE_ROWS + n_coarse, D) float32 each.

    Row j < 144 holds cos/sin(j theta_c) (fine rows); row 144 + a holds cos/sin(16 a theta_c), a = 0..max_pos // 16
    (coarse rows). theta_c is pope_frequencies(D, theta) (float32), and every angle is formed in float64 and
    rounded once to float32 after cos/sin, so the kernels see the exact phase s * theta_c of that table.
    A kernel phase is one coarse row (the tile start) added to one fine row (the row in the tile, plus
    q_offset % 16 for queries; plus delta for keys): ~2 float32 roundings, whatever the tile sizes.
    Memory: 8 * D * (144 + max_pos / 16) bytes, 4.2 MB at D = 128 and 128k tokens. Cached per
    (D, theta, device); the row count grows in powers of two.
    """
    n_coarse = _pow2_bucket(max_pos // TRIG_STEP + 1)
    key = (D, float(theta), str(device))
    hit = _TRIG_CACHE.get(key)
    if hit is None or hit[0] < n_coarse:
        freqs = pope_frequencies(D, theta, device=device).double()
        pos = torch.cat((torch.arange(TRIG_FINE_ROWS, device=device),
                         TRIG_STEP * torch.arange(n_coarse, device=device))).double()
        angle = pos[:, None] * freqs  # exact: < 2^31 times a 24-bit float32
        hit = (n_coarse, torch.cos(angle).float().contiguous(), torch.sin(angle).float().contiguous())
        _TRIG_CACHE[key] = hit
    return hit[1], hit[2]


def _delta_cos_sin(delta, like):
    """(2, H, D) float32 cos, sin of delta (from float64), or a 1-element placeholder when delta is None."""
    if delta is None:
        return like.new_zeros(1, dtype=torch.float32)
    d64 = delta.detach().double()
    return torch.stack((torch.cos(d64), torch.sin(d64))).float().contiguous()


def _check_limits(B, H, Tq, Tk, q_offset, row_strides):
    """Raise ValueError for launches the kernels cannot address (see pope_attention_triton, Limits)."""
    if q_offset + Tq > MAX_POSITION or Tk > MAX_POSITION:
        raise ValueError(f"positions up to {max(q_offset + Tq, Tk)} tokens exceed the kernel's int32 positions "
                         f"(max {MAX_POSITION}); use backend='torch'")
    n_programs = B * H * triton.cdiv(max(Tq, Tk, 1), 16)
    if n_programs > 2 ** 31 - 1:
        raise ValueError(f"B * H * ceil(T / 16) = {n_programs} programs exceed the 1-D grid limit 2^31 - 1; "
                         "split the batch into smaller calls")
    bad = [s for s in row_strides if s * 128 >= 2 ** 31]
    if bad:
        raise ValueError(f"row stride {bad[0]} elements: the kernels keep in-tile offsets (128 rows x stride) in "
                         "int32, so row strides must be < 2^24 elements; pass contiguous (B, H, T, d) tensors")


def _pope_forward_impl(q, k, v, delta, causal, theta, sm_scale, q_offset, magnitude):
    kernels, interpreting = _kernels()
    B, H, Tq, D = q.shape
    Tk, DV = k.shape[2], v.shape[3]
    o = torch.empty((B, H, Tq, DV), device=q.device, dtype=q.dtype)
    lse = torch.empty((B, H, Tq), device=q.device, dtype=torch.float32)
    if Tq == 0 or B * H == 0:
        return o, lse
    _check_limits(B, H, Tq, Tk, q_offset, (q.stride(2), k.stride(2), v.stride(2), o.stride(2)))
    cos_t, sin_t = _trig_tables(D, theta, max(Tk, q_offset + Tq), q.device)
    args = (q, k, v, _delta_cos_sin(delta, q), cos_t, sin_t, o, lse,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
            H, Tq, Tk, q_offset, sm_scale * _LOG2E, _pow2_bucket(Tq), _pow2_bucket(Tk))
    _launch(kernels["fwd"], lambda m: (triton.cdiv(Tq, m["BLOCK_M"]) * B * H,), "fwd", interpreting, q.device,
            args, _common_meta(q, v, delta, causal, magnitude, interpreting))
    return o, lse


def _pope_backward_impl(do, q, k, v, delta, o, lse, causal, theta, sm_scale, q_offset, magnitude):
    kernels, interpreting = _kernels()
    B, H, Tq, D = q.shape
    Tk, DV = k.shape[2], v.shape[3]
    do = do.to(q.dtype)
    if do.stride(-1) != 1:
        do = do.contiguous()
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    dk = torch.empty(k.shape, device=q.device, dtype=k.dtype)
    dv = torch.empty(v.shape, device=q.device, dtype=v.dtype)
    # d(delta) partials: one row per PART_KEYS keys, for any BLOCK_N <= 128; rows past the keys stay zero
    n_part_rows = triton.cdiv(Tk, 128) * (128 // PART_KEYS)
    part = torch.zeros((B, n_part_rows, H, D) if delta is not None else (1,), device=q.device, dtype=torch.float32)
    if Tq == 0 or B * H == 0:
        dq.zero_(), dk.zero_(), dv.zero_()
        return dq, dk, dv, torch.zeros((H, D), device=q.device, dtype=torch.float32)
    _check_limits(B, H, Tq, Tk, q_offset, (q.stride(2), k.stride(2), v.stride(2), o.stride(2), do.stride(2)))
    cos_t, sin_t = _trig_tables(D, theta, max(Tk, q_offset + Tq), q.device)
    dcs = _delta_cos_sin(delta, q)
    di = torch.empty((B, H, Tq), device=q.device, dtype=torch.float32)
    _launch(kernels["pre"], lambda m: (triton.cdiv(Tq, m["BLOCK_M"]) * B * H,), "pre", interpreting, q.device,
            (o, do, di, o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1), do.stride(2), H, Tq),
            dict(DV=DV))
    meta = _common_meta(q, v, delta, causal, magnitude, interpreting)
    qk_scale = sm_scale * _LOG2E
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2))
    _launch(kernels["dkdv"], lambda m: (triton.cdiv(Tk, m["BLOCK_N"]) * B * H,), "dkdv", interpreting, q.device,
            (q, k, v, dcs, cos_t, sin_t, do, lse, di, dk, dv, part, *strides,
             dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
             H, Tq, Tk, q_offset, qk_scale, n_part_rows, 0, _pow2_bucket(Tq), _pow2_bucket(Tk)), meta)
    _launch(kernels["dq"], lambda m: (triton.cdiv(Tq, m["BLOCK_M"]) * B * H,), "dq", interpreting, q.device,
            (q, k, v, dcs, cos_t, sin_t, do, lse, di, dq, *strides, dq.stride(0), dq.stride(1), dq.stride(2),
             H, Tq, Tk, q_offset, qk_scale, sm_scale, 0, _pow2_bucket(Tq), _pow2_bucket(Tk)), meta)
    ddelta = part.sum(dim=(0, 1)) if delta is not None else torch.zeros((H, D), device=q.device, dtype=torch.float32)
    return dq, dk, dv, ddelta


# ---- torch.library custom ops (so torch.compile keeps the kernel as one graph node) ---------------

@torch.library.custom_op("pope::attention_fwd", mutates_args=())
def _pope_attention_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, delta: Optional[torch.Tensor],
                           causal: bool, theta: float, sm_scale: float, q_offset: int,
                           magnitude: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Fused PoPE attention forward -> (out (B, H, Tq, dv), lse (B, H, Tq) float32 in nats)."""
    return _pope_forward_impl(q, k, v, delta, causal, theta, sm_scale, q_offset, magnitude)


@_pope_attention_fwd_op.register_fake
def _(q, k, v, delta, causal, theta, sm_scale, q_offset, magnitude):
    B, H, Tq, _ = q.shape
    return q.new_empty((B, H, Tq, v.shape[-1])), q.new_empty((B, H, Tq), dtype=torch.float32)


@torch.library.custom_op("pope::attention_bwd", mutates_args=())
def _pope_attention_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           delta: Optional[torch.Tensor], o: torch.Tensor, lse: torch.Tensor, causal: bool,
                           theta: float, sm_scale: float, q_offset: int,
                           magnitude: str) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused PoPE attention backward -> (dq, dk, dv, d delta (H, d) float32; zeros if delta is None)."""
    return _pope_backward_impl(do, q, k, v, delta, o, lse, causal, theta, sm_scale, q_offset, magnitude)


@_pope_attention_bwd_op.register_fake
def _(do, q, k, v, delta, o, lse, causal, theta, sm_scale, q_offset, magnitude):
    H, D = q.shape[1], q.shape[-1]
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), q.new_empty((H, D), dtype=torch.float32)


def _pope_fwd_setup_context(ctx, inputs, output):
    q, k, v, delta, causal, theta, sm_scale, q_offset, magnitude = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, delta, o, lse)
    ctx.has_delta = delta is not None
    ctx.args = (causal, theta, sm_scale, q_offset, magnitude)
    ctx.mark_non_differentiable(lse)


def _pope_fwd_backward(ctx, do, dlse):
    q, k, v, delta, o, lse = ctx.saved_tensors
    dq, dk, dv, ddelta = _pope_attention_bwd_op(do, q, k, v, delta, o, lse, *ctx.args)
    return dq, dk, dv, (ddelta if ctx.has_delta else None), None, None, None, None, None


_pope_attention_fwd_op.register_autograd(_pope_fwd_backward, setup_context=_pope_fwd_setup_context)


# ---- public API -----------------------------------------------------------------------------------

def _compute_dtype(q, v):
    dev = q.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else v.dtype


def triton_unsupported_reason(q, k, v):
    """None if the Triton kernel handles these (B, H, T, d) tensors, else a sentence saying why not.

    Supported: triton importable; d and dv in TRITON_HEAD_DIMS = (16, 32, 64, 128); compute dtype
    (v's dtype, or the autocast dtype) float16, bfloat16 or float32; Tk >= 1. Device is not checked.
    """
    if triton is None:
        return f"triton is not importable ({_TRITON_IMPORT_ERROR!r})"
    d, dv = q.shape[-1], v.shape[-1]
    if d not in TRITON_HEAD_DIMS or dv not in TRITON_HEAD_DIMS:
        return (f"the Triton PoPE kernel supports head dims {TRITON_HEAD_DIMS} for q/k and v, got d={d}, dv={dv}; "
                "use backend='torch' for other head dims")
    dtype = _compute_dtype(q, v)
    if dtype not in _TRITON_DTYPES:
        return f"the Triton PoPE kernel supports float16, bfloat16 and float32, got {dtype}; use backend='torch'"
    if k.shape[-2] < 1:
        return "the Triton PoPE kernel needs at least one key (Tk >= 1)"
    return None


def triton_supported(q, k, v):
    """True if pope_attention(backend='triton') accepts these tensors' shapes and dtype (see
    triton_unsupported_reason); the device check (CUDA, or CPU under TRITON_INTERPRET=1) is separate."""
    return triton_unsupported_reason(q, k, v) is None


def pope_attention_triton(q, k, v, delta=None, *, causal=True, theta=10000.0, sm_scale=None, q_offset=0,
                          magnitude="softplus"):
    """PoPE softmax attention with the fused Triton kernel (pope_attention(..., backend='triton')).

    Args (as pope_attention):
        q: (B, H, Tq, d) raw queries; k: (B, H, Tk, d) raw keys; v: (B, H, Tk, dv) values. Any strides
            (the last dim is made contiguous if it is not). Query i sits at absolute position
            q_offset + i tokens, key j at position j.
        delta: (H, d) phase bias in radians added to the key phases, or None (zero, no gradient).
        causal: query i sees keys j <= q_offset + i (bottom-right alignment when q_offset = Tk - Tq).
        theta: frequency base; theta_c = theta^(-(c-1)/d) radians per token, the float32 table
            pope_frequencies; the phases come from host cos/sin tables formed in float64 (see _trig_tables).
        sm_scale: logit scale (default 1/sqrt(d)); q_offset: tokens, >= 0; magnitude: 'softplus' |
            'relu' | 'identity'.

    Returns:
        (B, H, Tq, dv) in v's dtype (the autocast dtype under autocast). Differentiable in q, k, v
        and delta through the registered torch.library autograd formula (custom op pope::attention_fwd,
        backward pope::attention_bwd); the softmax logsumexp (nats) is kept internally for the backward.

    Supported: d, dv in TRITON_HEAD_DIMS = (16, 32, 64, 128); float16 / bfloat16 / float32 (fp32 dots
    run in IEEE fp32 unless torch allows TF32 matmuls, read under either TF32 API; backend='auto' sends
    fp32 to the torch path, since the IEEE-fp32 tiles spill heavily); any Tq, Tk >= 1; Tq <= Tk is not
    required. CUDA tensors; CPU tensors only under the Triton interpreter (TRITON_INTERPRET=1).

    Limits (checked, ValueError): positions q_offset + Tq and Tk < 2^31 (int32 positions); the 1-D grid
    has B * H * ceil(T / BLOCK) programs, at most 2^31 - 1 (no 65,535 limit on B * H); element offsets
    of a row (b, h, t) are int64, in-tile offsets (<= 128 rows x row stride) int32, so row strides must be
    < 2^24 elements. The host phase table takes 8 * d * (144 + T / 16) bytes (4.2 MB at d = 128, 128k tokens).

    Determinism: with one set of tile sizes every kernel is deterministic, d(delta) included (per-16-key
    partial sums, no atomics). Autotuning may pick other tiles in another process or DDP rank (then dq, dk,
    d(delta) differ in the last bits); timings are cached on disk per machine (Triton cache_results), and
    POPE_TRITON_CONFIG pins the tiles (see pinned_configs).

    Raises:
        ValueError: shape / q_offset / magnitude errors (as pope_attention), unsupported head dim or
            dtype, CPU tensors without TRITON_INTERPRET=1, the limits above, or triton not importable.
    """
    _check(q, k, v, delta, q_offset)
    if magnitude not in MAGNITUDES:
        raise ValueError(f"magnitude must be one of {MAGNITUDES}, got {magnitude!r}")
    if theta <= 1:
        raise ValueError(f"need theta > 1, got {theta}")
    reason = triton_unsupported_reason(q, k, v)
    if reason is not None:
        raise ValueError(reason)
    if not q.is_cuda and not _interpret_mode():
        raise ValueError(f"backend='triton' needs CUDA tensors, got device {q.device}. Use backend='auto' or "
                         "'torch' on CPU, or set os.environ['TRITON_INTERPRET'] = '1' to run the kernel in the "
                         "(slow) Triton interpreter, e.g. for tests")
    if not (q.device == k.device == v.device) or (delta is not None and delta.device != q.device):
        raise ValueError("q, k, v and delta must be on the same device")
    dtype = _compute_dtype(q, v)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    d = q.shape[-1]
    sm_scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    dl = None if delta is None else delta.to(torch.float32).contiguous()
    out, _ = _pope_attention_fwd_op(q, k, v, dl, bool(causal), float(theta), sm_scale, int(q_offset), magnitude)
    return out
