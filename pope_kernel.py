"""FlashAttention-2 in Triton, forward and backward, for PoPE's Cartesian queries and keys.

pope.py turns PoPE's raw queries and keys (width d) into their Cartesian form q~, k~ (width 2d) in
PyTorch, once per call (O(T d) work). What is left is plain softmax attention with a query/key width
D_QK (2d for PoPE) that differs from the value width D_V (d), which is what this file computes:

    O = softmax(ln(2) * Q K^T) V,    lse = logsumexp(ln(2) * Q K^T) per query row, in nats.

Q arrives pre-scaled by sm_scale * log2(e) (pope.py folds it into its transform), so Q K^T are
base-2 logits and the online softmax runs on exp2 with no multiply per score. Causal masking with
q_offset: query i sits at absolute position q_offset + i and key j at j; query i sees keys
j <= q_offset + i (q_offset = Tk - Tq is the bottom-right alignment of decoding with a KV cache).
Grouped-query attention: K and V may have H_kv heads for H query heads (H a multiple of H_kv);
query head h reads key/value head h // (H / H_kv).

Documents (block-causal, issue 58): given a (B, Tk) int32 table of non-decreasing document ids, query i sees key j
only if both have one id (and j <= q_offset + i, causal). The kernels then take document_bounds' per-key table
(id, first key and end of its document), and each program reads its first and last row's (fwd, dq) or key's (dK/dV)
entries to visit only the tiles that hold a visible pair (visited_tiles: the formula; docs/kernel.md). Launched
without it, the kernels are compiled and launched exactly as before (DOCS, TILES and the constexprs DOC, COUNT keep
their defaults).

Kernels (one program per tile, a 1-D grid over (batch, head, tile)), by their public names:
    KERNELS["fwd"]   a BLOCK_M tile of queries against every visible key block: O, lse
    PRE_KERNEL       Di = rowsum(dO * O) (FlashAttention-2's backward preprocessing)
    KERNELS["dkdv"]  a BLOCK_N tile of keys of one key/value head against the visible query blocks of
                     every query head of its group: dK, dV summed in registers, no atomics
    KERNELS["dq"]    a BLOCK_M tile of queries against every visible key block: dQ
    DECODE_KERNEL    decoding (flash-decoding): the query heads of one key/value head against one split of a
                     cache of key magnitudes, each key tile rotated in registers (section "decoding" below)
Every program writes every element of its output tile exactly once and reads no output buffer, so
the autotuner, which launches each candidate on the live buffers, leaves nothing behind; results are
bitwise deterministic for a given set of tiles.

Public API (imports nothing from this repo):
    attention(q, k, v, *, causal=True, q_offset=0, document_ids=None) -> (o, lse), differentiable in q, k, v
    document_bounds(document_ids), document_ids_reason(...), visited_tiles(...)   documents (block-causal)
    launch_forward(q, k, v, causal, q_offset, docs, tiles), launch_backward(...)   the launches (shapes, widths, limits)
    attention_forward, attention_backward   the torch.library custom ops pope::attention_forward and
        pope::attention_backward (fake kernels registered, so torch.compile keeps them in its graph)
    unsupported_reason(q, k, v), device_unsupported_reason(device, dtype, D_QK, D_V), check_limits(...),
    dot_precision(dtype), shared_memory_bytes(...), select_configs(...), SHARED_MEMORY_LIMITS
    KERNELS, PRE_KERNEL, DECODE_KERNEL (the kernels, for bench_kernel.py's compile-only builds and for tests),
    CONFIGS, INTERPRET_BLOCKS, PIN_ENV, COMPILE_OPTIONS, pinned_configs(), pin_configs(spec), head_class(D_QK, D_V),
    pow2_bucket(n), tile_config(bm, bn, warps, stages), gpu_configs(role), prune_configs(role)
    decode(q, mu, v, rot, *, causal, q_offset, n_split) -> (o, lse), not differentiable: the custom op
        pope::decode (decode_forward); decode_at, the same with the position as a device tensor (pope::decode_at);
        decode_splits(bh_kv, Tk), decode_split_table()

Layout contract of the custom ops (every torch.library op in the 'pope' namespace: attention_forward,
attention_backward, decode and decode_at here, and any op added later): an op
takes its tensor inputs in any strides (an input whose last dim is not unit-stride is copied first) and
returns every output contiguous; its fake kernel returns the same shapes, dtypes and contiguous strides,
built with new_empty(shape), never empty_like(input), which keeps an input's permutation. Inductor lays
out a fallback op's outputs from its fake kernel and reads the real ones through those strides: model.py's
q, k, v are views of one projection, (B, T, H, d) in memory; a fake that copies their strides fails the
compiled step's size asserts or, with them off, makes its gradients wrong. tests/custom_ops.py checks an
op on the layouts the model passes (tests/test_custom_ops.py); after changing an op's fake kernel, clear
Inductor's cache (docs/kernel.md).

The Triton interpreter (CPU tensors, slow, for tests) is used when TRITON_INTERPRET=1 is set before
this module is imported (tests/conftest.py sets it on machines without CUDA). Why this split, and what
the kernels cost next to a FlashAttention kernel: docs/kernel.md.
"""

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"  # read once: the decorators below use it too
QK_DIMS = (16, 32, 64, 128, 256)  # supported D_QK
V_DIMS = (16, 32, 64, 128)  # supported D_V
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_POSITION = 2**31 - 1  # q_offset + Tq and Tk are int32 inside the kernels
_LN2 = tl.constexpr(0.6931471805599453)  # in kernel code: globals must be tl.constexpr
_LOG2E = tl.constexpr(1.4426950408889634)


# ---- tiles ----------------------------------------------------------------------------------------
# Autotune candidates (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and head-dim class: 64 for
# D_V <= 64 and D_QK <= 128 (PoPE at d <= 64), else 128. BLOCK_M counts queries and BLOCK_N keys in
# every kernel. The first candidate of each list is the training tile (what `python bench_kernel.py --sass`
# reports); 16-row tiles serve decoding. Chosen by compiling for sm_80 and sm_90 with the triton wheel's
# ptxas (`python bench_kernel.py --spills`, no GPU): no candidate has local-memory instructions inside
# its loops, and sm_90 uses wgmma for every tile whose matmul rows (queries in fwd / dq, keys in dkdv)
# number 64 or more; every training tile has. Larger tiles spill in their loops: fwd d=64 (128, 64, 4, 3)
# is fine but dkdv d=64 (64, 128, 8, 3) has 5 local ops per loop on sm_80, (64, 64, 4, 3) 4 on sm_90;
# dkdv d=128 (64, 64, 8, 2/3) 46-56 on sm_90; dq d=64 (128, 64, 8, 3) 14 on sm_80; dq d=128
# (128, 32, 8, 2) 37 on sm_80. Nothing was timed on a GPU.
CONFIGS = {
    "fwd": {
        64: [
            (128, 64, 8, 3),
            (128, 128, 8, 3),
            (64, 64, 4, 3),
            (128, 32, 4, 3),
            (16, 64, 4, 2),
            (32, 64, 4, 2),
            (16, 128, 4, 2),
        ],
        128: [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 2), (16, 64, 4, 2), (32, 64, 4, 2)],
    },
    "dkdv": {
        64: [(32, 128, 8, 3), (32, 64, 4, 3), (16, 128, 8, 2), (16, 64, 4, 2)],
        128: [(32, 64, 8, 3), (32, 32, 4, 3), (16, 64, 8, 2)],
    },
    "dq": {
        64: [(128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3), (16, 64, 4, 2), (32, 64, 4, 2)],
        128: [(64, 64, 8, 2), (64, 64, 8, 3), (64, 32, 4, 3), (16, 64, 4, 2), (32, 64, 4, 2)],
    },
}
# Under the interpreter (no autotuning): small, unequal tiles, so that the CPU tests cross several
# blocks, the causal diagonal and the sequence ends.
INTERPRET_BLOCKS = {"fwd": (32, 16), "dkdv": (16, 32), "dq": (32, 16)}
PRE_BLOCK_M = 32 if INTERPRETING else 64
PIN_ENV = "POPE_TRITON_CONFIG"


def head_class(D_QK, D_V):
    """The head-dim class (a key of CONFIGS[role]) of query/key width D_QK and value width D_V: 64 for
    D_QK <= 128 and D_V <= 64 (PoPE at d <= 64), else 128."""
    return 64 if D_QK <= 128 and D_V <= 64 else 128


def pow2_bucket(n):
    """n (tokens, >= 0) rounded up to a power of two (0 and 1 -> 1): the TQ_BUCKET / TK_BUCKET the kernels are
    launched with, which the autotuner keys on and select_configs sizes tiles by."""
    return 1 << max(int(n) - 1, 0).bit_length()


def tile_config(bm, bn, warps=4, stages=2):
    """A triton.Config of tile (BLOCK_M, BLOCK_N) = (bm, bn) with num_warps=warps, num_stages=stages: one
    autotune candidate (CONFIGS lists them as tuples (bm, bn, warps, stages))."""
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)


# ---- shared memory per architecture ----------------------------------------------------------------------
# Triton's launcher refuses a kernel whose shared memory exceeds the device's opt-in maximum per block
# (OutOfResources); when every autotune candidate does, the autotuner scores them all inf and the launch
# fails. So candidates are pruned by shared_memory_bytes against the live device's limit, and a case no
# candidate fits is refused up front (device_unsupported_reason). The limits of the parts the tests model:
SHARED_MEMORY_LIMITS = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448, 100: 232_448, 120: 101_376}
# bytes; A100, A10/3090, L4/L40, H100/H200, B200/GB200, RTX 50xx / RTX PRO 6000 Blackwell (sm_121, DGX Spark:
# the same limit and the same builds as sm_120; sm_103, B300: the same builds as sm_100)


def mma_kind(role, config, arch):
    """The tensor-core instruction Triton (3.7, 3.9) compiles the kernel's matmuls to on sm_<arch>: 'wgmma'
    (sm_90) or 'tcgen05' (sm_100 to sm_119) where the matmul rows (queries in fwd / dq, keys in dkdv) number 64
    or more, else 'mma' (mma.sync: sm_80 to sm_89, the consumer Blackwell sm_120 / sm_121, and small tiles)."""
    rows = config[1] if role == "dkdv" else config[0]
    if rows < 64 or not 90 <= arch < 120:
        return "mma"
    return "wgmma" if arch < 100 else "tcgen05"


def shared_memory_bytes(role, config, D_QK, D_V, elem_bytes, arch):
    """Upper bound on the shared memory (bytes) Triton allocates for one kernel build (metadata.shared).

    role 'fwd' | 'dkdv' | 'dq'; config (BLOCK_M, BLOCK_N, num_warps, num_stages); elem_bytes 2 (fp16/bf16)
    or 4 (fp32, tf32 or IEEE dots); arch the compute capability as 80, 86, 89, 90, 100, 120. The model: the
    tiles loaded in the key (fwd, dq) or query (dkdv) loop, buffered num_stages times where the matmuls
    read their operands from shared memory asynchronously (mma_kind 'wgmma' or 'tcgen05'), num_stages + 1
    times in a tcgen05 dK/dV, and num_stages - 1 times with mma.sync (sm_80 to sm_89, sm_120 / sm_121); the
    tiles loaded once before the loop; conversion tiles of the score shape (BLOCK_M x BLOCK_N: none in a
    16-bit 128-row forward or a 16-bit tcgen05 dQ, two in an fp32 backward); a tcgen05 dQ's second copy of
    the key tile (BLOCK_N x D_QK); for fp32 a transposed V tile in dQ and row-reduction scratch; 1 KB (2 KB
    for tcgen05, whose 16-bit builds otherwise meet the model to the byte).
    It is at least the compiled figure, by 1 KB or more, in every build compiled without a GPU: Triton 3.7.1,
    every candidate for sm_80/86/89/90; for sm_100/120 every bf16 candidate at d = 16, 64, 128 and most at
    d = 32, fp32 (tf32) at d = 64 and 128; Triton 3.9.0, bf16 at d = 128 for sm_100/120, the same bytes
    (tests/test_pope_triton.py: a fast subset by default, every candidate and part with --runslow);
    docs/kernel.md has the sm_100 / sm_120 table.
    """
    bm, bn, _, stages = config
    kind = mma_kind(role, config, arch)
    buffers = stages - 1 if kind == "mma" else stages + (role == "dkdv" and kind == "tcgen05")
    width = (D_QK + D_V) * elem_bytes
    fp32 = elem_bytes == 4  # tf32 operands: transposes go through extra shared-memory copies
    if fp32:  # one score tile in the forward (IEEE dots: FMA), two in the backward; row-reduction scratch
        score = bm * bn * elem_bytes * (1 if role == "fwd" else 2) + 16 * bm
    elif (role == "fwd" and bm >= 128) or (role == "dq" and kind == "tcgen05"):
        score = 0  # a 128-row forward keeps its scores in registers; a tcgen05 dQ keeps dS in tensor memory
    else:
        score = bm * bn * elem_bytes
    spare = 2048 if kind == "tcgen05" else 1024  # tcgen05: builds meet the rest exactly, 1 KB of margin
    if role == "dkdv":  # queries, dO, lse and Di stream through the loop; the key tile's K, V stay
        return buffers * bm * (width + 8) + bn * width + score + spare
    resident = bm * (D_QK if role == "fwd" else D_QK + D_V)  # q (and dO for dq)
    v_t = bn * D_V * elem_bytes if fp32 and role == "dq" else 0  # V^T of dO V^T
    k_copy = bn * D_QK * elem_bytes if role == "dq" and kind == "tcgen05" else 0  # K for dS K, besides Q K^T's
    return buffers * bn * width + resident * elem_bytes + score + v_t + k_copy + spare


def device_shared_memory(device):
    """(compute capability as 80 / 86 / 89 / 90 ..., opt-in shared memory per block in bytes) of CUDA `device`
    (a torch.device or 'cuda:N': that device, not the current one)."""
    props = torch.cuda.get_device_properties(device)
    arch = props.major * 10 + props.minor
    limit = getattr(props, "shared_memory_per_block_optin", None) or SHARED_MEMORY_LIMITS.get(arch, 101_376)
    return arch, int(limit)


def select_configs(role, configs, tq_bucket, tk_bucket, D_QK, D_V, elem_bytes=2, arch=None, limit=None):
    """The autotune candidates kept for one problem (the autotuner's early_config_prune).

    configs: triton.Config list; tq_bucket, tk_bucket: the query and key counts rounded up to powers of
    two. Keeps the head-dim class's candidates (hand-set lists, as in tests, whatever their class), drops
    those whose shared_memory_bytes exceeds `limit` on `arch` (None: no limit known, e.g. the interpreter),
    then tiles much larger than the problem, and for Tq >= 512 (training, long prefill) the 16/32-row
    decoding tiles, unless nothing else fits. Returns [] only if no candidate fits the limit.
    """

    def key(c):
        return c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages

    allowed = set(CONFIGS[role][head_class(D_QK, D_V)])
    keep = [c for c in configs if key(c) in allowed] or list(configs)
    if limit is not None:
        keep = [c for c in keep if shared_memory_bytes(role, key(c), D_QK, D_V, elem_bytes, arch) <= limit]
    fit = [c for c in keep if c.kwargs["BLOCK_M"] <= max(16, tq_bucket) and c.kwargs["BLOCK_N"] <= max(16, tk_bucket)]
    if role != "dkdv" and tq_bucket >= 512:  # long prefill / training: no decoding tiles
        fit = [c for c in fit if c.kwargs["BLOCK_M"] >= 64] or fit
    return fit or keep[-1:]


def prune_configs(role):
    """The autotuner's early_config_prune for kernel `role` ('fwd' | 'dkdv' | 'dq'): a function
    (configs, named_args, **kwargs) -> the triton.Config list select_configs keeps for the launch's Q (its element
    size and device: the device's shared-memory limit on CUDA, none otherwise), TQ_BUCKET, TK_BUCKET, D_QK and D_V;
    never empty (the last candidate if nothing fits)."""

    def prune(configs, named_args, **kwargs):
        args = {**named_args, **kwargs}
        q = args["Q"]
        arch, limit = device_shared_memory(q.device) if q.is_cuda else (None, None)
        return (
            select_configs(
                role,
                configs,
                args["TQ_BUCKET"],
                args["TK_BUCKET"],
                args["D_QK"],
                args["D_V"],
                q.element_size(),
                arch,
                limit,
            )
            or configs[-1:]
        )

    return prune


def shared_memory_reason(arch, limit, dtype, D_QK, D_V):
    """None if every kernel (fwd, dkdv, dq) has a candidate whose shared_memory_bytes fits `limit` bytes on
    sm_<arch> for `dtype` operands of widths D_QK, D_V; else a sentence naming the kernel that has none."""
    elem = torch.empty((), dtype=dtype).element_size()
    for role in KERNELS:
        need = min(shared_memory_bytes(role, c, D_QK, D_V, elem, arch) for c in CONFIGS[role][head_class(D_QK, D_V)])
        if need > limit:
            return (
                f"no {role} tile of the Triton attention kernel fits sm_{arch}'s {limit:,} bytes of shared memory "
                f"per block for {str(dtype).replace('torch.', '')} at widths {D_QK}/{D_V} (the smallest needs "
                f"{need:,}); use backend='torch' or a 2-byte dtype"
            )
    return None


@torch.compiler.assume_constant_result  # under torch.compile: evaluated once while tracing, a constant
def device_unsupported_reason(device, dtype, D_QK, D_V):
    """None if the kernels can run on CUDA `device` (a torch.device; that device, not the current one) for
    `dtype` operands of widths D_QK, D_V; else why not (shared_memory_reason with its capability and limit).
    Remembered per (device, dtype, D_QK, D_V): eager decoding asks it several times per layer and token, and
    a device's capability and shared memory do not change while the process runs. 'cuda' without an index
    means the current device, as for torch.cuda.get_device_properties."""
    if not isinstance(device, torch.device) or device.index is None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return _device_reason(device, dtype, D_QK, D_V)


@functools.cache
def _device_reason(device, dtype, D_QK, D_V):
    return shared_memory_reason(*device_shared_memory(device), dtype, D_QK, D_V)


def gpu_configs(role):
    """The autotune candidates of `role` on a GPU: both head-dim classes' CONFIGS, as triton.Config, largest first."""
    return [tile_config(*c) for c in sorted(set(CONFIGS[role][64]) | set(CONFIGS[role][128]), reverse=True)]


def _autotune_configs(role):
    return [tile_config(*INTERPRET_BLOCKS[role])] if INTERPRETING else gpu_configs(role)


def _autotune(role):
    # cache_results: the timings go to Triton's cache dir, so later processes on this machine reuse the choice
    return triton.autotune(
        _autotune_configs(role),
        key=["TQ_BUCKET", "TK_BUCKET", "D_QK", "D_V", "CAUSAL", "GROUP", "DOC"],  # DOC: only where passed (documents)
        prune_configs_by={"early_config_prune": prune_configs(role)},
        cache_results=True,
    )


_NO_SPECIALIZE = ["Tq", "Tk", "q_offset", "TQ_BUCKET", "TK_BUCKET"]  # decoding: no recompile per length

# Compile options passed at every launch (and by bench_kernel.compile_kernel). FP fusion (a * b + c as one
# fma, in LLVM and ptxas) is on, as in Triton 3.7; Triton 3.9 warns when it is left to its default, and 3.10
# turns the default off, which would change the kernels' rounding and instruction counts without notice.
COMPILE_OPTIONS = {"enable_fp_fusion": True}


# ---- device code ----------------------------------------------------------------------------------


@triton.jit
def _split_pid(n_blocks, H):
    """The 1-D grid's program id -> (block index, batch b, head h, b * H + h); b, h as int64 (element
    offsets of a row are int64). Blocks of one head are adjacent, so they share its K/V in L2. A 1-D
    grid has room for 2^31 - 1 programs (CUDA's axis 1 only for 65,535)."""
    pid = tl.program_id(0)
    bh = pid // n_blocks
    return pid % n_blocks, (bh // H).to(tl.int64), (bh % H).to(tl.int64), bh.to(tl.int64)


@triton.jit
def _fwd_inner(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    stride_kn,
    stride_vn,
    lo,
    hi,
    offs_m,
    q_offset,
    Tk,
    offs_n0,
    offs_qk,
    offs_v,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    doc_row=None,
    doc_q=None,
    DOC: tl.constexpr = False,
):
    """Online softmax over key blocks [lo, hi). MASKED: the causal diagonal and/or the key boundary, and with DOC
    the document mask (doc_q: the rows' document ids; doc_row: the batch row's (3, Tk) document table)."""
    k_ptrs = k_base + (tl.cast(lo, tl.int64) * stride_kn) + (offs_n0[:, None] * stride_kn + offs_qk[None, :])
    v_ptrs = v_base + (tl.cast(lo, tl.int64) * stride_vn) + (offs_n0[:, None] * stride_vn + offs_v[None, :])
    for start_n in range(lo, hi, BLOCK_N):
        if MASKED:
            offs_n = start_n + offs_n0
            key_ok = offs_n < Tk
            k = tl.load(k_ptrs, mask=key_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # base-2 logits
        if MASKED:
            ok = key_ok[None, :]
            if CAUSAL:
                ok = ok & (offs_n[None, :] <= (offs_m + q_offset)[:, None])
            if DOC:
                doc_k = tl.load(doc_row + offs_n, mask=key_ok, other=-2)
                ok = ok & (doc_q[:, None] == doc_k[None, :])
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
        if DOC:  # a row whose document starts later has seen no key yet: exp2(-inf - -inf) would be NaN
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit
def _key_range(Tk, q_offset, m0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Key blocks a query block starting at row m0 visits: [0, n_full) need no mask, [n_full, hi) need the
    causal and/or key-boundary mask; keys from hi on are masked for every row of the block."""
    if CAUSAL:
        hi = tl.minimum(Tk, q_offset + m0 + BLOCK_M)
        n_full = tl.minimum((q_offset + m0 + 1) // BLOCK_N, Tk // BLOCK_N) * BLOCK_N
    else:
        hi = Tk
        n_full = (Tk // BLOCK_N) * BLOCK_N
    return n_full, hi


@triton.jit
def _doc_key_range(doc_row, Tq, Tk, q_offset, m0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """With documents: the key blocks a query block starting at row m0 visits, (lo, u, n_full, hi): [lo, u) and
    [n_full, hi) need the mask, [u, n_full) none. doc_row: the batch row's (3, Tk) table [document id, first key of
    the document, its end] (document_bounds). The keys visible to rows p0..p1 (positions q_offset + m0 .. the block's
    last row) are first(p0)..p1 (causal; ..end(p1) without): ids are non-decreasing, so the block's documents are
    contiguous and every key in that range is visible to some row; blocks outside it hold no key of its documents.
    [u, n_full) needs no mask where the block is one document: keys from its first to the diagonal (causal)."""
    p0 = q_offset + m0
    p1 = q_offset + tl.minimum(m0 + BLOCK_M, Tq) - 1
    first = tl.load(doc_row + Tk + p0)
    single = tl.load(doc_row + p0) == tl.load(doc_row + p1)
    lo = (first // BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = p1 + 1
        n_full = ((p0 + 1) // BLOCK_N) * BLOCK_N
    else:
        hi = tl.load(doc_row + 2 * Tk + p1)
        n_full = (hi // BLOCK_N) * BLOCK_N
    u = tl.where(single, tl.minimum(((first + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, n_full), n_full)
    return lo, u, n_full, hi


@triton.jit
def _trips(lo, hi, STEP: tl.constexpr):
    """Iterations of range(lo, hi, STEP): the tiles a loop visits (the kernels' COUNT output)."""
    return (tl.maximum(hi - lo, 0) + STEP - 1) // STEP


@_autotune("fwd")
@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_oh,
    stride_om,
    H,
    Tq,
    Tk,
    q_offset,
    TQ_BUCKET,
    TK_BUCKET,
    GROUP: tl.constexpr,
    D_QK: tl.constexpr,
    D_V: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOCS=None,
    TILES=None,
    DOC: tl.constexpr = False,
    COUNT: tl.constexpr = False,
):
    pid_m, b, h, bh = _split_pid(tl.cdiv(Tq, BLOCK_M), H)
    h_kv = h // GROUP
    m0 = pid_m * BLOCK_M
    offs_i = tl.arange(0, BLOCK_M)
    offs_m = m0 + offs_i
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_qk = tl.arange(0, D_QK)
    offs_v = tl.arange(0, D_V)
    row_ok = offs_m < Tq
    q = tl.load(
        Q
        + (b * stride_qb + h * stride_qh + m0.to(tl.int64) * stride_qm)
        + (offs_i[:, None] * stride_qm + offs_qk[None, :]),
        mask=row_ok[:, None],
        other=0.0,
    )
    k_base = K + b * stride_kb + h_kv * stride_kh
    v_base = V + b * stride_vb + h_kv * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, D_V], 0.0, tl.float32)
    if DOC:  # key blocks outside the query block's documents are skipped (_doc_key_range)
        doc_row = DOCS + b * (3 * Tk)
        doc_q = tl.load(doc_row + q_offset + offs_m, mask=row_ok, other=-1)
        lo, u, n_full, hi = _doc_key_range(doc_row, Tq, Tk, q_offset, m0, BLOCK_M, BLOCK_N, CAUSAL)
        acc, l_i, m_i = _fwd_inner(
            acc,
            l_i,
            m_i,
            q,
            k_base,
            v_base,
            stride_kn,
            stride_vn,
            u,
            n_full,
            offs_m,
            q_offset,
            Tk,
            offs_n0,
            offs_qk,
            offs_v,
            CAUSAL,
            False,
            BLOCK_N,
            DOT_PREC,
        )
        acc, l_i, m_i = _fwd_inner(
            acc,
            l_i,
            m_i,
            q,
            k_base,
            v_base,
            stride_kn,
            stride_vn,
            lo,
            u,
            offs_m,
            q_offset,
            Tk,
            offs_n0,
            offs_qk,
            offs_v,
            CAUSAL,
            True,
            BLOCK_N,
            DOT_PREC,
            doc_row,
            doc_q,
            True,
        )
        acc, l_i, m_i = _fwd_inner(
            acc,
            l_i,
            m_i,
            q,
            k_base,
            v_base,
            stride_kn,
            stride_vn,
            n_full,
            hi,
            offs_m,
            q_offset,
            Tk,
            offs_n0,
            offs_qk,
            offs_v,
            CAUSAL,
            True,
            BLOCK_N,
            DOT_PREC,
            doc_row,
            doc_q,
            True,
        )
        n_tiles = _trips(lo, u, BLOCK_N) + _trips(u, n_full, BLOCK_N) + _trips(n_full, hi, BLOCK_N)
    else:
        n_full, hi = _key_range(Tk, q_offset, m0, BLOCK_M, BLOCK_N, CAUSAL)
        acc, l_i, m_i = _fwd_inner(
            acc,
            l_i,
            m_i,
            q,
            k_base,
            v_base,
            stride_kn,
            stride_vn,
            0,
            n_full,
            offs_m,
            q_offset,
            Tk,
            offs_n0,
            offs_qk,
            offs_v,
            CAUSAL,
            False,
            BLOCK_N,
            DOT_PREC,
        )
        acc, l_i, m_i = _fwd_inner(
            acc,
            l_i,
            m_i,
            q,
            k_base,
            v_base,
            stride_kn,
            stride_vn,
            n_full,
            hi,
            offs_m,
            q_offset,
            Tk,
            offs_n0,
            offs_qk,
            offs_v,
            CAUSAL,
            True,
            BLOCK_N,
            DOT_PREC,
        )
        n_tiles = _trips(0, n_full, BLOCK_N) + _trips(n_full, hi, BLOCK_N)
    if COUNT:  # tests and bench_kernel.py: the key blocks this program visited
        tl.store(TILES + tl.program_id(0), n_tiles)
    if DOC:  # a row that saw no key (impossible with document ids, which let a row see itself): o = 0, lse = -inf
        seen = l_i > 0.0
        l_i = tl.where(seen, l_i, 1.0)
        m_i = tl.where(seen, m_i, float("-inf"))
    out = acc / l_i[:, None]
    tl.store(
        O
        + (b * stride_ob + h * stride_oh + m0.to(tl.int64) * stride_om)
        + (offs_i[:, None] * stride_om + offs_v[None, :]),
        out.to(O.dtype.element_ty),
        mask=row_ok[:, None],
    )
    tl.store(LSE + bh * Tq + offs_m, (m_i + tl.log2(l_i)) * _LN2, mask=row_ok)


@triton.jit(do_not_specialize=["Tq"])
def _pre_kernel(
    O,
    DO,
    DI,
    stride_ob,
    stride_oh,
    stride_om,
    stride_dob,
    stride_doh,
    stride_dom,
    H,
    Tq,
    D_V: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    pid_m, b, h, bh = _split_pid(tl.cdiv(Tq, BLOCK_M), H)
    m0 = pid_m * BLOCK_M
    offs_i = tl.arange(0, BLOCK_M)
    offs_v = tl.arange(0, D_V)
    row_ok = m0 + offs_i < Tq
    rows = offs_i[:, None] * stride_om + offs_v[None, :]
    o = tl.load(
        O + (b * stride_ob + h * stride_oh + m0.to(tl.int64) * stride_om) + rows, mask=row_ok[:, None], other=0.0
    )
    rows = offs_i[:, None] * stride_dom + offs_v[None, :]
    do = tl.load(
        DO + (b * stride_dob + h * stride_doh + m0.to(tl.int64) * stride_dom) + rows, mask=row_ok[:, None], other=0.0
    )
    tl.store(DI + bh * Tq + m0 + offs_i, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=row_ok)


@triton.jit
def _dkdv_inner(
    dk,
    dv,
    k,
    v,
    q_base,
    do_base,
    lse_base,
    di_base,
    stride_qm,
    stride_dom,
    lo,
    hi,
    Tq,
    q_offset,
    offs_n,
    offs_m0,
    offs_qk,
    offs_v,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_PREC: tl.constexpr,
    doc_row=None,
    doc_k=None,
    DOC: tl.constexpr = False,
):
    """Accumulate dK, dV (scaled: see _dkdv_kernel) of one key tile over query blocks [lo, hi) of one head. DOC (with
    MASKED): the document mask too, doc_k the keys' document ids, doc_row the batch row's document table."""
    q_ptrs = q_base + tl.cast(lo, tl.int64) * stride_qm + (offs_m0[:, None] * stride_qm + offs_qk[None, :])
    do_ptrs = do_base + tl.cast(lo, tl.int64) * stride_dom + (offs_m0[:, None] * stride_dom + offs_v[None, :])
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + offs_m0
        if MASKED:
            row_ok = offs_m < Tq
            q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
            do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
            lse = tl.load(lse_base + offs_m, mask=row_ok, other=float("inf"))
            di = tl.load(di_base + offs_m, mask=row_ok, other=0.0)
        else:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
            lse = tl.load(lse_base + offs_m)
            di = tl.load(di_base + offs_m)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)  # (BLOCK_N, BLOCK_M) base-2 logits
        p_t = tl.exp2(s_t - (lse * _LOG2E)[None, :])
        if MASKED:
            ok = row_ok[None, :]
            if CAUSAL:
                ok = ok & (offs_n[:, None] <= (offs_m + q_offset)[None, :])
            if DOC:
                doc_q = tl.load(doc_row + q_offset + offs_m, mask=row_ok, other=-1)
                ok = ok & (doc_k[:, None] == doc_q[None, :])
            p_t = tl.where(ok, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PREC)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)
        ds_t = p_t * (dp_t - di[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PREC)
        q_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dom
    return dk, dv


@triton.jit
def _doc_query_range(doc_row, Tq, Tk, q_offset, n0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """With documents: the query blocks the dK/dV program of the key block starting at n0 visits, (lo, mid, full_hi,
    q_hi): [lo, min(mid, q_hi)) and [max(mid, full_hi), q_hi) need the mask, [mid, full_hi) none. The queries that see
    any key n0..n1 of the block are at positions n0 (causal; the first key of n0's document without) up to the end of
    n1's document, all of them the block's documents; unmasked are the blocks of rows that lie in the key block's one
    document and (causal) past its last key."""
    n1 = tl.minimum(n0 + BLOCK_N, Tk) - 1
    single = tl.load(doc_row + n0) == tl.load(doc_row + n1)
    end0 = tl.load(doc_row + 2 * Tk + n0)
    q_hi = tl.minimum(Tq, tl.load(doc_row + 2 * Tk + n1) - q_offset)
    if CAUSAL:
        q_first = n0
        u_first = n0 + BLOCK_N - 1
    else:
        q_first = tl.load(doc_row + Tk + n0)
        u_first = q_first
    lo = (tl.maximum(q_first - q_offset, 0) // BLOCK_M) * BLOCK_M
    mid = ((tl.maximum(u_first - q_offset, 0) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    full_hi = tl.minimum((tl.maximum(end0 - q_offset, 0) // BLOCK_M) * BLOCK_M, (Tq // BLOCK_M) * BLOCK_M)
    return lo, tl.where(single, mid, lo), tl.where(single, full_hi, lo), q_hi


@_autotune("dkdv")
@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DI,
    DK,
    DV,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    H_KV,
    Tq,
    Tk,
    q_offset,
    TQ_BUCKET,
    TK_BUCKET,
    GROUP: tl.constexpr,
    D_QK: tl.constexpr,
    D_V: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOCS=None,
    TILES=None,
    DOC: tl.constexpr = False,
    COUNT: tl.constexpr = False,
):
    pid_n, b, h_kv, _ = _split_pid(tl.cdiv(Tk, BLOCK_N), H_KV)
    n0 = pid_n * BLOCK_N
    offs_j = tl.arange(0, BLOCK_N)
    offs_n = n0 + offs_j
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_qk = tl.arange(0, D_QK)
    offs_v = tl.arange(0, D_V)
    key_ok = offs_n < Tk
    k = tl.load(
        K
        + (b * stride_kb + h_kv * stride_kh + n0.to(tl.int64) * stride_kn)
        + (offs_j[:, None] * stride_kn + offs_qk[None, :]),
        mask=key_ok[:, None],
        other=0.0,
    )
    v = tl.load(
        V
        + (b * stride_vb + h_kv * stride_vh + n0.to(tl.int64) * stride_vn)
        + (offs_j[:, None] * stride_vn + offs_v[None, :]),
        mask=key_ok[:, None],
        other=0.0,
    )
    # A select that changes no value (the load gave 0 past Tk) but makes k a computed value: the wgmma of
    # s_t = k q^T in the loop then reads k from registers (ldmatrix), instead of through one shared-memory
    # descriptor per 16 columns, which Triton 3.9 rebuilds every iteration with vector adds and moves to
    # uniform registers one at a time. sm_90, d = 128, per 128 x 128 block: 4,000 -> 2,920 instructions per
    # warp under Triton 3.9, 2,944 -> 2,512 under 3.7 (docs/kernel.md).
    k = tl.where(key_ok[:, None], k, 0.0)
    dk = tl.full([BLOCK_N, D_QK], 0.0, tl.float32)
    dv = tl.full([BLOCK_N, D_V], 0.0, tl.float32)

    # query blocks: [lo, mid) straddle the causal diagonal (masked), [mid, full_hi) are unmasked,
    # [max(mid, full_hi), Tq) hold the query boundary (masked). Queries before lo see none of these keys.
    if DOC:  # query blocks outside the key block's documents are skipped (_doc_query_range)
        doc_row = DOCS + b * (3 * Tk)
        doc_k = tl.load(doc_row + offs_n, mask=key_ok, other=-2)
        lo, mid, full_hi, q_hi = _doc_query_range(doc_row, Tq, Tk, q_offset, n0, BLOCK_M, BLOCK_N, CAUSAL)
    else:
        doc_row = DOCS
        doc_k = DOCS
        if CAUSAL:
            lo = (tl.maximum(n0 - q_offset, 0) // BLOCK_M) * BLOCK_M
            mid = ((tl.maximum(n0 + BLOCK_N - 1 - q_offset, 0) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
        else:
            lo = 0
            mid = 0
        full_hi = (Tq // BLOCK_M) * BLOCK_M
        q_hi = Tq
    if COUNT:  # tests and bench_kernel.py: the query blocks this program visits per query head
        n_tiles = _trips(mid, full_hi, BLOCK_M) + _trips(lo, tl.minimum(mid, q_hi), BLOCK_M)
        tl.store(TILES + tl.program_id(0), n_tiles + _trips(tl.maximum(mid, full_hi), q_hi, BLOCK_M))
    for g in range(GROUP):  # the query heads that share this key/value head, summed in this program
        h = h_kv * GROUP + g
        bh = b * (H_KV * GROUP) + h
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        lse_base = LSE + bh * Tq
        di_base = DI + bh * Tq
        dk, dv = _dkdv_inner(
            dk,
            dv,
            k,
            v,
            q_base,
            do_base,
            lse_base,
            di_base,
            stride_qm,
            stride_dom,
            mid,
            full_hi,
            Tq,
            q_offset,
            offs_n,
            offs_m0,
            offs_qk,
            offs_v,
            CAUSAL,
            False,
            BLOCK_M,
            DOT_PREC,
        )
        dk, dv = _dkdv_inner(
            dk,
            dv,
            k,
            v,
            q_base,
            do_base,
            lse_base,
            di_base,
            stride_qm,
            stride_dom,
            lo,
            tl.minimum(mid, q_hi),
            Tq,
            q_offset,
            offs_n,
            offs_m0,
            offs_qk,
            offs_v,
            CAUSAL,
            True,
            BLOCK_M,
            DOT_PREC,
            doc_row,
            doc_k,
            DOC,
        )
        dk, dv = _dkdv_inner(
            dk,
            dv,
            k,
            v,
            q_base,
            do_base,
            lse_base,
            di_base,
            stride_qm,
            stride_dom,
            tl.maximum(mid, full_hi),
            q_hi,
            Tq,
            q_offset,
            offs_n,
            offs_m0,
            offs_qk,
            offs_v,
            CAUSAL,
            True,
            BLOCK_M,
            DOT_PREC,
            doc_row,
            doc_k,
            DOC,
        )
    # the scores were base-2 logits s = z / ln 2 (z in nats): dL/ds = ln 2 * dL/dz
    tl.store(
        DK
        + (b * stride_dkb + h_kv * stride_dkh + n0.to(tl.int64) * stride_dkn)
        + (offs_j[:, None] * stride_dkn + offs_qk[None, :]),
        (dk * _LN2).to(DK.dtype.element_ty),
        mask=key_ok[:, None],
    )
    tl.store(
        DV
        + (b * stride_dvb + h_kv * stride_dvh + n0.to(tl.int64) * stride_dvn)
        + (offs_j[:, None] * stride_dvn + offs_v[None, :]),
        dv.to(DV.dtype.element_ty),
        mask=key_ok[:, None],
    )


@triton.jit
def _dq_inner(
    dq,
    q,
    do,
    lse2,
    di,
    k_base,
    v_base,
    stride_kn,
    stride_vn,
    lo,
    hi,
    offs_m,
    q_offset,
    Tk,
    offs_n0,
    offs_qk,
    offs_v,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    doc_row=None,
    doc_q=None,
    DOC: tl.constexpr = False,
):
    """Accumulate dQ (scaled: see _dq_kernel) of one query tile over key blocks [lo, hi); DOC as _fwd_inner."""
    k_ptrs = k_base + (tl.cast(lo, tl.int64) * stride_kn) + (offs_n0[:, None] * stride_kn + offs_qk[None, :])
    v_ptrs = v_base + (tl.cast(lo, tl.int64) * stride_vn) + (offs_n0[:, None] * stride_vn + offs_v[None, :])
    for start_n in range(lo, hi, BLOCK_N):
        if MASKED:
            offs_n = start_n + offs_n0
            key_ok = offs_n < Tk
            k = tl.load(k_ptrs, mask=key_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        p = tl.exp2(s - lse2[:, None])
        if MASKED:
            ok = key_ok[None, :]
            if CAUSAL:
                ok = ok & (offs_n[None, :] <= (offs_m + q_offset)[:, None])
            if DOC:
                doc_k = tl.load(doc_row + offs_n, mask=key_ok, other=-2)
                ok = ok & (doc_q[:, None] == doc_k[None, :])
            p = tl.where(ok, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        ds = p * (dp - di[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PREC)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return dq


@_autotune("dq")
@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def _dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DI,
    DQ,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dqb,
    stride_dqh,
    stride_dqm,
    H,
    Tq,
    Tk,
    q_offset,
    TQ_BUCKET,
    TK_BUCKET,
    GROUP: tl.constexpr,
    D_QK: tl.constexpr,
    D_V: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOCS=None,
    TILES=None,
    DOC: tl.constexpr = False,
    COUNT: tl.constexpr = False,
):
    pid_m, b, h, bh = _split_pid(tl.cdiv(Tq, BLOCK_M), H)
    h_kv = h // GROUP
    m0 = pid_m * BLOCK_M
    offs_i = tl.arange(0, BLOCK_M)
    offs_m = m0 + offs_i
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_qk = tl.arange(0, D_QK)
    offs_v = tl.arange(0, D_V)
    row_ok = offs_m < Tq
    q = tl.load(
        Q
        + (b * stride_qb + h * stride_qh + m0.to(tl.int64) * stride_qm)
        + (offs_i[:, None] * stride_qm + offs_qk[None, :]),
        mask=row_ok[:, None],
        other=0.0,
    )
    do = tl.load(
        DO
        + (b * stride_dob + h * stride_doh + m0.to(tl.int64) * stride_dom)
        + (offs_i[:, None] * stride_dom + offs_v[None, :]),
        mask=row_ok[:, None],
        other=0.0,
    )
    lse2 = tl.load(LSE + bh * Tq + offs_m, mask=row_ok, other=float("inf")) * _LOG2E
    di = tl.load(DI + bh * Tq + offs_m, mask=row_ok, other=0.0)
    k_base = K + b * stride_kb + h_kv * stride_kh
    v_base = V + b * stride_vb + h_kv * stride_vh

    dq = tl.full([BLOCK_M, D_QK], 0.0, tl.float32)
    if DOC:  # the forward's key blocks (_doc_key_range)
        doc_row = DOCS + b * (3 * Tk)
        doc_q = tl.load(doc_row + q_offset + offs_m, mask=row_ok, other=-1)
        lo, u, n_full, hi = _doc_key_range(doc_row, Tq, Tk, q_offset, m0, BLOCK_M, BLOCK_N, CAUSAL)
        dq = _dq_inner(
            dq,
            q,
            do,
            lse2,
            di,
            k_base,
            v_base,
            stride_kn,
            stride_vn,
            u,
            n_full,
            offs_m,
            q_offset,
            Tk,
            offs_n0,
            offs_qk,
            offs_v,
            CAUSAL,
            False,
            BLOCK_N,
            DOT_PREC,
        )
        dq = _dq_inner(
            dq,
            q,
            do,
            lse2,
            di,
            k_base,
            v_base,
            stride_kn,
            stride_vn,
            lo,
            u,
            offs_m,
            q_offset,
            Tk,
            offs_n0,
            offs_qk,
            offs_v,
            CAUSAL,
            True,
            BLOCK_N,
            DOT_PREC,
            doc_row,
            doc_q,
            True,
        )
        dq = _dq_inner(
            dq,
            q,
            do,
            lse2,
            di,
            k_base,
            v_base,
            stride_kn,
            stride_vn,
            n_full,
            hi,
            offs_m,
            q_offset,
            Tk,
            offs_n0,
            offs_qk,
            offs_v,
            CAUSAL,
            True,
            BLOCK_N,
            DOT_PREC,
            doc_row,
            doc_q,
            True,
        )
        n_tiles = _trips(lo, u, BLOCK_N) + _trips(u, n_full, BLOCK_N) + _trips(n_full, hi, BLOCK_N)
    else:
        n_full, hi = _key_range(Tk, q_offset, m0, BLOCK_M, BLOCK_N, CAUSAL)
        dq = _dq_inner(
            dq,
            q,
            do,
            lse2,
            di,
            k_base,
            v_base,
            stride_kn,
            stride_vn,
            0,
            n_full,
            offs_m,
            q_offset,
            Tk,
            offs_n0,
            offs_qk,
            offs_v,
            CAUSAL,
            False,
            BLOCK_N,
            DOT_PREC,
        )
        dq = _dq_inner(
            dq,
            q,
            do,
            lse2,
            di,
            k_base,
            v_base,
            stride_kn,
            stride_vn,
            n_full,
            hi,
            offs_m,
            q_offset,
            Tk,
            offs_n0,
            offs_qk,
            offs_v,
            CAUSAL,
            True,
            BLOCK_N,
            DOT_PREC,
        )
        n_tiles = _trips(0, n_full, BLOCK_N) + _trips(n_full, hi, BLOCK_N)
    if COUNT:  # tests and bench_kernel.py: the key blocks this program visited
        tl.store(TILES + tl.program_id(0), n_tiles)
    tl.store(
        DQ
        + (b * stride_dqb + h * stride_dqh + m0.to(tl.int64) * stride_dqm)
        + (offs_i[:, None] * stride_dqm + offs_qk[None, :]),
        (dq * _LN2).to(DQ.dtype.element_ty),
        mask=row_ok[:, None],
    )


# The kernels by role, as public names (bench_kernel.py compiles them for a part without a GPU; the tests launch
# and inspect them). KERNELS: the autotuned kernels, triton Autotuner objects whose .fn is the @triton.jit
# function; runtime arguments as their signatures, constexprs GROUP (query heads per key/value head), D_QK, D_V
# (widths), CAUSAL, DOT_PREC ('tf32' | 'ieee', dot_precision), BLOCK_M, BLOCK_N (a tile_config; the autotuner
# sets them). PRE_KERNEL: Di = rowsum(dO * O), a @triton.jit function with constexprs D_V and BLOCK_M
# (PRE_BLOCK_M), not autotuned. DECODE_KERNEL (below): the decoding kernel.
KERNELS = {"fwd": _fwd_kernel, "dkdv": _dkdv_kernel, "dq": _dq_kernel}
PRE_KERNEL = _pre_kernel


# ---- tile pinning -------------------------------------------------------------------------------------


def pinned_configs(spec=None):
    """Parse a tile pin, by default the environment variable POPE_TRITON_CONFIG.

    Format: "fwd=128,64,8,3;dkdv=64,128,8,3;dq=128,64,8,3" (BLOCK_M, BLOCK_N, num_warps, num_stages per
    kernel; any subset of the three). Returns {role: (bm, bn, warps, stages)}. Raises ValueError for a
    malformed value: BLOCK_M, BLOCK_N must be powers of two in 16..128.
    """
    spec = (os.environ.get(PIN_ENV, "") if spec is None else spec).strip()
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        role, _, vals = item.partition("=")
        try:
            cfg = tuple(int(x) for x in vals.split(","))
        except ValueError:
            cfg = ()
        ok = (
            role.strip() in KERNELS
            and len(cfg) == 4
            and all(b in (16, 32, 64, 128) for b in cfg[:2])
            and cfg[2] in (1, 2, 4, 8, 16)
            and cfg[3] >= 1
        )
        if not ok:
            raise ValueError(
                f"{PIN_ENV}={spec!r}: expected e.g. 'fwd=128,64,8,3;dkdv=64,128,8,3;dq=128,64,8,3' "
                "(BLOCK_M,BLOCK_N,num_warps,num_stages per kernel; blocks in 16..128, powers of two)"
            )
        out[role.strip()] = cfg
    return out


def pin_configs(spec):
    """Run the kernels named in `spec` (pinned_configs' format) with those tiles only, not autotuned, so every
    process and DDP rank computes bitwise the same results. Applied at import to POPE_TRITON_CONFIG.
    Returns the previous {role: list of triton.Config} of the kernels it changed (to restore them)."""
    before = {}
    for role, cfg in pinned_configs(spec).items():
        before[role] = KERNELS[role].configs
        KERNELS[role].configs = [tile_config(*cfg)]
    return before


pin_configs(os.environ.get(PIN_ENV, ""))


# ---- host side ----------------------------------------------------------------------------------------


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


def dot_precision(dtype):
    """tl.dot input precision for operands of `dtype`: fp32 uses IEEE fp32 unless torch allows TF32 matmuls."""
    if dtype == torch.float32 and not _fp32_matmul_allows_tf32():
        return "ieee"
    return "tf32"  # ignored for fp16 / bf16 operands


def check_limits(B, H, Tq, Tk, q_offset, row_strides):
    """Raise ValueError for a launch the kernels cannot address.

    Positions q_offset + Tq and Tk must fit int32 (the causal mask); the 1-D grid holds at most 2^31 - 1
    programs (B * H * ceil(T / 16) at the smallest tile; B * H beyond CUDA's 65,535 is fine); element offsets
    of a row are int64 but in-tile offsets (up to 128 rows x row stride) int32, so row strides (elements)
    must stay below 2^24.
    """
    if q_offset + Tq > MAX_POSITION or Tk > MAX_POSITION:
        raise ValueError(
            f"positions up to {max(q_offset + Tq, Tk)} tokens exceed the kernel's int32 positions "
            f"(max {MAX_POSITION}); use backend='torch'"
        )
    n_programs = B * H * triton.cdiv(max(Tq, Tk, 1), 16)
    if n_programs > 2**31 - 1:
        raise ValueError(
            f"B * H * ceil(T / 16) = {n_programs} programs exceed the 1-D grid limit 2^31 - 1; "
            "split the batch into smaller calls"
        )
    bad = [s for s in row_strides if s * 128 >= 2**31]
    if bad:
        raise ValueError(
            f"row stride {bad[0]} elements: the kernels keep in-tile offsets (128 rows x stride) in "
            "int32, so row strides must be < 2^24 elements; pass contiguous (B, H, T, d) tensors"
        )


def _device(t):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _check_supported(q, k, v):
    """Raise unsupported_reason's ValueError at a launch: the custom ops take unchecked inputs, and a width Triton
    cannot compile (a tl.dot needs K >= 16 on NVIDIA: a value width of 8 failed the H200's backward) runs in the
    interpreter, so without this a CPU test passes what a GPU refuses."""
    reason = unsupported_reason(q, k, v)
    if reason is not None:
        raise ValueError(reason)


def _meta(q, k, v, causal):
    return dict(
        GROUP=q.shape[1] // k.shape[1],
        D_QK=q.shape[-1],
        D_V=v.shape[-1],
        CAUSAL=bool(causal),
        DOT_PREC=dot_precision(q.dtype),
    )


def _strides(*tensors):
    return [s for t in tensors for s in t.stride()[:3]]


def _unit_rows(*tensors):
    """The tensors with a unit last stride (a copy of those without): the kernels take any other strides."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def _doc_args(docs, tiles):
    """The launch's extra keyword arguments for a document table (document_bounds) and a COUNT buffer: none without
    them, so a launch without documents is today's, argument for argument."""
    extra = {}
    if docs is not None:
        extra.update(DOCS=docs, DOC=True)
    if tiles is not None:
        extra.update(TILES=tiles, COUNT=True)
    return extra


def launch_forward(q, k, v, causal, q_offset, docs=None, tiles=None):
    """Launch the forward kernel: q (B, H, Tq, D_QK) pre-scaled, k (B, H_kv, Tk, D_QK), v (B, H_kv, Tk, D_V), any
    strides (copied where the last one is not 1) -> (o (B, H, Tq, D_V) in v's dtype, lse (B, H, Tq) float32, nats),
    contiguous. docs: None or document_bounds' table; tiles: None or {'fwd': an int32 buffer with an entry per program},
    into which the kernel writes the key tiles each program visits (tests, bench_kernel.py; with docs). Checks shapes,
    widths and dtypes (unsupported_reason: a width the GPU cannot compile raises here, not only on a GPU) and
    check_limits; attention also checks q_offset and document ids. For benchmarks, tests and the custom ops."""
    B, H, Tq, _ = q.shape
    Tk = k.shape[2]
    q, k, v = _unit_rows(q, k, v)
    o = torch.empty((B, H, Tq, v.shape[-1]), device=q.device, dtype=v.dtype)  # contiguous: the layout contract
    lse = torch.empty((B, H, Tq), device=q.device, dtype=torch.float32)
    if Tq == 0 or B * H == 0:
        return o, lse
    _check_supported(q, k, v)
    check_limits(B, H, Tq, Tk, q_offset, (q.stride(2), k.stride(2), v.stride(2), o.stride(2)))
    with _device(q):
        _fwd_kernel[lambda m: (triton.cdiv(Tq, m["BLOCK_M"]) * B * H,)](
            q,
            k,
            v,
            o,
            lse,
            *_strides(q, k, v, o),
            H,
            Tq,
            Tk,
            q_offset,
            pow2_bucket(Tq),
            pow2_bucket(Tk),
            **_meta(q, k, v, causal),
            **_doc_args(docs, (tiles or {}).get("fwd")),
            **COMPILE_OPTIONS,
        )
    return o, lse


def launch_backward(do, q, k, v, o, lse, causal, q_offset, docs=None, tiles=None):
    """Launch the backward kernels (Di, dK/dV, dQ) for launch_forward's (o, lse) and the output gradient do ->
    (dq, dk, dv) contiguous, in q's, k's, v's dtype. docs and tiles as launch_forward ({'dkdv': buffer, 'dq': buffer}
    for tiles). Checked as launch_forward; attention_backward is the custom op around it."""
    B, H, Tq, _ = q.shape
    H_kv, Tk = k.shape[1], k.shape[2]
    q, k, v, o, do = _unit_rows(q, k, v, o, do.to(v.dtype))
    lse = lse.contiguous()  # the kernels index lse and Di as (B * H, Tq) rows
    dq, dk, dv = (torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in (q, k, v))  # contiguous
    if Tq == 0 or B * H == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    _check_supported(q, k, v)
    check_limits(B, H, Tq, Tk, q_offset, (q.stride(2), k.stride(2), v.stride(2), o.stride(2), do.stride(2)))
    di = torch.empty((B, H, Tq), device=q.device, dtype=torch.float32)
    meta = _meta(q, k, v, causal)
    buckets = (pow2_bucket(Tq), pow2_bucket(Tk))
    with _device(q):
        _pre_kernel[(triton.cdiv(Tq, PRE_BLOCK_M) * B * H,)](
            o, do, di, *_strides(o, do), H, Tq, D_V=v.shape[-1], BLOCK_M=PRE_BLOCK_M, **COMPILE_OPTIONS
        )
        _dkdv_kernel[lambda m: (triton.cdiv(Tk, m["BLOCK_N"]) * B * H_kv,)](
            q,
            k,
            v,
            do,
            lse,
            di,
            dk,
            dv,
            *_strides(q, k, v, do, dk, dv),
            H_kv,
            Tq,
            Tk,
            q_offset,
            *buckets,
            **meta,
            **_doc_args(docs, (tiles or {}).get("dkdv")),
            **COMPILE_OPTIONS,
        )
        _dq_kernel[lambda m: (triton.cdiv(Tq, m["BLOCK_M"]) * B * H,)](
            q,
            k,
            v,
            do,
            lse,
            di,
            dq,
            *_strides(q, k, v, do, dq),
            H,
            Tq,
            Tk,
            q_offset,
            *buckets,
            **meta,
            **_doc_args(docs, (tiles or {}).get("dq")),
            **COMPILE_OPTIONS,
        )
    return dq, dk, dv


def document_bounds(document_ids):
    """The kernels' document table: document_ids (B, Tk) int32, non-decreasing along Tk -> (B, 3, Tk) int32, per key
    s its document id, the first key of its document and the end of its document (one past its last key).

    Computed per call in PyTorch (two batched searchsorted, no host sync; Inductor fuses or runs them as one op each).
    It does not depend on the tiles, which the autotuner picks after it: each program reads the entries of its own
    first and last row (fwd, dq) or key (dK/dV) and gets the range of tiles to visit (docs/kernel.md)."""
    ids = document_ids.contiguous()
    first = torch.searchsorted(ids, ids, out_int32=True)
    end = torch.searchsorted(ids, ids, right=True, out_int32=True)
    return torch.stack((ids, first, end), dim=1)


def visited_tiles(document_ids, Tq, BLOCK_M, BLOCK_N, causal=True, q_offset=0, role="fwd"):
    """The tiles the kernels visit for one batch row with documents, by formula (the COUNT output must equal it).

    document_ids: Tk ints, non-decreasing (one batch row, e.g. a list); query row i sits at position q_offset + i
    (q_offset + Tq <= Tk). role 'fwd' or 'dq': a list over query blocks of BLOCK_M rows of the key blocks (BLOCK_N
    keys) each visits; 'dkdv': a list over key blocks of the query blocks each visits per query head.

    The formula, with s(p) the first key and e(p) the end (one past the last key) of position p's document:
        query block of rows a..b (positions P_a = q_offset + a, P_b = q_offset + b) visits
            floor(P_b / BLOCK_N) - floor(s(P_a) / BLOCK_N) + 1           key blocks (causal),
            ceil(e(P_b) / BLOCK_N) - floor(s(P_a) / BLOCK_N)             (not causal);
        key block of keys n0..n1 visits the query blocks that meet rows lo..hi - 1,
            lo = max(n0 - q_offset, 0) (causal; s(n0) - q_offset without), hi = min(Tq, e(n1) - q_offset).
    Both count the (query block, key block) pairs that hold at least one visible (query, key) pair: the union over
    documents of each document's causal tile triangle {(I, J): I and J meet the document, and J's first key of it
    is <= I's last row of it}. Where no block holds rows or keys of two documents (documents of n whole blocks,
    BLOCK_M = BLOCK_N) the union is disjoint: sum over documents of n (n + 1) / 2 (causal). Hand-worked, 12 keys,
    BLOCK_M = BLOCK_N = 4, documents [0, 5) and [5, 12): query blocks visit 1 (rows 0-3: keys 0-3), 2 (rows 4-7:
    s(4) = 0, keys 0-7), 2 (rows 8-11: s(8) = 5, keys 4-11) key blocks, 5 in all, against causal's 6; the two
    triangles (3 blocks each) share block (1, 1), which holds key 4 of the first document and rows 5-7 of the second.
    """
    import bisect

    ids = [int(x) for x in document_ids]
    Tk = len(ids)

    def first(p):
        return bisect.bisect_left(ids, ids[p])

    def end(p):
        return bisect.bisect_right(ids, ids[p])

    out = []
    if role in ("fwd", "dq"):
        for a in range(0, Tq, BLOCK_M):
            pa, pb = q_offset + a, q_offset + min(a + BLOCK_M, Tq) - 1
            hi_block = pb // BLOCK_N + 1 if causal else -(-end(pb) // BLOCK_N)
            out.append(hi_block - first(pa) // BLOCK_N)
        return out
    for n0 in range(0, Tk, BLOCK_N):
        n1 = min(n0 + BLOCK_N, Tk) - 1
        lo = max((n0 if causal else first(n0)) - q_offset, 0)
        hi = min(Tq, end(n1) - q_offset)
        out.append(max(-(-hi // BLOCK_M) - lo // BLOCK_M, 0) if hi > lo else 0)
    return out


def document_ids_reason(document_ids, q, k, q_offset):
    """None if document_ids fits the kernels for q (B, H, Tq, .), k (B, H_kv, Tk, .) at q_offset, else a one-line
    reason: document_ids must be a (B, Tk) int32 tensor on q's device and cover the queries (q_offset + Tq <= Tk),
    and 3 Tk < 2^31 (int32 offsets into the document table).
    Whether the ids are non-decreasing is not checked here (a host sync): pope.pope_attention checks it."""
    B, Tq, Tk = q.shape[0], q.shape[2], k.shape[2]
    if not isinstance(document_ids, torch.Tensor) or document_ids.shape != (B, Tk):
        shape = tuple(document_ids.shape) if isinstance(document_ids, torch.Tensor) else type(document_ids).__name__
        return f"document_ids must be (B, Tk) = ({B}, {Tk}) (one id per key), got {shape}"
    if document_ids.dtype != torch.int32:
        return f"document_ids must be int32, got {document_ids.dtype}; pass document_ids.int()"
    if document_ids.device != q.device:
        return f"document_ids must be on q's device {q.device}, got {document_ids.device}"
    if q_offset + Tq > Tk:
        return f"with document_ids the queries need ids: q_offset + Tq = {q_offset + Tq} must be <= Tk = {Tk}"
    if 3 * Tk >= 2**31:  # the kernels index the (3, Tk) row of document_bounds' table in int32
        return f"with document_ids Tk = {Tk} keys must be < 2^31 / 3 (int32 offsets into the document table)"
    return None


# ---- torch.library custom ops (torch.compile keeps each as one graph node) ----------------------------


@torch.library.custom_op("pope::attention_forward", mutates_args=())
def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, q_offset: int, docs: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel on checked inputs (see attention) -> (o (B, H, Tq, D_V), lse (B, H, Tq) float32, nats).
    docs: None, or the (B, 3, Tk) int32 document table of document_bounds (the block-causal mask).

    Layout contract (module docstring): any input strides; o and lse are contiguous."""
    return launch_forward(q, k, v, causal, q_offset, docs)


@attention_forward.register_fake
def _(q, k, v, causal, q_offset, docs=None):
    B, H, Tq, _ = q.shape
    return q.new_empty((B, H, Tq, v.shape[-1]), dtype=v.dtype), q.new_empty((B, H, Tq), dtype=torch.float32)


@torch.library.custom_op("pope::attention_backward", mutates_args=())
def attention_backward(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    q_offset: int,
    docs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward kernels: dO and the forward's (o, lse) -> (dq, dk, dv) of attention_forward's o (docs: the
    forward's document table or None).

    Layout contract (module docstring): any input strides; dq, dk, dv are contiguous (never q's, k's, v's
    strides)."""
    return launch_backward(do, q, k, v, o, lse, causal, q_offset, docs)


@attention_backward.register_fake
def _(do, q, k, v, o, lse, causal, q_offset, docs=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the real op's


def _setup_context(ctx, inputs, output):
    q, k, v, causal, q_offset, *docs = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, *docs)
    ctx.args = (causal, q_offset)
    ctx.mark_non_differentiable(lse)


def _backward_formula(ctx, do, dlse):
    q, k, v, o, lse, *docs = ctx.saved_tensors  # read once: a checkpoint's saved tensors unpack once
    n_docs = len(docs)  # 1 where the forward had a docs argument (None or a table), else 0
    docs = [t for t in docs if t is not None]  # without documents: today's call, argument for argument
    dq, dk, dv = attention_backward(do, q, k, v, o, lse, *ctx.args, *docs)
    return (dq, dk, dv, None, None) + (None,) * n_docs


attention_forward.register_autograd(_backward_formula, setup_context=_setup_context)


# ---- public entry point -----------------------------------------------------------------------------


def unsupported_reason(q, k, v):
    """None if the kernels handle these (B, H, T, D) tensors, else a sentence saying why not.

    Supported: q (B, H, Tq, D_QK), k (B, H_kv, Tk, D_QK), v (B, H_kv, Tk, D_V) with H a multiple of H_kv,
    D_QK in QK_DIMS = (16, ..., 256), D_V in V_DIMS = (16, ..., 128), one dtype among float16, bfloat16,
    float32, and Tk >= 1. The device is not checked (see attention).
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return f"q, k, v must be 4-D (B, H, T, D), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    (B, H, _, D_QK), (Bk, H_kv, Tk, Dk), (Bv, Hv, Tv, D_V) = q.shape, k.shape, v.shape
    if not (B == Bk == Bv and Dk == D_QK and (Hv, Tv) == (H_kv, Tk) and H_kv >= 1 and H % H_kv == 0):
        return (
            f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; expected q (B, H, Tq, "
            "D_QK), k (B, H_kv, Tk, D_QK), v (B, H_kv, Tk, D_V) with H a multiple of H_kv"
        )
    if D_QK not in QK_DIMS or D_V not in V_DIMS:
        return (
            f"the Triton attention kernel supports query/key widths {QK_DIMS} and value widths {V_DIMS}, got "
            f"{D_QK} and {D_V}; use backend='torch' for other head dims"
        )
    if not q.dtype == k.dtype == v.dtype or q.dtype not in DTYPES:
        return (
            f"the Triton attention kernel supports float16, bfloat16 and float32 (one dtype for q, k, v), got "
            f"{q.dtype}, {k.dtype}, {v.dtype}; use backend='torch'"
        )
    if Tk < 1:
        return "the Triton attention kernel needs at least one key (Tk >= 1)"
    return None


def attention(q, k, v, *, causal=True, q_offset=0, document_ids=None):
    """Softmax attention of pre-scaled queries: O = softmax(ln 2 * q k^T) v, with the FlashAttention-2 kernels.

    Args:
        q: (B, H, Tq, D_QK) queries multiplied by sm_scale * log2(e) (for PoPE, the Cartesian q~ of pope.py).
        k: (B, H_kv, Tk, D_QK) keys; H a multiple of H_kv (query head h reads key/value head h // (H / H_kv)).
        v: (B, H_kv, Tk, D_V) values.
        causal: query i (absolute position q_offset + i tokens) sees keys j <= q_offset + i.
        q_offset: tokens, >= 0 (Tk - Tq when decoding with a KV cache).
        document_ids: None, or (B, Tk) int32 on q's device, non-decreasing along Tk (not checked here): query i
            has the id document_ids[:, q_offset + i] (q_offset + Tq <= Tk) and sees only keys of its own id (and,
            causal, j <= q_offset + i): block-causal. Blocks that hold no key of a query block's documents are
            skipped (document_bounds, visited_tiles; docs/kernel.md).
    Any strides with a contiguous last dim (others are copied). CUDA tensors, or CPU tensors when the
    interpreter was chosen at import (INTERPRETING).

    Returns:
        (o (B, H, Tq, D_V) in v's dtype, lse (B, H, Tq) float32): lse is logsumexp_j(ln 2 * q_i . k_j) in
        nats, not differentiable. o is differentiable in q, k and v (custom ops pope::attention_forward /
        pope::attention_backward). fp32 dots are IEEE fp32 unless torch allows TF32 matmuls (dot_precision).

    Limits and determinism: check_limits; with one set of tiles every output is bitwise reproducible
    (dK, dV of a key/value head sum over its query heads inside one program); the autotuner may pick other
    tiles in another process (then dq, dk differ in the last bits); POPE_TRITON_CONFIG pins them.

    Raises:
        ValueError: unsupported shapes or dtypes (unsupported_reason), q_offset < 0, document_ids of the wrong
            shape, dtype or device (document_ids_reason), CPU tensors without
            the interpreter, tensors on different devices, a GPU whose shared memory no tile fits
            (device_unsupported_reason), or the limits of check_limits.
    """
    reason = unsupported_reason(q, k, v)
    if reason is not None:
        raise ValueError(reason)
    if q_offset < 0:
        raise ValueError(f"q_offset must be >= 0 (absolute position of the first query), got {q_offset}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not q.is_cuda and not INTERPRETING:
        raise ValueError(
            f"the Triton kernel needs CUDA tensors, got device {q.device}. Use backend='auto' or "
            "'torch' on CPU, or set TRITON_INTERPRET=1 before importing pope_kernel to run the kernel "
            "in the (slow) Triton interpreter, e.g. for tests"
        )
    reason = device_unsupported_reason(q.device, q.dtype, q.shape[-1], v.shape[-1]) if q.is_cuda else None
    if reason is not None:
        raise ValueError(reason)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if document_ids is None:
        return attention_forward(q, k, v, bool(causal), int(q_offset))
    reason = document_ids_reason(document_ids, q, k, q_offset)
    if reason is not None:
        raise ValueError(reason)
    return attention_forward(q, k, v, bool(causal), int(q_offset), document_bounds(document_ids))


# ---- decoding: a few queries over a long cache of magnitudes (flash-decoding) --------------------------
# The KV cache holds each key's magnitude mu_k (width D) instead of its Cartesian form (width 2D); the
# query carries the phase bias: q~ = [mu_q cos(t theta - delta), mu_q sin(t theta - delta)] (pope.py), and
# q~ . [mu_k cos(s theta), mu_k sin(s theta)] = mu_q mu_k cos((s - t) theta + delta), the training score.
# A key's rotation e^{i s theta} is the same for every head, layer and batch row. The kernel forms it from
# the rotation table ROT (T_max, 2D) = [cos(s theta) | sin(s theta)] (float32, phases in float64) by the
# angle-addition formula, e^{i (s0 + j) theta} = e^{i s0 theta} e^{i j theta}: one table row per key tile
# (s0, the tile's first key) and the table's first BLOCK_N rows (j < BLOCK_N, the same for every tile and
# so cached on chip). The table costs 8 D / BLOCK_N bytes per key from memory, against 2 D for mu_k
# in 16-bit; a whole-table read would cost 8 D, four times mu_k, unless L2 held it.
# One program takes one (batch row, key/value head, split of the cache): its rows are the GROUP query
# heads times Tq queries of that key/value head, so each key/value tile is loaded once for the whole group
# (no copies of k and v). The splits run in parallel and a log-sum-exp merge joins them (flash-decoding).
DECODE_BLOCK_N = 16 if INTERPRETING else 64  # keys per tile; small under the interpreter so tests cross tiles
DECODE_WARPS = 8  # 4 warps hold 229-255 registers a thread and spill at d = 128 (bench_kernel.py --decode-sass)
DECODE_MAX_ROWS = 64  # GROUP * Tq query rows per program; more goes to the prefill kernels
DECODE_MIN_BLOCKS = 4  # key tiles per split at least: shorter splits cost more in the merge than they give
DECODE_PROGRAMS_PER_SM = 2
DEFAULT_SM_COUNT = 132  # H100 SXM, for tables made without a GPU


@triton.jit(do_not_specialize=["Tq", "Tk", "q_offset", "blocks_per_split"])
def _decode_kernel(
    Q,
    MU,
    V,
    ROT,
    OP,
    LP,
    QOFF,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_rot,
    BH_KV,
    H_KV,
    Tq,
    Tk,
    q_offset,
    blocks_per_split,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    D_V: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    OFFSET_FROM_PTR: tl.constexpr = False,
):
    """One (split, batch row, key/value head): partial softmax of its GROUP * Tq query rows over the keys
    [split * blocks_per_split * BLOCK_N, ...) -> OP (n_split, B, H, Tq, D_V) float32 (normalised within the
    split; 0 where it sees no key) and LP (n_split, B, H, Tq) base-2 logsumexp (-inf where it sees no key).
    Split-major grid: the programs that run together read the same rotation rows. OFFSET_FROM_PTR: q_offset is
    read from QOFF (an int64 tensor on the device: the static decoding step's position, no host sync)."""
    if OFFSET_FROM_PTR:
        q_offset = tl.load(QOFF).to(tl.int32)
    pid = tl.program_id(0)
    split = pid // BH_KV
    bh = pid % BH_KV
    b, h_kv = (bh // H_KV).to(tl.int64), (bh % H_KV).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    g, i = rows // Tq, rows % Tq
    row_ok = rows < GROUP * Tq
    offs_d = tl.arange(0, D)
    offs_v = tl.arange(0, D_V)
    offs_n0 = tl.arange(0, BLOCK_N)
    q_rows = b * stride_qb + (h_kv * GROUP + g).to(tl.int64) * stride_qh + i.to(tl.int64) * stride_qm
    qx = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    qy = tl.load(Q + q_rows[:, None] + (D + offs_d)[None, :], mask=row_ok[:, None], other=0.0)
    q_pos = q_offset + i
    lo = split * blocks_per_split * BLOCK_N
    hi = tl.minimum(lo + blocks_per_split * BLOCK_N, Tk)
    if CAUSAL:
        hi = tl.minimum(hi, q_offset + Tq)
    k_ptrs = (
        MU
        + b * stride_kb
        + h_kv * stride_kh
        + (tl.cast(lo, tl.int64) * stride_kn + (offs_n0[:, None] * stride_kn + offs_d[None, :]))
    )
    v_ptrs = (
        V
        + b * stride_vb
        + h_kv * stride_vh
        + (tl.cast(lo, tl.int64) * stride_vn + (offs_n0[:, None] * stride_vn + offs_v[None, :]))
    )
    fine = ROT + offs_n0[:, None] * stride_rot + offs_d[None, :]  # e^{i j theta}, j < BLOCK_N
    fine_ok = (offs_n0 < Tk)[:, None]  # a table shorter than BLOCK_N: rows past it meet no key
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, D_V], 0.0, tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        key_ok = offs_n < hi
        mu = tl.load(k_ptrs, mask=key_ok[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
        coarse = ROT + tl.cast(start_n, tl.int64) * stride_rot + offs_d  # e^{i s0 theta}
        cc, sc = tl.load(coarse)[None, :], tl.load(coarse + D)[None, :]
        cf = tl.load(fine, mask=fine_ok, other=0.0)
        sf = tl.load(fine + D, mask=fine_ok, other=0.0)
        kx = (mu * (cc * cf - sc * sf)).to(qx.dtype)  # mu cos((s0 + j) theta)
        ky = (mu * (sc * cf + cc * sf)).to(qx.dtype)  # mu sin((s0 + j) theta)
        s = tl.dot(
            qy, tl.trans(ky), tl.dot(qx, tl.trans(kx), input_precision=DOT_PREC), input_precision=DOT_PREC
        )  # base-2 logits
        ok = key_ok[None, :]
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    out_rows = ((split * BH_KV + bh) * GROUP + g).to(tl.int64) * Tq + i
    tl.store(
        OP + out_rows[:, None] * D_V + offs_v[None, :],
        acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None],
        mask=row_ok[:, None],
    )
    seen = l_i > 0.0  # l_i >= 1 once a row has seen a key
    tl.store(LP + out_rows, tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf")), mask=row_ok)


# The decoding kernel (a @triton.jit function, not autotuned: decode launches it with BLOCK_N = DECODE_BLOCK_N,
# BLOCK_M = max(16, pow2_bucket(G * Tq)), num_warps = DECODE_WARPS). Constexprs: GROUP (query heads per key/value
# head, G), D (key magnitude width d; queries are 2d wide), D_V, CAUSAL, DOT_PREC (dot_precision), BLOCK_M (query
# rows G * Tq of a program, a power of two >= 16), BLOCK_N (keys per tile), OFFSET_FROM_PTR (q_offset read from
# QOFF on the device: decode_at). bench_kernel.compile_decode compiles it for a part without a GPU.
DECODE_KERNEL = _decode_kernel


def decode_splits(bh_kv, Tk, n_sm=DEFAULT_SM_COUNT, block_n=None):
    """(n_split, blocks_per_split): how decode cuts a cache of Tk keys for bh_kv = B * H_kv programs per split.

    Enough splits for DECODE_PROGRAMS_PER_SM programs on each of n_sm multiprocessors, but at least
    DECODE_MIN_BLOCKS key tiles of block_n (DECODE_BLOCK_N) keys per split; then the tiles are dealt out evenly,
    so no split is empty and only the last one is ragged. bh_kv >= n_sm * DECODE_PROGRAMS_PER_SM or a short
    cache gives one split (no merge)."""
    block_n = block_n or DECODE_BLOCK_N
    n_blocks = max(triton.cdiv(Tk, block_n), 1)
    want = triton.cdiv(DECODE_PROGRAMS_PER_SM * n_sm, max(bh_kv, 1))
    n_split = max(1, min(want, n_blocks // DECODE_MIN_BLOCKS))
    per = triton.cdiv(n_blocks, n_split)
    return triton.cdiv(n_blocks, per), per


def decode_split_table(
    bh_kvs=(1, 2, 4, 8, 16, 32, 64),
    seq_lens=(4096, 8192, 16384, 32768, 65536, 131072),
    n_sm=DEFAULT_SM_COUNT,
    block_n=64,
):
    """Markdown table of decode_splits' n_split for B * H_kv = bh_kvs (rows) at Tk = seq_lens (columns), n_sm
    multiprocessors (132: H100 SXM), block_n keys per tile (64: the GPU tile). docs/kernel.md prints it."""
    head = "| B·H_kv | " + " | ".join(f"{t // 1024}k" for t in seq_lens) + " |"
    lines = [head, "|" + "---|" * (len(seq_lens) + 1)]
    for bh in bh_kvs:
        lines.append(f"| {bh} | " + " | ".join(str(decode_splits(bh, t, n_sm, block_n)[0]) for t in seq_lens) + " |")
    return "\n".join(lines)


@torch.compiler.assume_constant_result  # under torch.compile: evaluated once while tracing, a constant
def _sm_count(device):
    return torch.cuda.get_device_properties(device).multi_processor_count


def _decode(q, mu, v, rot, causal, q_offset, n_split, at=None):
    B, H, Tq, D2 = q.shape
    H_kv, Tk, D_V = mu.shape[1], mu.shape[2], v.shape[-1]
    G = H // H_kv
    n_blocks = max(triton.cdiv(Tk, DECODE_BLOCK_N), 1)
    if n_split <= 0:
        n_split, per = decode_splits(B * H_kv, Tk, _sm_count(q.device) if q.is_cuda else DEFAULT_SM_COUNT)
    else:
        per = triton.cdiv(n_blocks, n_split)
    op = torch.empty((n_split, B, H, Tq, D_V), device=q.device, dtype=torch.float32)
    lp = torch.empty((n_split, B, H, Tq), device=q.device, dtype=torch.float32)
    if B * H * Tq:
        with _device(q):
            _decode_kernel[(n_split * B * H_kv,)](
                q,
                mu,
                v,
                rot,
                op,
                lp,
                lp if at is None else at,
                *_strides(q, mu, v),
                rot.stride(0),
                B * H_kv,
                H_kv,
                Tq,
                Tk,
                q_offset,
                per,
                GROUP=G,
                D=D2 // 2,
                D_V=D_V,
                CAUSAL=bool(causal),
                DOT_PREC=dot_precision(q.dtype),
                BLOCK_M=max(16, pow2_bucket(G * Tq)),
                BLOCK_N=DECODE_BLOCK_N,
                OFFSET_FROM_PTR=at is not None,
                num_warps=DECODE_WARPS,
                **COMPILE_OPTIONS,
            )
    if n_split == 1:
        return op[0].to(v.dtype), lp[0] * _LN2.value
    m = lp.amax(0)
    m = torch.where(m == float("-inf"), 0.0, m)
    w = torch.exp2(lp - m)  # 0 for a split that saw no key
    total = w.sum(0)
    o = (w.unsqueeze(-1) * op).sum(0) / total.unsqueeze(-1)
    return o.to(v.dtype), (m + torch.log2(total)) * _LN2.value


@torch.library.custom_op("pope::decode", mutates_args=())
def decode_forward(
    q: torch.Tensor, mu: torch.Tensor, v: torch.Tensor, rot: torch.Tensor, causal: bool, q_offset: int, n_split: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode kernel and its merge on checked inputs (see decode) -> (o (B, H, Tq, D_V) in v's dtype,
    lse (B, H, Tq) float32 nats), both contiguous for any input layout."""
    return _decode(q, mu, v, rot, causal, q_offset, n_split)


@decode_forward.register_fake
def _(q, mu, v, rot, causal, q_offset, n_split):
    B, H, Tq, _ = q.shape
    return q.new_empty((B, H, Tq, v.shape[-1]), dtype=v.dtype), q.new_empty((B, H, Tq), dtype=torch.float32)


@torch.library.custom_op("pope::decode_at", mutates_args=())
def decode_at(
    q: torch.Tensor, mu: torch.Tensor, v: torch.Tensor, rot: torch.Tensor, at: torch.Tensor, n_split: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """decode with the queries' first position read from `at`, a (1,) int64 tensor on the device (causal): the static
    decoding step (pope.pope_decode_step) passes its position as data, so a compiled graph or a CUDA graph replays
    one launch for every position, with no host sync and no Python check (the caller checks once, decode's rules).
    mu, v: the whole preallocated cache (keys past the position are masked). Returns decode's (o, lse), contiguous."""
    return _decode(q, mu, v, rot, True, 0, n_split, at)


@decode_at.register_fake
def _(q, mu, v, rot, at, n_split):
    B, H, Tq, _ = q.shape
    return q.new_empty((B, H, Tq, v.shape[-1]), dtype=v.dtype), q.new_empty((B, H, Tq), dtype=torch.float32)


def decode(q, mu, v, rot, *, causal=True, q_offset=0, n_split=0):
    """Attention of a few pre-rotated queries over a cache of key magnitudes (flash-decoding), not differentiable.

    Args:
        q: (B, H, Tq, 2D) [mu_q cos(t theta - delta), mu_q sin(t theta - delta)] times sm_scale * log2(e),
            delta of the query's key/value head (pope.pope_query_decode_form); G * Tq <= DECODE_MAX_ROWS rows
            per key/value head, G = H / H_kv.
        mu: (B, H_kv, Tk, D) key magnitudes at positions 0..Tk-1, in q's dtype; any strides with a contiguous
            last dim (a slice of a preallocated cache).
        v: (B, H_kv, Tk, D_V) values, q's dtype, strides as mu.
        rot: (T_max, 2D) float32 [cos(s theta) | sin(s theta)], T_max >= Tk, rows contiguous
            (pope.pope_rotation_table).
        causal: query i (position q_offset + i) sees keys j <= q_offset + i.
        q_offset: tokens, >= 0 (Tk - Tq at the cache's end).
        n_split: splits of the cache; 0 picks decode_splits for this GPU (132 multiprocessors in the interpreter).
    Returns:
        (o (B, H, Tq, D_V) in v's dtype, lse (B, H, Tq) float32 nats), contiguous.
    Raises:
        ValueError for shapes, dtypes, devices or widths the kernel does not take (D, D_V in V_DIMS).
    """
    if q.dim() != 4 or mu.dim() != 4 or v.dim() != 4 or rot.dim() != 2:
        raise ValueError(
            f"decode needs q, mu, v 4-D and rot 2-D, got {tuple(q.shape)}, {tuple(mu.shape)}, "
            f"{tuple(v.shape)}, {tuple(rot.shape)}"
        )
    (B, H, Tq, D2), (Bk, H_kv, Tk, D), D_V = q.shape, mu.shape, v.shape[-1]
    ok = (
        B == Bk
        and tuple(v.shape[:3]) == (B, H_kv, Tk)
        and D2 == 2 * D
        and H_kv >= 1
        and H % H_kv == 0
        and rot.shape[0] >= Tk
        and rot.shape[1] == 2 * D
        and Tk >= 1
    )
    if not ok:
        raise ValueError(
            f"decode: expected q (B, H, Tq, 2D), mu (B, H_kv, Tk, D), v (B, H_kv, Tk, D_V), rot (>= Tk, "
            f"2D) with H a multiple of H_kv and Tk >= 1, got {tuple(q.shape)}, {tuple(mu.shape)}, "
            f"{tuple(v.shape)}, {tuple(rot.shape)}"
        )
    if (
        D not in V_DIMS
        or D_V not in V_DIMS
        or not q.dtype == mu.dtype == v.dtype
        or q.dtype not in DTYPES
        or rot.dtype != torch.float32
    ):
        raise ValueError(
            f"decode takes widths D, D_V in {V_DIMS}, one dtype of {DTYPES} for q, mu, v and a float32 "
            f"rot, got D={D}, D_V={D_V}, {q.dtype}, {mu.dtype}, {v.dtype}, {rot.dtype}"
        )
    if (H // H_kv) * Tq > DECODE_MAX_ROWS:
        raise ValueError(
            f"decode takes at most {DECODE_MAX_ROWS} query rows per key/value head (G * Tq), got "
            f"{(H // H_kv) * Tq}; use attention for a long prefill"
        )
    if q_offset < 0 or not (q.device == mu.device == v.device == rot.device):
        raise ValueError(
            f"decode needs q_offset >= 0 and one device, got {q_offset}, {q.device}, {mu.device}, "
            f"{v.device}, {rot.device}"
        )
    if not q.is_cuda and not INTERPRETING:
        raise ValueError(
            f"the Triton kernel needs CUDA tensors, got device {q.device}; set TRITON_INTERPRET=1 "
            "before importing pope_kernel to run it in the interpreter"
        )
    check_limits(B, H, Tq, Tk, q_offset, (q.stride(2), mu.stride(2), v.stride(2)))
    q = q.contiguous()
    mu, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (mu, v))
    rot = rot if rot.stride(-1) == 1 else rot.contiguous()
    return decode_forward(q, mu, v, rot, bool(causal), int(q_offset), int(n_split))
