"""Attention kernel benchmark: PoPE (fused Triton kernel) vs PoPE through SDPA vs RoPE through SDPA.

    python bench_kernel.py                       # CUDA: the default sweep, printed as a table
    python bench_kernel.py --seq-lens 4096 --head-dims 64 --dtype bf16 --batch 8 --n-head 12
    python bench_kernel.py --spills               # no GPU: registers / spills of every autotune config

Implementations (all causal, q/k/v of shape (B, H, T, d), fwd + bwd through autograd):
    pope_triton  pope_attention(backend='triton'): raw q/k in, magnitude, phases and softmax fused.
    pope_sdpa    pope_attention(backend='torch'): 2d-wide Cartesian q~/k~, V zero-padded to 2d, SDPA.
    rope_sdpa    RoPE rotation (torch ops, cos/sin tables precomputed outside the timing) followed by
                 SDPA pinned to the FlashAttention backend on CUDA: the usual baseline.

FLOP convention (causal, so half of the T x T scores): RoPE fwd = 2 * 2 * B*H*T*T*d / 2 (QK^T and PV,
2 FLOPs per multiply-add); PoPE's QK^T has width 2d, so PoPE fwd = 2 * B*H*T*T*(2d + d) / 2; bwd = 2.5 x fwd.
'tflops' is (fwd + bwd FLOPs) / fwdbwd time, with each implementation credited with its own
algorithmic FLOPs (pope_sdpa's zero padding of V is not credited).

Without CUDA this runs one tiny shape through the Triton interpreter as a smoke test (timings meaningless).
"""

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

IMPLS = ("pope_triton", "pope_sdpa", "rope_sdpa")


def attention_flops(impl, B, H, T, d, causal=True):
    """(fwd, bwd) FLOPs of one attention call under the convention in the module docstring."""
    qk_width = 2 * d if impl.startswith("pope") else d
    fwd = 2 * B * H * T * T * (qk_width + d) / (2 if causal else 1)
    return fwd, 2.5 * fwd


def _rope_tables(T, d, device, theta=10000.0):
    inv = theta ** (-torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    ang = torch.arange(T, device=device, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()


def _apply_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(x.dtype)


def _make_fn(impl, q, k, v, delta, cos, sin, use_flash):
    from pope_kernel import pope_attention
    if impl == "pope_triton":
        return lambda: pope_attention(q, k, v, delta, causal=True, backend="triton")
    if impl == "pope_sdpa":
        return lambda: pope_attention(q, k, v, delta, causal=True, backend="torch")

    def rope():
        qr, kr = _apply_rope(q, cos.to(q.dtype), sin.to(q.dtype)), _apply_rope(k, cos.to(q.dtype), sin.to(q.dtype))
        if use_flash:
            from torch.nn.attention import SDPBackend, sdpa_kernel
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qr, kr, v, is_causal=True)
        return F.scaled_dot_product_attention(qr, kr, v, is_causal=True)
    return rope


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


def bench_attention_kernels(device, dtype=torch.bfloat16, seq_lens=(1024, 2048, 4096, 8192, 16384),
                            head_dims=(64, 128), batch=None, n_head=None, impls=IMPLS, warmup=25, rep=100,
                            verbose=True):
    """Time forward, backward and forward+backward of the causal attention implementations.

    Args:
        device: torch device (or string). On CUDA, timings are triton.testing.do_bench medians in ms.
            On CPU 'pope_triton' needs TRITON_INTERPRET=1 and its times are interpreter times.
        dtype: input dtype of q, k, v (delta stays float32).
        seq_lens: sequence lengths T (tokens), Tq = Tk = T.
        head_dims: head dims d; v has width d too.
        batch: B; default max(1, 32768 // T) (about 32k tokens per call).
        n_head: H; default max(1, 768 // d).
        impls: subset of IMPLS.
    Returns:
        list of dicts {impl, T, d, B, H, fwd_ms, bwd_ms, fwdbwd_ms, tflops}; a failing case (e.g. out of
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
            q, k, v = (torch.randn(B, H, T, d, generator=gen).to(device, dtype).requires_grad_() for _ in range(3))
            delta = (-2 * math.pi * torch.rand(H, d, generator=gen)).to(device).requires_grad_()
            cos, sin = _rope_tables(T, d, device)
            for impl in impls:
                row = dict(impl=impl, T=T, d=d, B=B, H=H)
                leaves = [q, k, v, delta] if impl.startswith("pope") else [q, k, v]
                try:
                    fn = _make_fn(impl, q, k, v, delta, cos, sin, use_flash)
                    with torch.no_grad():
                        row["fwd_ms"] = bench(fn)
                    out = fn()
                    g = torch.randn_like(out)
                    row["bwd_ms"] = bench(lambda: out.backward(g, retain_graph=True), grad_to_none=leaves)
                    row["fwdbwd_ms"] = bench(lambda: fn().backward(g), grad_to_none=leaves)
                    f_fwd, f_bwd = attention_flops(impl, B, H, T, d)
                    row["tflops"] = (f_fwd + f_bwd) / (row["fwdbwd_ms"] * 1e-3) / 1e12
                    del out, g
                except Exception as e:  # noqa: BLE001 - keep sweeping (OOM at long T, unsupported case)
                    row.update(fwd_ms=float("nan"), bwd_ms=float("nan"), fwdbwd_ms=float("nan"),
                               tflops=float("nan"), error=f"{type(e).__name__}: {str(e)[:120]}")
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                for t in leaves:
                    t.grad = None
                rows.append(row)
                if verbose:
                    print(_format_row(row), flush=True)
    return rows


def _format_row(r):
    s = (f"{r['impl']:<12} {r['T']:>6} {r['d']:>4} {r['B']:>3} {r['H']:>3} {r['fwd_ms']:>9.3f} {r['bwd_ms']:>9.3f} "
         f"{r['fwdbwd_ms']:>10.3f} {r['tflops']:>7.1f}")
    return s + (f"  {r['error']}" if "error" in r else "")


def print_table(rows, ratios=True):
    """Table of the rows, then (ratios=True) PoPE-Triton / RoPE-SDPA fwd+bwd time ratios per (T, d)."""
    print(f"{'impl':<12} {'T':>6} {'d':>4} {'B':>3} {'H':>3} {'fwd_ms':>9} {'bwd_ms':>9} {'fwdbwd_ms':>10} {'TFLOPs':>7}")
    for r in rows:
        print(_format_row(r))
    by = {(r["impl"], r["T"], r["d"]): r for r in rows}
    ratio_rows = [(T, d, by[("pope_triton", T, d)]["fwdbwd_ms"] / by[("rope_sdpa", T, d)]["fwdbwd_ms"])
                  for (impl, T, d) in by if impl == "pope_triton" and ("rope_sdpa", T, d) in by]
    if ratios and ratio_rows:
        print("\npope_triton / rope_sdpa fwd+bwd time (target <= 1.5 at T=4096, d=64 on H100):")
        for T, d, x in ratio_rows:
            print(f"  T={T:>6} d={d:>4}: {x:.2f}x")

# ---- compile-only report: registers, spills and local-memory traffic per autotune config (no GPU) ----

_PTR_TYPES = {"Q": "*{dt}", "K": "*{dt}", "V": "*{dt}", "O": "*{dt}", "DO": "*{dt}", "DK": "*{dt}", "DV_": "*{dt}",
              "DQ": "*{dt}", "DCS": "*fp32", "COS_T": "*fp32", "SIN_T": "*fp32", "LSE": "*fp32", "DI": "*fp32",
              "DDELTA_PART": "*fp32", "qk_scale": "fp32", "sm_scale": "fp32"}


def compile_kernel(role, config, d, arch, dtype="bf16", dot_prec="tf32"):
    """Compile one PoPE kernel (causal, softplus, with delta) for sm_<arch> with Triton's bundled ptxas; no GPU.

    role: 'fwd' | 'dkdv' | 'dq'; config (BLOCK_M, BLOCK_N, num_warps, num_stages); d = dv head dim;
    dtype 'bf16' | 'fp16' | 'fp32'. Returns the triton CompiledKernel (asm: ptx, cubin).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import pope_kernel as pk
    bm, bn, warps, stages = config
    raw = pk._KERNEL_FNS[role]
    consts = dict(D=d, DV=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=True, MAG=0, HAS_DELTA=True, DOT_PREC=dot_prec, FAST=True)
    names = raw.__code__.co_varnames[:raw.__code__.co_argcount]
    sig = {n: "constexpr" if n in consts else _PTR_TYPES.get(n, "i32").format(dt=dtype) for n in names}
    fn = pk._JITFunction(pk._with_helpers(raw, pk._JITFunction))
    return triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=warps, num_stages=stages))


def spill_stats(kernel, arch):
    """(registers, spill store bytes, spill load bytes, local-memory instructions inside loops) of a compiled
    kernel: ptxas -v on its PTX, and the SASS (cuobjdump) between each backward branch and its target."""
    import re
    import subprocess
    import tempfile
    import triton
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        info = subprocess.run([os.path.join(bindir, "ptxas"), "-v", f"--gpu-name={gpu}", ptx, "-o", os.devnull],
                              capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    st, ld = (int(x) for x in re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info).groups())
    lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)
    instrs = [(int(a, 16), text) for a, text in lines]
    loops = []
    for addr, text in instrs:
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    in_loop = sum(1 for addr, text in instrs if re.search(r"\b(LDL|STL)\b", text)
                  and any(lo <= addr <= hi for lo, hi in loops))
    return regs, st, ld, in_loop


def spill_report(archs=(80, 90), dtype="bf16"):
    """Print a markdown table of spill_stats for every autotune candidate of pope_kernel._CONFIGS."""
    import pope_kernel as pk
    print(f"| kernel | d | config (BM, BN, warps, stages) | sm | registers | spill st/ld (B) | local ops in loops |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    for role in ("fwd", "dkdv", "dq"):
        for d in (64, 128):
            for cfg in pk._CONFIGS[role][d]:
                for arch in archs:
                    t0 = time.time()
                    regs, st, ld, loop_ops = spill_stats(compile_kernel(role, cfg, d, arch, dtype), arch)
                    rows.append((role, d, cfg, arch, regs, st, ld, loop_ops))
                    print(f"| {role} | {d} | {cfg} | {arch} | {regs} | {st}/{ld} | {loop_ops} |   "
                          f"<!-- {time.time() - t0:.0f} s -->", flush=True)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--n-head", type=int, default=None)
    p.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    p.add_argument("--spills", action="store_true", help="no GPU needed: compile every autotune config for sm_80 "
                   "and sm_90 and print registers, spills and local-memory ops inside loops")
    args = p.parse_args(argv)
    if args.spills:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        return spill_report(dtype=args.dtype)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if torch.cuda.is_available():
        print(f"device: {torch.cuda.get_device_name()}, dtype {dtype}")
        rows = bench_attention_kernels("cuda", dtype, args.seq_lens, args.head_dims, args.batch, args.n_head,
                                       impls=args.impls, verbose=False)
        print_table(rows)
        return rows
    print("CUDA is not available: kernel timings need an NVIDIA GPU (e.g. H100 / A100).\n"
          "Running one tiny shape through the Triton interpreter instead (a smoke test; its times are "
          "interpreter times, not kernel performance).")
    os.environ["TRITON_INTERPRET"] = "1"  # pope_kernel reads it at call time
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from pope_kernel import pope_attention
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16, generator=gen) for _ in range(3))
    delta = -2 * math.pi * torch.rand(2, 16, generator=gen)
    err = (pope_attention(q, k, v, delta, backend="triton") - pope_attention(q, k, v, delta, backend="torch")).abs().max()
    print(f"max |triton - torch| on (1, 2, 64, 16) fp32: {err:.2e}")
    rows = bench_attention_kernels("cpu", torch.float32, seq_lens=(64,), head_dims=(16,), batch=1, n_head=2,
                                   verbose=False)
    print_table(rows, ratios=False)
    return rows


if __name__ == "__main__":
    main()
