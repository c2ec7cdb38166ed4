"""Attention kernel benchmark: PoPE's Triton kernel vs PoPE through flex_attention vs RoPE through FlashAttention.

    python bench_kernel.py                        # CUDA: T = 1k, 4k, 16k, d = 64, 128, bf16, as a table
    python bench_kernel.py --seq-lens 4096 --head-dims 64 --batch 8 --n-head 12
    python bench_kernel.py --n-kv-head 3          # grouped-query: 12 (d=64) or 6 (d=128) query heads, 3 k/v heads
    python bench_kernel.py --sass [--json]        # no GPU: SASS of the loop bodies, PoPE vs a reference FA kernel
    python bench_kernel.py --spills [--arch 120]  # no GPU: registers / spills of every autotune candidate
    python bench_kernel.py --decode-sass          # no GPU: the decode kernel for sm_80..120 vs a RoPE decode kernel
    python bench_kernel.py --ops                  # no GPU: eager ops around the kernels per compiled attention call
    python bench_kernel.py --doc_len=512          # packed documents (block_causal) vs causal at T = 4k, 16k, d = 64:
                                                  # CUDA times them; a CPU counts the tiles each kernel visits

Implementations (all causal, raw q/k/v of shape (B, H, T, d), fwd + bwd through autograd):
    pope_triton  pope_attention(backend='triton') as the model calls it, eager: the Cartesian transform in torch,
                 pope_kernel.py's FlashAttention-2 kernels (q/k width 2d, v width d), and the selective checkpoint
                 that recomputes the transform in the backward: the attention call, not the kernels alone.
    pope_kernel  the kernels alone: pope_kernel.attention on ready q~ (pre-scaled by sm_scale log2 e), k~ (formed
                 once, outside the timing), v; their gradients end at q~, k~.
    pope_flex    the same Cartesian q~, k~ (torch), then torch.compile'd flex_attention with a causal block mask.
    rope_sdpa    RoPE rotation (torch ops, cos/sin tables precomputed outside the timing) followed by SDPA
                 pinned to the FlashAttention backend: the usual baseline.
    rope_fa3     the same with FlashAttention-3 activated in torch (torch.nn.attention.activate_flash_attention_impl
                 ('FA3'), which needs the flash_attn_interface package); a row with the reason where it cannot run.
    pope_sdpa    pope_attention(backend='torch'): v zero-padded to 2d, SDPA (not in the default set).

FLOP convention (causal, so half of the T x T scores): RoPE fwd = 2 * B*H*T*T*(d + d) / 2 (QK^T and PV,
2 FLOPs per multiply-add); PoPE's QK^T has width 2d, so PoPE fwd = 2 * B*H*T*T*(2d + d) / 2; bwd = 2.5 x fwd.
'TFLOP/s' is (fwd + bwd FLOPs) / fwd+bwd time, each implementation credited with its own algorithmic FLOPs.

--sass compiles (the ptxas Triton picks per arch, sm_90 by default, no GPU) the first autotune candidate of
pope_kernel's fwd, dkdv and dq kernels at d = 64 and 128, and the minimal FlashAttention kernels of this file (q/k
and v width d, same tiles and loop structure), and reads the innermost loop with tensor-core instructions (HMMA,
HGMMA, or sm_100's UTC*MMA) and the fewest instructions (the unmasked one) from the SASS: instructions per warp,
MUFU per thread, tensor-core instructions, all per 128 x 128 block of scores, and local-memory instructions inside
any loop (sm_100's out-of-line mbarrier retries, placed after the kernel's EXIT, are no loops). --arch 100 / 120
read Blackwell builds; the cycle estimate keeps H100 rates. Cycle estimate per block on an H100 SM (4 issue slots,
16 MUFU and 4096 dense bf16 FLOP per clock): max(instr * warps / 4, MUFU * 32 * warps / 16, FLOPs / 4096), i.e.
max(2 instr, 16 MUFU, FLOPs / 4096) at 8 warps. Without CUDA and without --sass / --spills, one tiny shape runs
through the Triton interpreter (smoke test).
"""

import argparse
import contextlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

IMPLS = ("pope_triton", "pope_kernel", "pope_flex", "rope_sdpa", "rope_fa3", "pope_sdpa")
DEFAULT_IMPLS = ("pope_triton", "pope_kernel", "pope_flex", "rope_sdpa", "rope_fa3")


def attention_flops(impl, B, H, T, d, causal=True):
    """(fwd, bwd) FLOPs of one attention call under the convention in the module docstring."""
    qk_width = 2 * d if impl.startswith("pope") else d
    fwd = 2 * B * H * T * T * (qk_width + d) / (2 if causal else 1)
    return fwd, 2.5 * fwd


def _rope_tables(T, d, device, rope_theta=10000.0):
    inv = rope_theta ** (-torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    ang = torch.arange(T, device=device, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()


def _apply_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


def _make_fn(impl, q, k, v, delta, cos, sin, use_flash):
    from pope import polar_to_cartesian, pope_attention, pope_frequencies

    T, d = q.shape[-2], q.shape[-1]
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}  # grouped-query attention: no k/v copies
    if impl == "pope_triton":
        return lambda: pope_attention(q, k, v, delta, causal=True, backend="triton")
    if impl == "pope_sdpa":
        return lambda: pope_attention(q, k, v, delta, causal=True, backend="torch")
    if impl == "pope_kernel":
        return _kernel_alone(q, k, v, delta)
    if impl == "pope_flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, T, T, device=q.device)
        flex = torch.compile(flex_attention)
        freqs, pos = pope_frequencies(d, device=q.device), torch.arange(T, device=q.device)

        def pope_flex():
            qc = polar_to_cartesian(q, pos, freqs, None, "softplus", q.dtype)
            kc = polar_to_cartesian(k, pos, freqs, delta, "softplus", q.dtype)
            return flex(qc, kc, v, block_mask=mask, scale=1.0 / math.sqrt(d), **gqa)

        return pope_flex

    def rope():  # rope_sdpa and rope_fa3 (the latter run inside _flash_impl('FA3'))
        qr, kr = _apply_rope(q, cos.to(q.dtype), sin.to(q.dtype)), _apply_rope(k, cos.to(q.dtype), sin.to(q.dtype))
        if use_flash:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qr, kr, v, is_causal=True, **gqa)
        return F.scaled_dot_product_attention(qr, kr, v, is_causal=True, **gqa)

    return rope


def _kernel_alone(q, k, v, delta, rows=None, document_ids=None):
    """pope_kernel.attention on q~, k~ formed here once (pope.pope_cartesian, as pope_attention_triton forms them) as
    leaves that require grad: the callable's time is the kernels' (forward; backward with fwd + bwd). rows: the
    rotation rows (T, 2d), or per token (B, 1, T, 2d) for positions restarting per document (None: the table's);
    document_ids (B, T) int32 or None: the block-causal mask. Its `extra_leaves` are q~, k~ (their .grad is reset
    between timed calls like the raw inputs')."""
    import pope
    import pope_kernel

    T, d = q.shape[-2], q.shape[-1]
    rows = pope.pope_rotation_table(T, d, device=q.device) if rows is None else rows
    with torch.no_grad():
        qc = pope.pope_cartesian(q, rows, None, "softplus", pope.LOG2E / math.sqrt(d), q.dtype).requires_grad_()
        kc = pope.pope_cartesian(k, rows, delta, "softplus", 1.0, q.dtype).requires_grad_()

    def kernel():
        return pope_kernel.attention(qc, kc, v, causal=True, document_ids=document_ids)[0]

    kernel.extra_leaves = (qc, kc)
    return kernel


def _timer(device, warmup, rep):
    if device.type == "cuda":
        import triton.testing

        def bench(fn, grad_to_none=None):
            return triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none)

        return bench

    def bench(fn, grad_to_none=None):  # CPU / interpreter: wall clock, a few calls
        fn()
        t0 = time.perf_counter()
        n = 2
        for _ in range(n):
            if grad_to_none:
                for t in grad_to_none:
                    t.grad = None
            fn()
        return (time.perf_counter() - t0) / n * 1e3

    return bench


@contextlib.contextmanager
def _flash_impl(name):
    """torch's FlashAttention implementation `name` ('FA3', 'FA4') active inside the block, the built-in one after;
    None: nothing changes. Raises RuntimeError with torch's reason where it cannot be activated."""
    if name is None:
        yield
        return
    import torch.nn.attention as tna

    if not hasattr(tna, "activate_flash_attention_impl"):
        raise RuntimeError(f"this torch ({torch.__version__}) cannot switch FlashAttention implementations")
    try:
        tna.activate_flash_attention_impl(name)
    except Exception as e:  # noqa: BLE001 - e.g. flash_attn_interface not installed
        raise RuntimeError(f"{name} not available: {type(e).__name__}: {e}") from e
    try:
        yield
    finally:
        tna.restore_flash_attention_impl()


def flash_implementation():
    """torch.nn.attention's active FlashAttention implementation ('FA3', 'FA4', or the built-in FA2), as text."""
    import torch.nn.attention as tna

    current = getattr(tna, "current_flash_attention_impl", None)
    if current is None:
        return "built-in FlashAttention-2 (this torch has no torch.nn.attention.current_flash_attention_impl)"
    listed = getattr(tna, "list_flash_attention_impls", lambda: [])()
    return f"{current() or 'built-in FlashAttention-2'} (registered: {', '.join(listed) or 'none'})"


def bench_attention_kernels(
    device,
    dtype=torch.bfloat16,
    seq_lens=(1024, 4096, 16384),
    head_dims=(64, 128),
    batch=None,
    n_head=None,
    impls=DEFAULT_IMPLS,
    warmup=25,
    rep=100,
    verbose=True,
    n_kv_head=None,
):
    """Time forward, backward and forward+backward of the causal attention implementations.

    Args:
        device: torch device (or string). On CUDA, timings are triton.testing.do_bench medians in ms.
            On CPU 'pope_triton' needs TRITON_INTERPRET=1 and its times are interpreter times.
        dtype: input dtype of q, k, v (delta stays float32).
        seq_lens: sequence lengths T (tokens), Tq = Tk = T.
        head_dims: head dims d; v has width d too.
        batch: B; default max(1, 32768 // T) (about 32k tokens per call).
        n_head: H; default max(1, 768 // d).
        n_kv_head: key/value heads (grouped-query attention; H a multiple of it); default H.
        impls: subset of IMPLS.
    Returns:
        list of dicts {impl, T, d, B, H, H_kv, fwd_ms, bwd_ms, fwdbwd_ms, tflops}; a failing case (e.g. out of
        memory) gets NaN timings and an 'error' entry instead of stopping the sweep.
    """
    device = torch.device(device)
    bench = _timer(device, warmup, rep)
    use_flash = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    rows = []
    for d in head_dims:
        for T in seq_lens:
            B = batch if batch is not None else max(1, 32768 // T)
            H = n_head if n_head is not None else max(1, 768 // d)
            gen = torch.Generator(device="cpu").manual_seed(0)
            H_kv = n_kv_head or H
            q, k, v = (
                torch.randn(B, h, T, d, generator=gen).to(device, dtype).requires_grad_() for h in (H, H_kv, H_kv)
            )
            delta = (-2 * math.pi * torch.rand(H_kv, d, generator=gen)).to(device).requires_grad_()
            cos, sin = _rope_tables(T, d, device)
            for impl in impls:
                row = dict(impl=impl, T=T, d=d, B=B, H=H, H_kv=H_kv)
                leaves = [q, k, v, delta] if impl.startswith("pope") else [q, k, v]
                try:
                    with _flash_impl("FA3" if impl == "rope_fa3" else None):
                        fn = _make_fn(impl, q, k, v, delta, cos, sin, use_flash)
                        leaves = leaves + list(getattr(fn, "extra_leaves", ()))
                        with torch.no_grad():
                            row["fwd_ms"] = bench(fn)
                        g = torch.randn_like(fn())
                        # the backward alone: fwd+bwd less a forward that records the graph. Not a backward with
                        # retain_graph=True over one graph: a compiled graph (flex) donates its buffers and refuses
                        fwd_graph_ms = bench(fn, grad_to_none=leaves)
                        row["fwdbwd_ms"] = bench(lambda: fn().backward(g), grad_to_none=leaves)
                        row["bwd_ms"] = row["fwdbwd_ms"] - fwd_graph_ms
                    f_fwd, f_bwd = attention_flops(impl, B, H, T, d)
                    row["tflops"] = (f_fwd + f_bwd) / (row["fwdbwd_ms"] * 1e-3) / 1e12
                except Exception as e:  # noqa: BLE001 - keep sweeping (OOM at long T, unsupported case)
                    row.update(
                        fwd_ms=float("nan"),
                        bwd_ms=float("nan"),
                        fwdbwd_ms=float("nan"),
                        tflops=float("nan"),
                        error=f"{type(e).__name__}: {str(e)[:120]}",
                    )
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                for t in leaves:
                    t.grad = None
                rows.append(row)
                if verbose:
                    print(_format_row(row), flush=True)
    return rows


def document_lengths(T, mean, seed=0):
    """Document lengths (tokens, each >= 1) drawn from a seeded exponential of mean `mean` tokens, the last one cut so
    that they sum to T: one packed row of T tokens."""
    gen = torch.Generator().manual_seed(seed)
    lens, total = [], 0
    while total < T:
        n = max(1, math.ceil(torch.empty(()).exponential_(1.0 / mean, generator=gen).item()))
        lens.append(min(n, T - total))
        total += lens[-1]
    return lens


def document_ids(B, T, mean, seed=0, device="cpu"):
    """(B, T) int32 document ids of B packed rows (row b: document_lengths(T, mean, seed + b)) and (B, T) int64
    positions restarting at 0 in each document."""
    ids = torch.stack(
        [
            torch.cat(
                [torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(document_lengths(T, mean, seed + b))]
            )
            for b in range(B)
        ]
    )
    pos = torch.arange(T) - torch.searchsorted(ids, ids)
    return ids.to(device), pos.to(device)


def doc_tile_report(doc_len, seq_lens=(4096, 16384), d=64, run_kernels=True):
    """CPU, no timing: per T and kernel (fwd, dkdv, dq at their training tiles, CONFIGS[role][64][0]), the tiles the
    causal kernel visits, the tiles the documents allow (pope_kernel.visited_tiles, the formula) and, run_kernels, the
    tiles the block-causal kernel visits (its COUNT output, one batch row and head in the Triton interpreter, which
    must be set before pope_kernel is imported). Prints a table, returns its rows."""
    import pope_kernel as pk

    rows = []
    print(f"documents: exponential lengths of mean {doc_len} tokens (seed 0); tiles (BLOCK_M, BLOCK_N) d = {d}")
    print("| T | documents | kernel | tile | causal | block_causal: formula | kernel COUNT | block / causal |")
    print("|---|---|---|---|---|---|---|---|")
    for T in seq_lens:
        ids, _ = document_ids(1, T, doc_len)
        n_docs = int(ids[0, -1]) + 1
        counts = {}
        if run_kernels:
            saved = {role: pk.KERNELS[role].configs for role in pk.KERNELS}
            try:
                for role in pk.KERNELS:
                    pk.KERNELS[role].configs = [pk.tile_config(*pk.CONFIGS[role][64][0])]
                gen = torch.Generator().manual_seed(0)
                q, k = (torch.randn(1, 1, T, 2 * d, generator=gen) for _ in range(2))
                v = torch.randn(1, 1, T, d, generator=gen)
                bufs = {role: torch.zeros(T, dtype=torch.int32) for role in pk.KERNELS}  # >= the programs
                docs = pk.document_bounds(ids)
                o, lse = pk.launch_forward(q, k, v, True, 0, docs, bufs)
                pk.launch_backward(torch.ones_like(o), q, k, v, o, lse, True, 0, docs, bufs)
                counts = {role: int(b.sum()) for role, b in bufs.items()}
            finally:
                for role, cfgs in saved.items():
                    pk.KERNELS[role].configs = cfgs
        for role in ("fwd", "dkdv", "dq"):
            bm, bn = pk.CONFIGS[role][64][0][:2]
            allowed = sum(pk.visited_tiles(ids[0].tolist(), T, bm, bn, role=role))
            causal = sum(pk.visited_tiles([0] * T, T, bm, bn, role=role))
            row = dict(T=T, documents=n_docs, kernel=role, tile=(bm, bn), causal=causal, allowed=allowed)
            row["visited"] = counts.get(role)
            rows.append(row)
            print(
                f"| {T} | {n_docs} | {role} | {bm} x {bn} | {causal} | {allowed} | {row['visited']} | "
                f"{allowed / causal:.3f} |",
                flush=True,
            )
    return rows


def bench_documents(
    doc_len, seq_lens=(4096, 16384), d=64, dtype=torch.bfloat16, batch=None, n_head=None, rep=100, device="cuda"
):
    """CUDA: block_causal (documents of exponential lengths, mean doc_len, positions restarting per document) against
    causal, forward and forward + backward (do_bench medians, ms), for pope_triton (pope_attention_triton with
    document_ids / position_ids), pope_kernel (the kernels alone on ready q~, k~: _kernel_alone), pope_flex and
    rope_flex (flex_attention with a document BlockMask, the same Cartesian
    q~, k~ or RoPE-rotated q, k). B = 32768 // T, H = 768 // d by default. Prints a table, returns its rows."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import pope

    flex, bench = torch.compile(flex_attention), _timer(torch.device(device), 25, rep)
    rows = []
    for T in seq_lens:
        B, H = batch or max(1, 32768 // T), n_head or max(1, 768 // d)
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, H, T, d, generator=gen).to(device, dtype).requires_grad_() for _ in range(3))
        delta = (-2 * math.pi * torch.rand(H, d, generator=gen)).to(device).requires_grad_()
        ids, pos = document_ids(B, T, doc_len, device=device)
        rot = pope.pope_rotation_table(T, d, device=device)
        inv = 10000.0 ** (-torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
        for mask in ("causal", "block_causal"):
            docs = mask == "block_causal"
            p = pos if docs else torch.arange(T, device=device).expand(B, T)
            rows_qk = rot[p].unsqueeze(1)  # (B, 1, T, 2d)
            ang = p[:, None, :, None].float() * inv
            cos, sin = torch.cat((ang, ang), -1).cos().to(dtype), torch.cat((ang, ang), -1).sin().to(dtype)

            def doc_mask(b, h, i, j, ids=ids):
                return (i >= j) & (ids[b, i] == ids[b, j])

            bm = create_block_mask(
                doc_mask if docs else (lambda b, h, i, j: i >= j), B if docs else None, None, T, T, device=device
            )
            kw = dict(document_ids=ids, position_ids=pos) if docs else {}
            doc_ids = ids.int() if docs else None
            fns = {
                "pope_triton": lambda kw=kw: pope.pope_attention_triton(q, k, v, delta, **kw),
                "pope_kernel": lambda r=rows_qk, i=doc_ids: _kernel_alone(q, k, v, delta, r, i),
                "pope_flex": lambda bm=bm, r=rows_qk: flex(
                    pope.pope_cartesian(q, r, None, "softplus", 1.0, dtype),
                    pope.pope_cartesian(k, r, delta, "softplus", 1.0, dtype),
                    v,
                    block_mask=bm,
                    scale=1.0 / math.sqrt(d),
                ),
                "rope_flex": lambda bm=bm, c=cos, s=sin: flex(
                    _apply_rope(q, c, s), _apply_rope(k, c, s), v, block_mask=bm
                ),
            }
            for impl, fn in fns.items():
                row = dict(impl=impl, T=T, B=B, H=H, mask=mask, fwd_ms=float("nan"), fwdbwd_ms=float("nan"))
                try:  # keep sweeping past a failing case (out of memory, no flex backward on a CPU)
                    if impl == "pope_kernel":  # built here: forming its q~, k~ can fail too
                        fn = fn()
                    with torch.no_grad():
                        row["fwd_ms"] = bench(fn)
                    g = torch.randn_like(fn())
                    leaves = [q, k, v, delta, *getattr(fn, "extra_leaves", ())]
                    row["fwdbwd_ms"] = bench(lambda: fn().backward(g), grad_to_none=leaves)
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
                    if device == "cuda":
                        torch.cuda.empty_cache()
                rows.append(row)
    print(f"documents: exponential lengths of mean {doc_len} tokens; d = {d}, {dtype}; ms ({device}: _timer)")
    print("| impl | T | B x H | causal fwd | block fwd | ratio | causal fwd+bwd | block fwd+bwd | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    by = {(r["impl"], r["T"], r["mask"]): r for r in rows}
    for (impl, T, mask), r in by.items():
        if mask != "causal":
            continue
        blk = by[(impl, T, "block_causal")]
        print(
            f"| {impl} | {T} | {r['B']} x {r['H']} | {r['fwd_ms']:.3f} | {blk['fwd_ms']:.3f} | "
            f"{blk['fwd_ms'] / r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} | {blk['fwdbwd_ms']:.3f} | "
            f"{blk['fwdbwd_ms'] / r['fwdbwd_ms']:.3f} |"
            + (f" {blk.get('error') or r.get('error')}" if "error" in blk or "error" in r else "")
        )
    for T in seq_lens:
        for mask in ("causal", "block_causal"):
            rf = by[("rope_flex", T, mask)]
            for impl in ("pope_triton", "pope_kernel"):
                ratio = by[(impl, T, mask)]["fwdbwd_ms"] / rf["fwdbwd_ms"]
                print(f"PoPE ({impl}) / RoPE (flex), T = {T}, {mask}: fwd+bwd {ratio:.2f}")
    return rows


def _format_row(r):
    s = f"{r['impl']:<12} {r['T']:>6} {r['d']:>4} {r['B']:>3} {r['H']:>3} {r.get('H_kv', r['H']):>4} "
    if "error" in r:  # no numbers: the reason it could not run (FA3's package missing, out of memory, ...)
        return s + f" {r['error']}"
    return s + f"{r['fwd_ms']:>9.3f} {r['bwd_ms']:>9.3f} {r['fwdbwd_ms']:>10.3f} {r['tflops']:>7.1f}"


def print_table(rows, ratios=True):
    """Table of the rows (a row that could not run: its reason, no numbers), then (ratios=True) the fwd+bwd time
    ratios of pope_triton and of pope_kernel over rope_sdpa, rope_fa3 and pope_flex (rows that ran)."""
    print(
        f"{'impl':<12} {'T':>6} {'d':>4} {'B':>3} {'H':>3} {'H_kv':>4} {'fwd_ms':>9} {'bwd_ms':>9} {'fwdbwd_ms':>10} "
        f"{'TFLOP/s':>7}"
    )
    for r in rows:
        print(_format_row(r))
    by = {(r["impl"], r["T"], r["d"]): r["fwdbwd_ms"] for r in rows if "error" not in r}
    for pope_impl in ("pope_triton", "pope_kernel"):
        keys = [(T, d) for (impl, T, d) in by if impl == pope_impl]
        if ratios and keys:
            print(
                f"\nfwd+bwd time of {pope_impl} over (goal at T >= 4k: <= 1.5x rope_sdpa, < 1x pope_flex; "
                "FLOP ratio 1.5):"
            )
            for T, d in keys:
                parts = [
                    f"{other} {by[(pope_impl, T, d)] / by[(other, T, d)]:.2f}x"
                    for other in ("rope_sdpa", "rope_fa3", "pope_flex")
                    if (other, T, d) in by
                ]
                print(f"  T={T:>6} d={d:>4}: " + ", ".join(parts))


# ---- eager ops around the kernels (no GPU needed) --------------------------------------------------------

# what the Triton interpreter itself runs to emulate a launch (its tensor copies), and the harness's own ops
_NOT_AROUND = {"aten::set_", "aten::copy_"}


def _outermost_ops(prof):
    """Names of the outermost aten ops of a torch.profiler run, a launch of a Triton kernel (the interpreter's, or
    a real one) counted as one 'triton kernel' and its insides skipped; an aten::to that copies nothing is left
    out (it returns its input)."""
    events = sorted(
        (e for e in prof.events() if e.name.startswith("aten::") or e.name == "triton kernel"),
        key=lambda e: (e.time_range.start, -e.time_range.end),
    )
    names, end = [], -1
    for e in events:
        if e.time_range.start < end:  # inside an op or a launch already counted
            continue
        end = e.time_range.end
        if e.name == "aten::to" and not e.cpu_children:
            continue
        names.append(e.name)
    return names


def count_eager_ops(B=2, H=4, H_kv=None, T=64, d=16, delta=True, compiled=True, device="cpu"):
    """Eager PyTorch ops (each a kernel launch on a GPU) around PoPE's Triton kernels in one attention call,
    forward and backward, as the compiled training step runs it: a function of a (B, T, 3 H d) projection (q, k,
    v as its views, as model.py splits them) that calls pope_attention(backend='triton'), compiled with
    Inductor (compiled=True) and warmed up, then profiled for one call and its backward. Counted: the
    outermost aten ops; what Inductor generated runs as its own code and is not counted, the inside of an
    opaque op is. Left out: the interpreter's set_/copy_, an aten::to that copies nothing, and the harness's
    own three (the loss gradient's ones_like and the two leaves' AccumulateGrad detach).
    Returns {"ops": n, "by_op": {name: n}, "triton_kernels": launches}. On CPU it needs TRITON_INTERPRET=1 set
    before pope_kernel is imported (main() sets it)."""
    import collections

    import triton.runtime.interpreter as interp
    from torch.profiler import ProfilerActivity, profile, record_function

    from pope import pope_attention

    H_kv = H_kv or H
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(B, T, (H + 2 * H_kv) * d, generator=gen).to(device).requires_grad_()
    dl = (-2 * math.pi * torch.rand(H_kv, d, generator=gen)).to(device).requires_grad_() if delta else None

    def step(qkv, dl):
        q, k, v = qkv.split((H * d, H_kv * d, H_kv * d), dim=2)
        q, k, v = (t.view(B, T, -1, d).transpose(1, 2) for t in (q, k, v))
        return pope_attention(q, k, v, dl, backend="triton").float().pow(2).sum()

    fn = torch.compile(step) if compiled else step
    leaves = [t for t in (qkv, dl) if t is not None]
    for _ in range(2):
        fn(qkv, dl).backward()
    for t in leaves:
        t.grad = None
    launch = interp.GridExecutor.__call__

    def marked(self, *args, **kwargs):  # the interpreter's launch, marked so that its insides are not counted
        with record_function("triton kernel"):
            return launch(self, *args, **kwargs)

    interp.GridExecutor.__call__ = marked
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn(qkv, dl).backward()
    finally:
        interp.GridExecutor.__call__ = launch
    names = _outermost_ops(prof)
    by_op = collections.Counter(n for n in names if n not in _NOT_AROUND and n != "triton kernel")
    harness = collections.Counter({"aten::ones_like": 1, "aten::detach": len(leaves)})
    by_op.subtract(harness)
    by_op = {k: v for k, v in by_op.items() if v > 0}
    return {"ops": sum(by_op.values()), "by_op": by_op, "triton_kernels": names.count("triton kernel")}


# ---- compile-only reports (no GPU): SASS of the loop bodies, registers and spills ---------------------

_FA_KERNELS = {}


def reference_fa_kernels():
    """Minimal FlashAttention-2 kernels (q, k, v of one width D; causal, Tq = Tk = T; q pre-scaled by
    sm_scale * log2 e) with pope_kernel's tiles and loop structure, for --sass: {'fwd', 'dkdv', 'dq'}.
    Compiled only, never launched. Built on first use, so importing this file does not import triton."""
    if _FA_KERNELS:
        return _FA_KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def fa_fwd(Q, K, V, O, LSE, stride_h, stride_m, T, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        n_m = tl.cdiv(T, BLOCK_M)
        pid_m, bh = tl.program_id(0) % n_m, (tl.program_id(0) // n_m).to(tl.int64)
        m0 = pid_m * BLOCK_M
        offs_m, offs_n, offs_d = m0 + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, D)
        base = bh * stride_h
        q = tl.load(Q + base + offs_m[:, None] * stride_m + offs_d[None, :], mask=offs_m[:, None] < T, other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        acc = tl.full([BLOCK_M, D], 0.0, tl.float32)
        n_full = (m0 + 1) // BLOCK_N * BLOCK_N
        for stage in tl.static_range(2):
            if stage == 0:
                lo, hi = 0, n_full
            else:
                lo, hi = n_full, tl.minimum(T, m0 + BLOCK_M)
            k_ptrs = K + base + (lo + offs_n)[:, None] * stride_m + offs_d[None, :]
            v_ptrs = V + base + (lo + offs_n)[:, None] * stride_m + offs_d[None, :]
            for start_n in range(lo, hi, BLOCK_N):
                if stage == 0:
                    k, v = tl.load(k_ptrs), tl.load(v_ptrs)
                else:
                    ok = start_n + offs_n < T
                    k = tl.load(k_ptrs, mask=ok[:, None], other=0.0)
                    v = tl.load(v_ptrs, mask=ok[:, None], other=0.0)
                s = tl.dot(q, tl.trans(k))
                if stage == 1:
                    s = tl.where((start_n + offs_n)[None, :] <= offs_m[:, None], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
                m_i = m_new
                k_ptrs += BLOCK_N * stride_m
                v_ptrs += BLOCK_N * stride_m
        tl.store(
            O + base + offs_m[:, None] * stride_m + offs_d[None, :],
            (acc / l_i[:, None]).to(O.dtype.element_ty),
            mask=offs_m[:, None] < T,
        )
        tl.store(LSE + bh * T + offs_m, m_i + tl.log2(l_i), mask=offs_m < T)

    @triton.jit
    def fa_dkdv(
        Q,
        K,
        V,
        DO,
        LSE,
        DI,
        DK,
        DV,
        stride_h,
        stride_m,
        T,
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        n_n = tl.cdiv(T, BLOCK_N)
        pid_n, bh = tl.program_id(0) % n_n, (tl.program_id(0) // n_n).to(tl.int64)
        n0 = pid_n * BLOCK_N
        offs_n, offs_m0, offs_d = n0 + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_M), tl.arange(0, D)
        base = bh * stride_h
        kv_off = base + offs_n[:, None] * stride_m + offs_d[None, :]
        k = tl.load(K + kv_off, mask=offs_n[:, None] < T, other=0.0)
        v = tl.load(V + kv_off, mask=offs_n[:, None] < T, other=0.0)
        k = tl.where(offs_n[:, None] < T, k, 0.0)  # as in pope_kernel.KERNELS["dkdv"]: k reaches the wgmma in registers
        dk = tl.full([BLOCK_N, D], 0.0, tl.float32)
        dv = tl.full([BLOCK_N, D], 0.0, tl.float32)
        lo = n0 // BLOCK_M * BLOCK_M
        mid = (n0 + BLOCK_N - 1 + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        full_hi = T // BLOCK_M * BLOCK_M
        for stage in tl.static_range(3):
            if stage == 0:
                a, b = mid, full_hi
            elif stage == 1:
                a, b = lo, tl.minimum(mid, T)
            else:
                a, b = tl.maximum(mid, full_hi), T
            q_ptrs = Q + base + (a + offs_m0)[:, None] * stride_m + offs_d[None, :]
            do_ptrs = DO + base + (a + offs_m0)[:, None] * stride_m + offs_d[None, :]
            for start_m in range(a, b, BLOCK_M):
                offs_m = start_m + offs_m0
                if stage == 0:
                    q, do = tl.load(q_ptrs), tl.load(do_ptrs)
                    lse, di = tl.load(LSE + bh * T + offs_m), tl.load(DI + bh * T + offs_m)
                else:
                    ok = offs_m < T
                    q = tl.load(q_ptrs, mask=ok[:, None], other=0.0)
                    do = tl.load(do_ptrs, mask=ok[:, None], other=0.0)
                    lse = tl.load(LSE + bh * T + offs_m, mask=ok, other=float("inf"))
                    di = tl.load(DI + bh * T + offs_m, mask=ok, other=0.0)
                p_t = tl.exp2(tl.dot(k, tl.trans(q)) - lse[None, :])
                if stage != 0:
                    p_t = tl.where((offs_m[None, :] < T) & (offs_n[:, None] <= offs_m[None, :]), p_t, 0.0)
                dv = tl.dot(p_t.to(do.dtype), do, dv)
                ds_t = p_t * (tl.dot(v, tl.trans(do)) - di[None, :])
                dk = tl.dot(ds_t.to(q.dtype), q, dk)
                q_ptrs += BLOCK_M * stride_m
                do_ptrs += BLOCK_M * stride_m
        tl.store(DK + kv_off, (dk * 0.6931471805599453).to(DK.dtype.element_ty), mask=offs_n[:, None] < T)
        tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=offs_n[:, None] < T)

    @triton.jit
    def fa_dq(
        Q, K, V, DO, LSE, DI, DQ, stride_h, stride_m, T, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
    ):
        n_m = tl.cdiv(T, BLOCK_M)
        pid_m, bh = tl.program_id(0) % n_m, (tl.program_id(0) // n_m).to(tl.int64)
        m0 = pid_m * BLOCK_M
        offs_m, offs_n, offs_d = m0 + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, D)
        base = bh * stride_h
        q_off = base + offs_m[:, None] * stride_m + offs_d[None, :]
        q = tl.load(Q + q_off, mask=offs_m[:, None] < T, other=0.0)
        do = tl.load(DO + q_off, mask=offs_m[:, None] < T, other=0.0)
        lse = tl.load(LSE + bh * T + offs_m, mask=offs_m < T, other=float("inf"))
        di = tl.load(DI + bh * T + offs_m, mask=offs_m < T, other=0.0)
        dq = tl.full([BLOCK_M, D], 0.0, tl.float32)
        n_full = (m0 + 1) // BLOCK_N * BLOCK_N
        for stage in tl.static_range(2):
            if stage == 0:
                lo, hi = 0, n_full
            else:
                lo, hi = n_full, tl.minimum(T, m0 + BLOCK_M)
            k_ptrs = K + base + (lo + offs_n)[:, None] * stride_m + offs_d[None, :]
            v_ptrs = V + base + (lo + offs_n)[:, None] * stride_m + offs_d[None, :]
            for start_n in range(lo, hi, BLOCK_N):
                if stage == 0:
                    k, v = tl.load(k_ptrs), tl.load(v_ptrs)
                else:
                    ok = start_n + offs_n < T
                    k = tl.load(k_ptrs, mask=ok[:, None], other=0.0)
                    v = tl.load(v_ptrs, mask=ok[:, None], other=0.0)
                p = tl.exp2(tl.dot(q, tl.trans(k)) - lse[:, None])
                if stage == 1:
                    p = tl.where((start_n + offs_n)[None, :] <= offs_m[:, None], p, 0.0)
                ds = p * (tl.dot(do, tl.trans(v)) - di[:, None])
                dq = tl.dot(ds.to(k.dtype), k, dq)
                k_ptrs += BLOCK_N * stride_m
                v_ptrs += BLOCK_N * stride_m
        tl.store(DQ + q_off, (dq * 0.6931471805599453).to(DQ.dtype.element_ty), mask=offs_m[:, None] < T)

    _FA_KERNELS.update(fwd=fa_fwd, dkdv=fa_dkdv, dq=fa_dq)
    return _FA_KERNELS


_DECODE_KERNELS = {}


def reference_rope_decode_kernel():
    """A RoPE decode kernel of pope_kernel.DECODE_KERNEL's shape, for --decode-sass: the same grid, rows (GROUP
    query heads x Tq queries of a key/value head), split, masks and online softmax, but keys already rotated
    (RoPE's cache) and one dot of width D. Compiled only, never launched."""
    if _DECODE_KERNELS:
        return _DECODE_KERNELS["rope"]
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["Tq", "Tk", "q_offset", "blocks_per_split"])
    def rope_decode(
        Q,
        K,
        V,
        OP,
        LP,
        stride_qb,
        stride_qh,
        stride_qm,
        stride_kb,
        stride_kh,
        stride_kn,
        stride_vb,
        stride_vh,
        stride_vn,
        BH_KV,
        H_KV,
        Tq,
        Tk,
        q_offset,
        blocks_per_split,
        GROUP: tl.constexpr,
        D: tl.constexpr,
        D_V: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        pid = tl.program_id(0)
        split, bh = pid // BH_KV, pid % BH_KV
        b, h_kv = (bh // H_KV).to(tl.int64), (bh % H_KV).to(tl.int64)
        rows = tl.arange(0, BLOCK_M)
        g, i = rows // Tq, rows % Tq
        row_ok = rows < GROUP * Tq
        offs_d, offs_v, offs_n0 = tl.arange(0, D), tl.arange(0, D_V), tl.arange(0, BLOCK_N)
        q_rows = b * stride_qb + (h_kv * GROUP + g).to(tl.int64) * stride_qh + i.to(tl.int64) * stride_qm
        q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        q_pos = q_offset + i
        lo = split * blocks_per_split * BLOCK_N
        hi = tl.minimum(tl.minimum(lo + blocks_per_split * BLOCK_N, Tk), q_offset + Tq)
        k_ptrs = (
            K
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
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        acc = tl.full([BLOCK_M, D_V], 0.0, tl.float32)
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + offs_n0
            key_ok = offs_n < hi
            k = tl.load(k_ptrs, mask=key_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k))
            s = tl.where(key_ok[None, :] & (offs_n[None, :] <= q_pos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
            k_ptrs += BLOCK_N * stride_kn
            v_ptrs += BLOCK_N * stride_vn
        out_rows = ((split * BH_KV + bh) * GROUP + g).to(tl.int64) * Tq + i
        tl.store(
            OP + out_rows[:, None] * D_V + offs_v[None, :],
            acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None],
            mask=row_ok[:, None],
        )
        seen = l_i > 0.0
        tl.store(LP + out_rows, tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf")), mask=row_ok)

    _DECODE_KERNELS["rope"] = rope_decode
    return rope_decode


# Opt-in shared memory per block (bytes) of the parts --decode-sass checks: pope_kernel.SHARED_MEMORY_LIMITS
# (A100; A10 / RTX 3090; L4 / L40; H100) and B200 (sm_100), RTX 5090 (sm_120), from NVIDIA's tuning guides.
DECODE_ARCH_LIMITS = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448, 100: 232_448, 120: 101_376}
_DECODE_POINTERS = {
    "Q": None,
    "MU": None,
    "K": None,
    "V": None,
    "ROT": "fp32",
    "OP": "fp32",
    "LP": "fp32",
    "QOFF": "i64",
}


def compile_decode(arch, d=64, dtype="bf16", group=4, tq=1, impl="pope", block_n=64, warps=None):
    """Compile pope_kernel.DECODE_KERNEL (impl 'pope': mu_k tiles rotated in registers, q/k width 2d) or
    reference_rope_decode_kernel ('rope': rotated keys, width d) for sm_<arch>, no GPU needed: GROUP = group
    query heads per key/value head, tq queries, d = D_V, BLOCK_N = block_n keys, causal, warps (default
    pope_kernel.DECODE_WARPS). Returns the
    triton CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import pope_kernel as pk

    bm = max(16, 1 << max(group * tq - 1, 0).bit_length())
    warps = warps or pk.DECODE_WARPS
    if impl == "pope":
        fn = pk.DECODE_KERNEL
        consts = dict(
            GROUP=group, D=d, D_V=d, CAUSAL=True, DOT_PREC="tf32", BLOCK_M=bm, BLOCK_N=block_n, OFFSET_FROM_PTR=False
        )
    else:
        fn = reference_rope_decode_kernel()
        consts = dict(GROUP=group, D=d, D_V=d, BLOCK_M=bm, BLOCK_N=block_n)
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in _DECODE_POINTERS:
            sig[name] = "*" + (_DECODE_POINTERS[name] or dtype)
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            if name.startswith("stride_"):  # row strides of contiguous rows: multiples of 16 elements
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(
        ASTSource(fn, sig, constexprs=consts, attrs=attrs),
        target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=warps, num_stages=2, **pk.COMPILE_OPTIONS),
    )


def decode_sass_report(
    archs=tuple(DECODE_ARCH_LIMITS), head_dims=(64, 128), dtype="bf16", group=4, tq=1, as_json=False
):
    """Per arch and head dim: the decode kernel's shared memory against the part's limit, registers, spill bytes,
    local-memory instructions inside its loop, and its loop's instructions per warp and iteration (one tile of
    64 keys) next to the same-shape RoPE decode kernel's. Prints a markdown table (or JSON rows); returns rows."""
    rows = []
    if not as_json:
        print(
            f"{dtype}, GROUP={group} query heads per key/value head, Tq={tq}, 64 keys per tile, "
            f"{__import__('pope_kernel').DECODE_WARPS} warps"
        )
        print(
            "| sm | d | shared (B) / limit | registers | spill st/ld (B) | local ops in loop | loop instr/warp "
            "PoPE / RoPE | MUFU PoPE / RoPE |"
        )
        print("|---|---|---|---|---|---|---|---|")
    for arch in archs:
        for d in head_dims:
            out = {}
            for impl in ("pope", "rope"):
                kernel = compile_decode(arch, d, dtype, group, tq, impl)
                regs, st, ld, loop_ops = spill_stats(kernel, arch)
                body = loop_body_stats(kernel, arch)
                out[impl] = dict(
                    shared=kernel.metadata.shared,
                    regs=regs,
                    spill_st=st,
                    spill_ld=ld,
                    loop_local_ops=loop_ops,
                    instr=body["instr"],
                    mufu=body["mufu"],
                )
            row = dict(arch=arch, d=d, limit=DECODE_ARCH_LIMITS.get(arch), pope=out["pope"], rope=out["rope"])
            rows.append(row)
            p, r = out["pope"], out["rope"]
            if as_json:
                print(json.dumps(row), flush=True)
            else:
                print(
                    f"| {arch} | {d} | {p['shared']:,} / {row['limit']:,} | {p['regs']} | "
                    f"{p['spill_st']}/{p['spill_ld']} | {p['loop_local_ops']} | "
                    f"{p['instr']} / {r['instr']} ({p['instr'] / r['instr']:.2f}x) | "
                    f"{p['mufu']} / {r['mufu']} |",
                    flush=True,
                )
    return rows


def decode_bytes_per_token(d, n_kv_head, n_layer, elem_bytes=2, block_n=64):
    """Bytes a decoding step reads from memory per cached token, all layers: RoPE (k, v: 2d elements per
    key/value head) and PoPE's decode kernel (mu_k, v: 2d elements; plus its rotation table: one float32 row of
    2d per block_n keys, shared by the key/value heads and batch rows of a launch, so counted once per layer),
    against the old Cartesian cache (3d). Returns {'rope', 'pope', 'pope_cartesian'} in bytes."""
    rope = n_layer * n_kv_head * 2 * d * elem_bytes
    return dict(
        rope=rope, pope=rope + n_layer * 8 * d / block_n, pope_cartesian=n_layer * n_kv_head * 3 * d * elem_bytes
    )


# the document arguments as a launch without documents leaves them (pope_kernel's defaults): constexprs, no code
NO_DOCUMENTS = dict(DOCS=None, TILES=None, DOC=False, COUNT=False)
_POINTERS = ("Q", "K", "V", "O", "LSE", "DO", "DI", "DK", "DV", "DQ")
_FP32_ARGS = ("LSE", "DI")
_RUNTIME_INTS = ("H", "H_KV", "Tq", "Tk", "T", "q_offset", "TQ_BUCKET", "TK_BUCKET")  # not multiples of 16


def compile_kernel(role, config, d, arch, dtype="bf16", impl="pope", documents=False):
    """Compile one kernel (causal) for sm_<arch> with the ptxas Triton picks for it; no GPU needed.

    role: 'fwd' | 'dkdv' | 'dq'; config (BLOCK_M, BLOCK_N, num_warps, num_stages); d: head dim; documents: the
    block-causal build (DOC, a document table), else the build launched without documents.
    impl 'pope': pope_kernel's kernel with D_QK = 2d, D_V = d; 'fa': reference_fa_kernels (width d).
    dtype 'bf16' | 'fp16' | 'fp32'. Options as at a launch (num_warps, num_stages, pope_kernel.COMPILE_OPTIONS),
    for the reference kernels too. Pointers and strides are marked 16-divisible, as the JIT specialises
    them for contiguous tensors. Returns the triton CompiledKernel (asm: ptx, cubin).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import pope_kernel as pk

    bm, bn, warps, stages = config
    if impl == "pope":
        fn = pk.KERNELS[role].fn
        consts = dict(GROUP=1, D_QK=2 * d, D_V=d, CAUSAL=True, DOT_PREC="tf32", BLOCK_M=bm, BLOCK_N=bn)
        consts.update(NO_DOCUMENTS)
        if documents:  # the block-causal build: DOCS an int32 table (pope_kernel.document_bounds)
            consts.update(DOC=True)
            del consts["DOCS"]
    else:
        fn = reference_fa_kernels()[role]
        consts = dict(D=d, BLOCK_M=bm, BLOCK_N=bn)
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in _POINTERS:
            sig[name] = "*fp32" if name in _FP32_ARGS else f"*{dtype}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "DOCS":
            sig[name] = "*i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            if name not in _RUNTIME_INTS:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(
        ASTSource(fn, sig, constexprs=consts, attrs=attrs),
        target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=warps, num_stages=stages, **pk.COMPILE_OPTIONS),
    )


def _ptxas(arch):
    """Path of the ptxas Triton itself uses for sm_<arch>: Triton 3.7 runs the wheel's bin/ptxas below sm_100,
    Triton 3.9 bin/ptxas-blackwell from sm_90 up (its sm_90 PTX is version 9.4, newer than bin/ptxas reads).
    TRITON_PTXAS_PATH / TRITON_PTXAS_BLACKWELL_PATH override, as for Triton."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(arch).path


def _cuobjdump():
    from triton import knobs

    return knobs.nvidia.cuobjdump.path


def _sass(kernel, arch):
    """(ptxas -v info text, [(address, instruction text)]) of a compiled kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        info = subprocess.run(
            [_ptxas(arch), "-v", f"--gpu-name={gpu}", ptx, "-o", os.devnull], capture_output=True, text=True, check=True
        ).stderr
        sass = subprocess.run([_cuobjdump(), "-sass", cubin], capture_output=True, text=True, check=True).stdout
    return info, [(int(a, 16), text.strip()) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]


def _loops(instrs):
    """[(start, end)] address ranges of the loops: each backward branch and its target. Branches placed after
    the last EXIT are left out: on sm_100 ptxas moves each mbarrier wait's retry out of line, past the end of
    the kernel, and branches from there back into the body, which is no loop."""
    exits = [addr for addr, text in instrs if re.search(r"\bEXIT\b", text)]
    end = exits[-1] if exits else float("inf")
    loops = []
    for addr, text in instrs:
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr < end:
            loops.append((int(m.group(1), 16), addr))
    return loops


_MMA = re.compile(r"^(HGMMA|HMMA|UTC\w*MMA)")  # sm_80/86/89/120 mma.sync, sm_90 wgmma, sm_100 tcgen05


def spill_stats(kernel, arch):
    """(registers, spill store bytes, spill load bytes, local-memory instructions inside loops) of a compiled
    kernel: ptxas -v on its PTX, and the SASS (cuobjdump) between each backward branch and its target."""
    info, instrs = _sass(kernel, arch)
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    st, ld = (int(x) for x in re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info).groups())
    loops = _loops(instrs)
    in_loop = sum(
        1 for addr, text in instrs if re.search(r"\b(LDL|STL)\b", text) and any(lo <= addr <= hi for lo, hi in loops)
    )
    return regs, st, ld, in_loop


def loop_body_stats(kernel, arch):
    """SASS of the innermost loop with tensor-core instructions and the fewest instructions (the unmasked one),
    per iteration and warp: {'instr', 'mufu', 'mma' (HMMA, HGMMA or UTC*MMA), 'local' (LDL/STL)}, plus
    'loop_local_ops' over every loop. Loops without a tensor-core instruction (sm_100's tensor-memory
    allocation retry) are not the attention loop."""
    _, instrs = _sass(kernel, arch)
    loops = _loops(instrs)

    def opcode(t):
        return t.split()[1] if t.startswith("@") else t.split()[0]

    has_mma = [(lo, hi) for lo, hi in loops if any(lo <= a <= hi and _MMA.match(opcode(t)) for a, t in instrs)]
    inner = [(lo, hi) for lo, hi in has_mma if not any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in has_mma)]
    lo, hi = min(inner, key=lambda r: r[1] - r[0])
    body = [text for addr, text in instrs if lo <= addr <= hi]
    ops = [opcode(t) for t in body]
    local = lambda t: re.search(r"\b(LDL|STL)\b", t)  # noqa: E731
    return dict(
        instr=len(body),
        mufu=sum(o.startswith("MUFU") for o in ops),
        mma=sum(bool(_MMA.match(o)) for o in ops),
        local=sum(bool(local(t)) for t in body),
        loop_local_ops=sum(1 for addr, t in instrs if local(t) and any(a <= addr <= b for a, b in loops)),
    )


def block_flops(role, d_qk, d_v):
    """FLOPs of one kernel per 128 x 128 block of scores: fwd QK^T + PV; dkdv KQ^T, P^T dO, V dO^T, dS^T Q;
    dq QK^T, dO V^T, dS K."""
    per_score = {"fwd": d_qk + d_v, "dkdv": 2 * d_qk + 2 * d_v, "dq": 2 * d_qk + d_v}[role]
    return 2 * 128 * 128 * per_score


def block_cycles(stats, config, flops):
    """The cycle estimate per 128 x 128 block (module docstring) from loop_body_stats of one iteration."""
    bm, bn, warps, _ = config
    iters = 128 * 128 / (bm * bn)
    return max(stats["instr"] * iters * warps / 4, stats["mufu"] * iters * warps * 32 / 16, flops / 4096)


def sass_report(arch=90, dtype="bf16", as_json=False, head_dims=(64, 128)):
    """PoPE vs reference FA loop bodies for fwd, dkdv, dq at each d, first autotune candidate; prints a table
    (or one JSON object per row) and returns the rows."""
    import pope_kernel as pk

    rows = []
    if not as_json:
        print(f"sm_{arch}, {dtype}, causal, first autotune candidate; per 128 x 128 block of scores, unmasked loop:")
        print(
            "| kernel | d | config (BM, BN, warps, stages) | PoPE instr/warp, MUFU/thread, MMA | FA same tiles "
            "| PoPE cycles | FA cycles | ratio | local ops in loops (PoPE / FA) |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
    for role in ("fwd", "dkdv", "dq"):
        for d in head_dims:
            cfg = pk.CONFIGS[role][d][0]
            iters = 128 * 128 / (cfg[0] * cfg[1])
            pope = loop_body_stats(compile_kernel(role, cfg, d, arch, dtype, "pope"), arch)
            fa = loop_body_stats(compile_kernel(role, cfg, d, arch, dtype, "fa"), arch)
            pc = block_cycles(pope, cfg, block_flops(role, 2 * d, d))
            fc = block_cycles(fa, cfg, block_flops(role, d, d))
            row = dict(
                kernel=role,
                d=d,
                config=list(cfg),
                pope_cycles=round(pc),
                fa_cycles=round(fc),
                ratio=round(pc / fc, 3),
                loop_local_ops=pope["loop_local_ops"],
                fa_loop_local_ops=fa["loop_local_ops"],
                pope_instr=round(pope["instr"] * iters),
                pope_mufu=round(pope["mufu"] * iters),
                pope_mma=round(pope["mma"] * iters),
                fa_instr=round(fa["instr"] * iters),
                fa_mufu=round(fa["mufu"] * iters),
                fa_mma=round(fa["mma"] * iters),
            )
            rows.append(row)
            if as_json:
                print(json.dumps(row), flush=True)
            else:
                print(
                    f"| {role} | {d} | {tuple(cfg)} | {row['pope_instr']}, {row['pope_mufu']}, {row['pope_mma']} | "
                    f"{row['fa_instr']}, {row['fa_mufu']}, {row['fa_mma']} | {row['pope_cycles']} | "
                    f"{row['fa_cycles']} | {row['ratio']:.2f} | {row['loop_local_ops']} / "
                    f"{row['fa_loop_local_ops']} |",
                    flush=True,
                )
    return rows


def spill_report(archs=(80, 90, 100, 120), dtype="bf16"):
    """Print a markdown table of spill_stats for every autotune candidate of pope_kernel.CONFIGS."""
    import pope_kernel as pk

    print("| kernel | d | config (BM, BN, warps, stages) | sm | registers | spill st/ld (B) | local ops in loops |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for role in ("fwd", "dkdv", "dq"):
        for d in (64, 128):
            for cfg in pk.CONFIGS[role][d]:
                for arch in archs:
                    t0 = time.time()
                    regs, st, ld, loop_ops = spill_stats(compile_kernel(role, cfg, d, arch, dtype), arch)
                    rows.append((role, d, cfg, arch, regs, st, ld, loop_ops))
                    print(
                        f"| {role} | {d} | {cfg} | {arch} | {regs} | {st}/{ld} | {loop_ops} |   "
                        f"<!-- {time.time() - t0:.0f} s -->",
                        flush=True,
                    )
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--n-head", type=int, default=None)
    p.add_argument(
        "--n-kv-head", type=int, default=None, help="key/value heads (grouped-query attention); default n-head"
    )
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(DEFAULT_IMPLS))
    p.add_argument("--sass", action="store_true", help="no GPU needed: loop-body SASS of PoPE vs reference FA")
    p.add_argument("--json", action="store_true", help="with --sass: one JSON object per row")
    p.add_argument(
        "--arch",
        type=int,
        default=None,
        help="with --sass: the sm_ architecture (default 90); with --spills: only this one",
    )
    p.add_argument(
        "--spills",
        action="store_true",
        help="no GPU needed: compile every autotune config for sm_80, "
        "sm_90, sm_100 and sm_120 and print registers, spills and local-memory ops inside loops",
    )
    p.add_argument(
        "--ops",
        action="store_true",
        help="no GPU needed: eager PyTorch ops around the kernels in one "
        "compiled attention call, forward and backward (count_eager_ops)",
    )
    p.add_argument(
        "--decode-sass",
        action="store_true",
        help="no GPU needed: the decode kernel compiled for sm_80, "
        "86, 89, 90, 100, 120: shared memory, spills, loop instructions next to a RoPE decode kernel",
    )
    p.add_argument(
        "--doc_len",
        type=int,
        default=None,
        help="block_causal vs causal with documents of this mean length (exponential, seeded) at T = 4096, 16384, "
        "d = 64: CUDA times fwd and fwd+bwd; a CPU reports the tiles each kernel visits against the formula",
    )
    args = p.parse_args(argv)
    if args.doc_len is not None:
        seq_lens = args.seq_lens if "--seq-lens" in (argv or sys.argv) else (4096, 16384)
        if torch.cuda.is_available():
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
            print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
            return bench_documents(args.doc_len, seq_lens, 64, dtype, args.batch, args.n_head)
        os.environ["TRITON_INTERPRET"] = "1"  # before pope_kernel is imported: the kernels' COUNT in the interpreter
        return doc_tile_report(args.doc_len, seq_lens)
    if args.ops:
        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"  # before pope / pope_kernel are imported
        device = "cuda" if torch.cuda.is_available() else "cpu"
        rows = [
            dict(case=name, **count_eager_ops(device=device, **kw))
            for name, kw in (
                ("MHA, 4 heads, delta", {}),
                ("GQA 4/2, no delta", dict(H_kv=2, delta=False)),
                ("MHA, eager (not compiled)", dict(compiled=False)),
            )
        ]
        for r in rows:
            print(f"{r['case']:<28} eager ops {r['ops']:>4}  Triton launches {r['triton_kernels']}  {r['by_op']}")
        return rows
    if args.decode_sass:
        print(__import__("pope_kernel").decode_split_table(), "\n")
        return decode_sass_report(dtype=args.dtype, as_json=args.json)
    if args.sass or args.json:
        return sass_report(args.arch or 90, args.dtype, as_json=args.json)
    if args.spills:
        return spill_report(**({"archs": (args.arch,)} if args.arch else {}), dtype=args.dtype)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if torch.cuda.is_available():
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, dtype {dtype}")
        print(f"torch.nn.attention flash implementation: {flash_implementation()}")
        rows = bench_attention_kernels(
            "cuda",
            dtype,
            args.seq_lens,
            args.head_dims,
            args.batch,
            args.n_head,
            impls=args.impls,
            verbose=False,
            n_kv_head=args.n_kv_head,
        )
        print_table(rows)
        return rows
    print(
        "CUDA is not available: kernel timings need an NVIDIA GPU (e.g. H100 / A100).\n"
        "Running one tiny shape through the Triton interpreter instead (a smoke test; its times are "
        "interpreter times, not kernel performance)."
    )
    os.environ["TRITON_INTERPRET"] = "1"  # before pope / pope_kernel (and triton.language) are imported
    from pope import pope_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=gen) for _ in range(3))
    delta = -2 * math.pi * torch.rand(2, 16, generator=gen)
    print(f"eager ops around the kernels per compiled call: {count_eager_ops()['ops']} (--ops for more)")
    err = (
        (pope_attention(q, k, v, delta, backend="triton") - pope_attention(q, k, v, delta, backend="torch")).abs().max()
    )
    print(f"max |triton - torch| on (1, 2, 64, 16) fp32: {err:.2e}")
    rows = bench_attention_kernels(
        "cpu",
        torch.float32,
        seq_lens=(64,),
        head_dims=(16,),
        batch=1,
        n_head=2,
        impls=("pope_triton", "pope_sdpa", "rope_sdpa"),
        verbose=False,
    )
    print_table(rows, ratios=False)
    return rows


if __name__ == "__main__":
    main()
