"""Benchmarks on the current device: RoPE vs PoPE, as tables.

    python bench.py                 # train step + attention micro-benchmark + O(T) memory check + decoding
    python bench.py --only=attn     # one section: step | attn | memory | decode | kernel | shard | bytes
    TRITON_INTERPRET=1 python bench.py --only=bytes --device=cpu   # Inductor's byte count (not in the default run)
    python bench.py --only=step --profile   # + where a step's time goes: kernel groups, top kernels, launches
    python bench.py --rounds=10     # more interleaved rounds (default 6, 15 for the training step; at least 5)
    python bench.py --only=decode --contexts 1024 4096 16384 [--gqa]   # decoding at those contexts
    python bench.py --dtype=float16 # the training step's compute dtype (default auto, as train.py)

1. Training step of the same GPT with rope vs pope (default: 6 layers, 384 wide, T=1024, GPT-2 vocab), in
   train.py's compute dtype (--dtype auto: bf16 from sm_80, fp16 with a GradScaler below, fp32 on a CPU):
   ms/iter, tokens/s, and the PoPE/RoPE time ratio next to the FLOP ratios (model.flops_per_token, and
   the torch path's, whose v is padded to 2d: the bound a CPU step can reach; see below).
2. Attention forward+backward at T=4096, d=64, 8 heads: RoPE through SDPA, PoPE through pope_attention,
   and the naive PoPE that hands SDPA 2d-wide q/k with d-wide v (SDPA then falls back to its O(T^2)
   math kernel, as PoPE-pytorch 0.2.1 does).
3. Peak memory of a PoPE forward at growing T (child processes): O(T) means doubling T doubles it.
4. Greedy decoding with the KV cache (6 layers x 384) at 1k, 4k and 16k tokens of context (--contexts):
   ms per new token for rope and pope, the cache's bytes per token for both encodings (and PoPE's rotation
   table's); --gqa adds 8 query heads sharing 2 key/value heads. Then one layer's attention for one new
   token at each context: RoPE, PoPE over the earlier 2d-wide Cartesian cache, PoPE over magnitudes, eager
   and under torch.compile. Section 1 also runs grouped-query attention (n_head 8, n_kv_head 2).
6. Bytes per rank of fp32 parameters, gradients and AdamW state under DDP and FSDP (train.py fsdp=True) at world
   1, 2 and 8, for the 124M, 774M and 1.5B shapes (sharding.memory_per_rank, from the shapes), and the 124M
   shape's FSDP bytes at world 2 measured from each rank's local shards after one step (two gloo processes).
   Then section 1's PoPE step (the 124M shape on CUDA) with no wrapper, DDP and FSDP, each at world 1.
7. Bytes per token per layer of one compiled training step (one layer, 768 wide, 12 heads of 64, bf16 autocast,
   forward and backward) from Inductor's own count, RoPE and PoPE (Triton path), by group and scheduler node,
   PoPE minus RoPE beside the design minimum (design_minimum_bytes derives it); --tokens sets the two token counts.
   Then PoPE's transform in eager mode: the bytes its aten ops move per element, forward and backward.
5. On CUDA: PoPE through pope_kernel.py's FlashAttention-2 vs PoPE through flex_attention vs RoPE through
   FlashAttention, bf16, T in {1k, 4k, 16k}, d in {64, 128} (bench_kernel.py, which also runs on its own).
Every PoPE/RoPE ratio comes from interleaved rounds (--rounds, at least 5): each round times every arm
once, in one order on even rounds and the reverse on odd ones, so a machine whose speed drifts (a shared
CPU: +-30 % over a minute) slows both arms alike. A ratio is the median of the per-round ratios, printed
with their min-max; times are each arm's median over the rounds, after a warm-up.

What the CPU can reach: model.flops_per_token counts PoPE's q/k at 2d and v at d (flop_ratio, 1.068 at
6 x 384, T=1024). The torch path pads v to 2d so that SDPA keeps its fused kernels, so attention's PV
work doubles too: its FLOPs (cpu_flop_ratio, torch_path_flops_per_token) are the bound a CPU step can reach.
"""

import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from cli import UserError, autocast_context, resolve_device, resolve_dtype
from model import GPT, GPTConfig, KVCache, apply_rope, device_peak_flops
from pope import polar_to_cartesian, pope_attention, pope_frequencies


def _sync(device):
    """Wait for the work queued on `device` ('cuda:N': that GPU, not the current one; CPU: nothing to wait for)."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def _cuda_peak_mb(fn, device):
    """Peak growth of torch's allocated memory on CUDA `device` ('cuda:N') during fn(), in MB (2^20 bytes)."""
    device = torch.device(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


MIN_ROUNDS = 5
STEP_ROUNDS = 15  # the training step's rounds by default (--rounds sets every table's)


def interleaved(fns, device, rounds, warmup=1):
    """Seconds of each arm, measured in `rounds` interleaved rounds: {name: [seconds per round]}.

    fns: {name: fn}. Each round calls every fn once, in the dict's order on even rounds and reversed on
    odd ones. A fn that returns a number reports its own seconds (e.g. a median over decoding steps);
    otherwise its call is timed. Every fn runs `warmup` times first, interleaved the same way.
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            _sync(device)
            t = time.perf_counter()
            own = fns[name]()
            _sync(device)
            times[name].append(own if isinstance(own, (int, float)) else time.perf_counter() - t)
    return times


def ratio_stats(num, den):
    """Per-round ratios num[r] / den[r] -> (median, min, max)."""
    ratios = [a / b for a, b in zip(num, den)]
    return statistics.median(ratios), min(ratios), max(ratios)


def fmt_ratio(stats):
    """(median, min, max) -> '1.15 (1.07-1.24)'."""
    return f"{stats[0]:.2f} ({stats[1]:.2f}-{stats[2]:.2f})"


def torch_path_flops_per_token(model, seq_len):
    """Training FLOPs per token of PoPE's torch path (model.flops_per_token's convention): q/k at 2d and v
    padded to 2d, so attention costs 6 * n_layer * n_head * seq_len * 4d; RoPE/NoPE as flops_per_token."""
    cfg = model.config
    if cfg.pos_encoding != "pope":
        return model.flops_per_token(seq_len)
    hd = cfg.n_embd // cfg.n_head
    return 6 * model.get_num_params() + 6 * cfg.n_layer * cfg.n_head * seq_len * 4 * hd


def train_step_precision(device, dtype="auto"):
    """(dtype name, autocast context, GradScaler) of a training step on `device`, as train.py sets them up:
    cli.resolve_dtype's compute dtype ('auto': bfloat16 on a GPU with native bf16, compute capability >= 8.0
    asked of that device; float16 below, V100 / T4; float32 on a CPU), cli.autocast_context, and a GradScaler
    enabled for float16 only. Raises cli.UserError for an unknown dtype name."""
    name = resolve_dtype(dtype, device)
    scaler = torch.amp.GradScaler(torch.device(device).type, enabled=name == "float16")
    return name, autocast_context(device, name), scaler


STEP_SHAPES = {
    "cuda": dict(n_layer=12, n_embd=768, n_head=12, T=1024, batch_size=8),  # GPT-2 124M, train_owt
    "cpu": dict(n_layer=6, n_embd=384, n_head=6, T=1024, batch_size=2),
}


def bench_train_step(
    device,
    n_layer=6,
    n_embd=384,
    n_head=6,
    T=1024,
    batch_size=2,
    vocab_size=50304,
    rounds=STEP_ROUNDS,
    n_kv_head=None,
    dtype="auto",
    compile=None,
    profile=False,
    eval_pass=False,
    grad_clip=1.0,
):
    """One AdamW training step (fwd + bwd + step) of the same GPT with rope and pope, in interleaved rounds, as
    train.py runs it: its compute dtype (train_step_precision) and torch.compile on CUDA (compile=None; True /
    False force it). Returns one row per encoding: ms per step, tokens/s, MFU (model.estimate_mfu against
    device_peak_flops; None on a CPU or an unknown GPU), FLOPs per token; PoPE's row adds the PoPE/RoPE time
    ratio (median and range of the per-round ratios) beside the FLOP ratio (model.flops_per_token) and the
    torch path's (v padded to 2d: the bound of a CPU step). profile=True adds profile_step's breakdown of one
    more step of each, and under 'kernels' profile_kernels' table (print_kernel_tables prints both side by side).
    eval_pass=True: then one evaluation forward of each model as train.py runs it (the raw
    model, eager, eval mode, no_grad) and the same rounds again: ms_after_eval (issue 51: PoPE's H200 step went
    from 41.6 to 48.9 ms after an evaluation). n_kv_head: key/value heads (grouped-query attention), None = n_head.
    The step is train.py's: gradients clipped to grad_clip (its default 1.0; 0 skips) after unscaling, then AdamW,
    then every PoPE delta clamped to [-2 pi, 0]. rounds: 15 by default (STEP_ROUNDS): a step's time varies by a
    few per cent round to round, and 6 rounds gave ratios whose range was as wide as the effect."""
    steps, models = {}, {}
    name, amp, scaler = train_step_precision(device, dtype)
    compile = str(device).startswith("cuda") if compile is None else compile
    for pe in ("rope", "pope"):
        torch.manual_seed(0)
        model = GPT(
            GPTConfig(
                block_size=T,
                vocab_size=vocab_size,
                n_layer=n_layer,
                n_head=n_head,
                n_embd=n_embd,
                n_kv_head=n_kv_head,
                pos_encoding=pe,
            )
        ).to(device)
        opt = model.configure_optimizers(0.01, 1e-4, (0.9, 0.99), str(device).split(":")[0])
        x = torch.randint(0, vocab_size, (batch_size, T), device=device)
        fwd = torch.compile(model) if compile else model

        def step(model=fwd, raw=model, opt=opt, x=x):  # train.py's step: clip, AdamW, then delta clamped
            with torch.profiler.record_function(PHASES["fwd"]), amp:  # PHASES: profile_kernels' phases
                _, loss = model(x, x)
            with torch.profiler.record_function(PHASES["bwd"]):
                scaler.scale(loss).backward()
            with torch.profiler.record_function(PHASES["optimizer"]):
                if grad_clip:
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(raw.parameters(), grad_clip)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
                raw.clamp_pope_delta_()

        steps[pe], models[pe] = step, model
    times = interleaved(steps, device, rounds, warmup=2 if compile else 1)
    after_eval = None
    if eval_pass:  # train.py's evaluation: the raw model, eager, in eval mode under no_grad; then the same steps again
        with torch.no_grad(), amp:
            for model in models.values():
                model.eval()
                model(x[:, :T])
                model.train()
        after_eval = interleaved(steps, device, rounds, warmup=0)
    peak = device_peak_flops(device, name)
    rows = []
    for pe, model in models.items():
        dt = statistics.median(times[pe])
        mfu = model.estimate_mfu(batch_size * T, T, dt, peak)
        rows.append(
            {
                "pos_encoding": pe,
                "dtype": name,
                "compiled": compile,
                "ms_per_step": 1000 * dt,
                "tokens_per_s": batch_size * T / dt,
                "mfu": "" if mfu is None else f"{100 * mfu:.1f} %",
                "flops_per_token": model.flops_per_token(T),
                "torch_path_flops": torch_path_flops_per_token(model, T),
            }
        )
        if after_eval:
            rows[-1]["ms_after_eval"] = 1000 * statistics.median(after_eval[pe])
        if profile:
            rows[-1].update(profile_step(steps[pe], device))
            rows[-1]["kernels"] = profile_kernels(steps[pe], device)
    rows[1]["time_ratio"] = fmt_ratio(ratio_stats(times["pope"], times["rope"]))
    rows[1]["flop_ratio"] = rows[1]["flops_per_token"] / rows[0]["flops_per_token"]
    rows[1]["cpu_flop_ratio"] = rows[1]["torch_path_flops"] / rows[0]["torch_path_flops"]
    return rows


# kernel (GPU) or op (CPU) names counted as attention, lower case: PoPE's Triton kernels (pope_kernel.py), SDPA's
# flash, memory-efficient, cuDNN and CPU kernels and their backward nodes
ATTENTION_NAMES = (
    "_fwd_kernel",
    "_pre_kernel",
    "_dkdv_kernel",
    "_dq_kernel",
    "flash",
    "fmha",
    "attention",
    "cudnn",
    "sdpa",
    "pope::",
)


def _profiled(step, device, n_steps):
    """One warm-up step, then `n_steps` steps under torch.profiler (CPU, and CUDA on a GPU) -> (the profile, their
    wall time in us)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    _sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if str(device).startswith("cuda") else [])
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        for _ in range(n_steps):
            step()
        _sync(device)
        wall = (time.perf_counter() - t) * 1e6
    return prof, wall


def profile_step(step, device, n_steps=2):
    """Where `n_steps` steps' time goes (torch.profiler), in ms per step. CUDA: GPU time in attention kernels
    (ATTENTION_NAMES), in other kernels, and GPU idle (the step's wall time not covered by any kernel: launch
    overhead, host work, syncs). CPU: the self time of attention ops and of all other ops, and the wall time
    not spent in any op (Python, the compiled wrapper)."""
    cuda = str(device).startswith("cuda")
    prof, wall = _profiled(step, device, n_steps)
    events = [e for e in prof.events() if (e.device_type == torch.autograd.DeviceType.CUDA) == cuda]
    if (
        not cuda
    ):  # outermost CPU ops only (inside the step's PHASES ranges): their self and child times are in their total
        events = [e for e in events if _top_level(e)]
    attn = sum(e.time_range.elapsed_us() for e in events if any(n in e.name.lower() for n in ATTENTION_NAMES))
    busy = _union_us([(e.time_range.start, e.time_range.end) for e in events])
    other = sum(e.time_range.elapsed_us() for e in events) - attn
    per = 1e3 * n_steps
    return {"attention_ms": attn / per, "other_ms": other / per, "idle_ms": max(wall - busy, 0.0) / per}


# ---- section 7: bytes moved by one compiled training step (Inductor's own count) ------------------------------------
BYTES_SHAPE = dict(n_embd=768, n_head=12, tokens=(512, 1024))  # GPT-2 124M's layer; the token counts
BYTE_GROUPS = (
    "matmul",
    "attention",
    "pope transform fwd",
    "pope transform recompute",
    "pope transform bwd",
    "pope ddelta",
    "rope transform",
    "norms, pointwise",
)


def design_minimum_bytes(n_embd=768, n_kv_embd=None, elem=2, transform_only=False):
    """PoPE's extra bytes per token per layer over RoPE's that the design needs (the transform outside the kernels,
    q~ and k~ recomputed for the backward), one compiled training step in a 16-bit dtype (elem = 2 bytes). Per
    element of raw q (and of k), counting every buffer a kernel writes or reads once:

                  RoPE (q_r d wide)                         PoPE (q~ 2d wide)
        forward   read q 2, write q_r 2, attention reads 2  read q 2, write q~ 4, attention reads q~ 4
        recompute -                                         read q 2, write q~ 4
        backward  attention reads q_r 2, writes dq_r 2;     attention reads q~ 4, writes dq~ 4;
                  rope bwd reads dq_r 2, writes dq 2        transform bwd reads dq~ 4 and q 2, writes dq 2
        sum       14 bytes                                  32 bytes

    18 bytes per element more (9 elem), for the n_embd elements of q and the n_kv_embd (default n_embd) of k per token:
    27,648 bytes (27.6 KB) per token per layer at 768 wide. d(delta) adds nothing where its reduction shares the pass
    that reads dk~ and k; the float32 table rows ([cos | sin], 8 d bytes per token, shared by the heads) add about 1 %
    per read. Forming q~, k~ inside the attention kernels would drop the write, recompute and read of q~ (12 of 18).
    PoPE's transform alone (the table's middle column without the attention's reads and writes) needs 20 bytes per
    element (10 elem): design_minimum_bytes(..., transform_only=True), 30,720 bytes per token per layer at 768 wide.

    Inductor's count of RoPE's rotation is not this table's 8 bytes per element: on the CPU it moves about 27 (bench.py
    --only=bytes, group 'rope transform'), so the measured PoPE minus RoPE can fall below this minimum."""
    n_kv_embd = n_embd if n_kv_embd is None else n_kv_embd
    return (10 if transform_only else 9) * elem * (n_embd + n_kv_embd)


def _metrics_logger():
    """Inductor's metrics logger: at INFO, each compiled graph adds its byte count to torch._inductor.metrics."""
    import logging

    from torch._inductor import compile_fx

    logger = getattr(compile_fx, "inductor_metrics_log", None)
    if logger is None:  # pragma: no cover - a torch whose Inductor moved it
        raise RuntimeError(f"torch {torch.__version__}: torch._inductor.compile_fx.inductor_metrics_log is missing")
    return logger, logging.INFO


def _repo_frames(origins):
    """(file, function) of the innermost frame in this repo of each FX node's stack trace: where its op came from."""
    here = os.path.dirname(os.path.abspath(__file__))
    frames = set()
    for o in origins:
        last = None
        for line in (o.meta.get("stack_trace") or "").splitlines():
            line = line.strip()
            if line.startswith('File "') and here in line:
                name = os.path.basename(line.split('"')[1])
                last = (name, line.rsplit(" in ", 1)[-1])
        if last:
            frames.add(last)
    return frames


# pope.py's functions whose ops are the transform (the innermost repo frame of an op): pope_cartesian, its helpers and
# _Cartesian's forward and backward, and _triton_region (each token's table rows); not sdpa_attention's layout ops
POPE_TRANSFORM_FUNCTIONS = (
    "pope_cartesian",
    "pope_magnitude",
    "_pair_magnitudes",
    "_pair_rotations",
    "_magnitude_grad",
    "forward",
    "backward",
    "_triton_region",
)


def _byte_group(node, graph):
    """BYTE_GROUPS' name of an Inductor scheduler node of the 'fwd' or 'bwd' graph: an extern matmul or attention
    op by its kernel; else by where its ops came from (their stack traces): pope.py's transform
    (POPE_TRANSFORM_FUNCTIONS; in the backward recomputed where an op carries the selective checkpoint's recompute
    tag and none comes from a backward formula, else its gradient; a reduction there is d(delta)), model.py's
    rope_rotate, or the rest."""
    snodes = node.get_nodes() if hasattr(node, "get_nodes") else [node]
    irs = [s.node for s in snodes if getattr(s, "node", None) is not None]
    kernel = " ".join(str(getattr(n, "python_kernel_name", "") or "") for n in irs).lower()
    if any(a in kernel for a in ("pope.", "scaled_dot_product", "flash_attention", "efficient_attention")):
        return "attention"
    if any(m in kernel for m in ("mm", "bmm", "addmm", "matmul")):
        return "matmul"
    origins = [o for n in irs for o in n.origins]
    frames = _repo_frames(origins)
    if any(f == "pope.py" and fn in POPE_TRANSFORM_FUNCTIONS for f, fn in frames):
        if graph == "fwd":
            return "pope transform fwd"
        # recomputed: some op carries the checkpoint's recompute tag and none comes from a backward formula
        gradient = any(f == "pope.py" and fn == "backward" for f, fn in frames)
        if not gradient and any(o.meta.get("recompute") is not None for o in origins):
            return "pope transform recompute"
        return "pope ddelta" if node.is_reduction() else "pope transform bwd"
    if any(f == "model.py" and fn == "rope_rotate" for f, fn in frames):
        return "rope transform"
    return "norms, pointwise"


def compiled_step_bytes(
    pos_encoding,
    T,
    batch_size=1,
    n_embd=768,
    n_head=12,
    n_kv_head=None,
    backend="triton",
    dtype=torch.bfloat16,
    device="cpu",
):
    """Inductor's byte count of one compiled training step (forward and backward, torch.compile's default backend)
    of one transformer layer (model.Block: RMSNorm, attention with pos_encoding, MLP) on `device`, under `dtype`
    autocast, for batch_size x T tokens -> a list of {'graph': 'fwd' | 'bwd', 'node': Inductor's scheduler node
    name, 'group': one of BYTE_GROUPS (_byte_group), 'bytes': int, 'ops': its first FX ops}.

    The count is Inductor's (torch._inductor.metrics with its metrics log at INFO; caches off, so every graph is
    compiled and counted): each scheduler node's buffers read and written once, extern kernels (matmuls, the
    attention ops) included. On the CPU PoPE's Triton path runs its kernels in the interpreter (TRITON_INTERPRET=1
    before pope_kernel is imported) and the graph around them is what a CUDA step compiles, but CPU Inductor fuses
    somewhat differently from CUDA Inductor (its C++ backend stores a broadcast exp / log1p in a buffer): a proxy;
    on CUDA the count is the GPU step's. The input needs a gradient (as a layer's input in a GPT does)."""
    from torch._inductor import config as inductor_config
    from torch._inductor import metrics

    from model import Block, rotation_table

    torch.manual_seed(0)
    cfg = GPTConfig(
        n_layer=1,
        n_head=n_head,
        n_kv_head=n_kv_head,
        n_embd=n_embd,
        block_size=T,
        vocab_size=64,
        pos_encoding=pos_encoding,
        attn_backend=backend,
        pope_delta_init="uniform",
        dropout=0.0,
        bias=False,
    )
    block, rotation = Block(cfg, 0).to(device), rotation_table(cfg, T, device)
    x = torch.randn(batch_size, T, n_embd, device=device, requires_grad=True)
    grad = torch.randn(batch_size, T, n_embd, device=device)
    logger, info = _metrics_logger()
    level, propagate = logger.level, logger.propagate
    torch._dynamo.reset()
    metrics.reset()
    logger.setLevel(info)
    logger.propagate = False  # counted, not printed
    try:
        with inductor_config.patch(force_disable_caches=True):
            forward = torch.compile(lambda x: block(x, rotation))
            with torch.autocast(torch.device(device).type, dtype=dtype):
                y = forward(x)
            n_fwd = len(metrics.nodes_num_elem)
            y.backward(grad)
        nodes = list(metrics.nodes_num_elem)
        total = metrics.num_bytes_accessed
    finally:
        logger.setLevel(level)
        logger.propagate = propagate
        torch._dynamo.reset()
    rows = []
    for i, (node, elems) in enumerate(nodes):
        graph = "fwd" if i < n_fwd else "bwd"
        snodes = node.get_nodes() if hasattr(node, "get_nodes") else [node]
        ops = sorted({o.name for s in snodes if getattr(s, "node", None) is not None for o in s.node.origins})
        rows.append(
            {"graph": graph, "node": node.get_name(), "group": _byte_group(node, graph), "bytes": 4 * elems, "ops": ops}
        )
    # metrics keeps num_bytes // 4 per node: the total is the exact sum
    assert total - sum(r["bytes"] for r in rows) < 4 * len(rows), (total, sum(r["bytes"] for r in rows))
    return rows


def bench_bytes(
    tokens=BYTES_SHAPE["tokens"], n_embd=768, n_head=12, n_kv_head=None, batch_size=1, top=12, device="cpu"
):
    """Section 7: bytes per token per layer of a compiled training step for rope and pope (the Triton path), from
    compiled_step_bytes at two token counts T1 < T2 (batch_size x T tokens): the slope (bytes(T2) - bytes(T1)) /
    (tokens2 - tokens1), which leaves out what does not grow with the tokens (the weights' casts and gradients).
    -> (summary: one row per encoding, bytes per token and, on PoPE's row, PoPE minus RoPE beside
    design_minimum_bytes, and the bytes of PoPE's transform groups beside design_minimum_bytes(transform_only=True);
    groups: bytes per token per BYTE_GROUPS group, fwd and bwd, both encodings, and their total;
    kernels: each encoding's `top` scheduler nodes by their own slope, side by side by rank, with their first ops)."""
    per = {}
    for pe in ("rope", "pope"):
        per[pe] = {T: compiled_step_bytes(pe, T, batch_size, n_embd, n_head, n_kv_head, device=device) for T in tokens}
    t1, t2 = tokens[0] * batch_size, tokens[-1] * batch_size

    def slope(pe, keep=lambda r: True):
        a, b = (sum(r["bytes"] for r in per[pe][T] if keep(r)) for T in tokens)
        return (b - a) / (t2 - t1)

    summary = [
        {
            "pos_encoding": pe,
            "bytes_per_token": slope(pe),
            f"bytes_at_{t2}_tokens": sum(r["bytes"] for r in per[pe][tokens[-1]]),
        }
        for pe in per
    ]
    extra = summary[1]["bytes_per_token"] - summary[0]["bytes_per_token"]
    summary[1]["pope_minus_rope"] = extra
    n_kv_embd = None if n_kv_head is None else n_embd // n_head * n_kv_head
    summary[1]["design_minimum"] = float(design_minimum_bytes(n_embd, n_kv_embd))
    summary[1]["pope_transform"] = slope("pope", lambda r: r["group"].startswith("pope"))
    summary[1]["design_transform"] = float(design_minimum_bytes(n_embd, n_kv_embd, transform_only=True))
    groups = []
    for group in BYTE_GROUPS:
        row = {"group": group}
        for pe in per:
            for graph in ("fwd", "bwd"):
                row[f"{pe} {graph}"] = slope(pe, lambda r: r["group"] == group and r["graph"] == graph)
        row["pope - rope"] = sum(row[f"pope {g}"] - row[f"rope {g}"] for g in ("fwd", "bwd"))
        groups.append(row)
    total = {"group": "total"}
    for key in groups[0]:
        if key != "group":
            total[key] = sum(r[key] for r in groups)
    groups.append(total)
    kernels = [{} for _ in range(top)]
    for pe in per:  # each node's own slope, matched by graph and name (one graph at both token counts)
        first = {(r["graph"], r["node"]): r["bytes"] for r in per[pe][tokens[0]]}
        nodes = [(r, (r["bytes"] - first.get((r["graph"], r["node"]), 0)) / (t2 - t1)) for r in per[pe][tokens[-1]]]
        for row, (r, b) in zip(kernels, sorted(nodes, key=lambda n: -n[1])):
            row.update({f"{pe} node": f"{r['graph']} {r['node']}", f"{pe} group": r["group"], f"{pe} B/token": b})
            row[f"{pe} ops"] = ",".join(r["ops"][:3])
    return summary, groups, kernels


_NO_DATA_OPS = frozenset(("_unsafe_view", "lift_fresh"))  # no data moved, though their schemas are no views


def _tensor_bytes(t):
    """Bytes of the elements tensor t holds: a broadcast (stride 0) dimension counts once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        n *= size if stride != 0 else 1
    return n * t.element_size()


def dispatch_bytes(fn):
    """Run fn() and count the aten ops it dispatches that move data, and their bytes: every tensor an op takes or
    returns, each at the elements it holds (_tensor_bytes: a broadcast input once), views, ops without tensors and
    _NO_DATA_OPS left out (TorchDispatchMode) -> (fn's result, ops, bytes). Eager kernels read each input and write
    each output once, so on any device this is what eager mode moves; an op writing into a given tensor (copy_,
    out=) counts that tensor as read too."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Count(TorchDispatchMode):
        ops = moved = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            if tensors and not func.is_view and func.overloadpacket.__name__ not in _NO_DATA_OPS:
                self.ops += 1
                self.moved += sum(_tensor_bytes(t) for t in tensors)
            return out

    with Count() as c:
        out = fn()
    return out, c.ops, c.moved


def eager_transform_bytes(B=4, H=12, T=256, d=64, dtype=torch.bfloat16, device="cpu"):
    """PoPE's transform in eager mode (pope.pope_cartesian of keys with delta, result in `dtype`, as
    pope_attention_triton calls it without torch.compile), forward and backward, counted by dispatch_bytes, per
    element of x (B, H, T, d) -> {'fwd_ops', 'fwd_bytes', 'bwd_ops', 'bwd_bytes', 'design_fwd', 'design_bwd'}. The
    compiled step's count is compiled_step_bytes. design (e = dtype's bytes): the forward reads x and writes the
    2d-wide result, 3e; the backward reads the 2d-wide gradient and x and writes dx, then reads both again for
    delta's reduction, 7e (6 and 14 B for bf16). Of what eager mode moves beyond that, delta's rotations (H, T, 2, d)
    in float32 cost each direction 50 to 60 / B bytes per element of x (the same per position for any B), the
    float32 passes over x's elements the rest. The H200 timed the eager path (bench_kernel.py's pope_triton) slower
    after issue 67: docs/benchmarks.md."""
    from pope import pope_cartesian, pope_rotation_table

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(B, H, T, d, generator=g, device=device, dtype=dtype).requires_grad_()
    delta = torch.rand(H, d, generator=g, device=device).mul(-2 * math.pi).requires_grad_()
    rows = pope_rotation_table(T, d, device=device)
    grad = torch.randn(B, H, T, 2 * d, generator=g, device=device, dtype=dtype)
    out, fwd_ops, fwd_moved = dispatch_bytes(lambda: pope_cartesian(x, rows, delta, dtype=dtype))
    _, bwd_ops, bwd_moved = dispatch_bytes(lambda: torch.autograd.grad(out, (x, delta), grad))
    n, e = x.numel(), x.element_size()
    return {
        "fwd_ops": fwd_ops,
        "fwd_bytes": fwd_moved / n,
        "bwd_ops": bwd_ops,
        "bwd_bytes": bwd_moved / n,
        "design_fwd": 3.0 * e,
        "design_bwd": 7.0 * e,
    }


def print_bytes(tokens=BYTES_SHAPE["tokens"], **kw):
    """Section 7's tables (bench_bytes), with the design minimum and the issue's target beside PoPE minus RoPE."""
    summary, groups, kernels = bench_bytes(tokens, **kw)
    shape = (
        f"{kw.get('n_embd', 768)} wide, {kw.get('n_head', 12)} heads, bf16 autocast, "
        f"tokens {tokens[0]} -> {tokens[1]}, {kw.get('device', 'cpu')}"
    )
    print_table(f"bytes per token per layer, one compiled training step (Inductor's count), {shape}", summary)
    print_table("bytes per token per layer by group (fwd / bwd graphs)", groups)
    print_table("the largest scheduler nodes, bytes per token, side by side by rank", kernels)
    p = summary[1]
    print(
        f"\nPoPE minus RoPE: {p['pope_minus_rope'] / 1e3:.1f} KB per token per layer; design minimum "
        f"{p['design_minimum'] / 1e3:.1f} KB; PoPE's transform {p['pope_transform'] / 1e3:.1f} KB, design "
        f"{p['design_transform'] / 1e3:.1f} KB (issue 67's target: PoPE minus RoPE <= 30 KB)"
    )
    e = eager_transform_bytes(device=kw.get("device", "cpu"))
    print(
        f"PoPE's transform in eager mode (pope_cartesian of keys, bf16, 4 x 12 x 256 x 64), bytes per element of x: "
        f"forward {e['fwd_bytes']:.1f} in {e['fwd_ops']} ops (design {e['design_fwd']:.0f}), backward "
        f"{e['bwd_bytes']:.1f} in {e['bwd_ops']} ops (design {e['design_bwd']:.0f})"
    )


PHASES = {"fwd": "bench::forward", "bwd": "bench::backward", "optimizer": "bench::optimizer"}  # the step's ranges
KERNEL_GROUPS = (
    "matmul",
    "attention",
    "pope transform fwd",
    "pope transform recompute",
    "pope transform bwd",
    "norms, pointwise",
    "optimizer",
)
# lower-case substrings of kernel (CUDA) or op (CPU) names: cuBLAS / CUTLASS GEMMs and the aten ops that call them
# (eager CPU backward: the autograd nodes MmBackward0, ...)
MATMUL_NAMES = (
    "gemm",
    "cutlass",
    "xmma",
    "nvjet",
    "cublas",
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::linear",
    ": mmbackward",
    ": addmmbackward",
    ": bmmbackward",
)
# PoPE's transform: its magnitude softplus is in the name of every kernel Inductor fuses it into (descriptive kernel
# names list the fused aten ops), or is the op itself (eager); its gradient (pope._Cartesian.backward) is an autograd
# node named _CartesianBackward (eager) or kernels with sigmoid (dx) and a sum (d(delta)) in their names
POPE_TRANSFORM_NAMES = ("softplus", "cartesian", "sigmoid")
GRADIENT_NAMES = ("backward", "sigmoid", "sum", "triton_red")


# AdamW's kernels by name, in whatever phase the profiler places them (on an H200 RoPE's fused AdamW,
# multi_tensor_apply_kernel<...FusedAdamMathFunctor...>, fell outside the optimizer's GPU range); not every
# multi_tensor_apply or _foreach_ op: FSDP2's copy-in in the forward is one
OPTIMIZER_NAMES = ("adam", "optimizer.")
# Inductor's generated kernels, whose descriptive names list the aten ops they fuse: one named after PoPE's custom op
# it feeds (..._attention_forward_..., ..._attention_backward_...) is no attention kernel but the transform's
INDUCTOR_PREFIXES = ("triton_poi_", "triton_red_", "triton_per_")
POPE_OP_NAMES = ("attention_forward", "attention_backward")


def kernel_group(name, phase):
    """KERNEL_GROUPS' group of a kernel (CUDA) or top-level op (CPU) of the training step by its name and the step's
    phase ('fwd', 'bwd', 'optimizer') it ran in: everything in the optimizer phase, and AdamW's kernels anywhere
    (OPTIMIZER_NAMES), is 'optimizer' (clipping, AdamW, the delta clamp); else attention (ATTENTION_NAMES, never an
    Inductor kernel: INDUCTOR_PREFIXES), matmul (MATMUL_NAMES), PoPE's transform (POPE_TRANSFORM_NAMES, or an
    Inductor kernel named after PoPE's custom ops, POPE_OP_NAMES: fwd in the forward; in the backward recompute, or
    bwd when the name holds a gradient op, GRADIENT_NAMES, the op attention_backward aside); the rest 'norms,
    pointwise' (RoPE's rotation among them). A heuristic on names: a transform kernel that Inductor fuses with no op
    of those names counts as pointwise, as do the eager transform's mul ops; bench.py --only=bytes attributes bytes
    by the ops' source lines instead."""
    n = name.lower()
    if phase == "optimizer" or any(o in n for o in OPTIMIZER_NAMES):
        return "optimizer"
    inductor = n.startswith(INDUCTOR_PREFIXES)
    if not inductor and any(a in n for a in ATTENTION_NAMES):
        return "attention"
    if any(m in n for m in MATMUL_NAMES):
        return "matmul"
    if any(t in n for t in POPE_TRANSFORM_NAMES) or (inductor and any(o in n for o in POPE_OP_NAMES)):
        if phase == "fwd":
            return "pope transform fwd"
        gradient = any(g in n.replace("attention_backward", "") for g in GRADIENT_NAMES)
        return "pope transform bwd" if gradient else "pope transform recompute"
    return "norms, pointwise"


def _top_level(event):
    """True for a CPU op whose parents are only the step's PHASES ranges (or none): not a range itself."""
    names = set(PHASES.values())
    p = event.cpu_parent
    while p is not None and p.name in names:
        p = p.cpu_parent
    return p is None and event.name not in names and event.name != "ProfilerStep*"


def _phase_of(start, ranges):
    """The phase ('fwd', 'bwd', 'optimizer') whose (start, end, phase) range holds time `start`, else None."""
    for a, b, phase in ranges:
        if a <= start < b:
            return phase
    return None


def profile_kernels(step, device, n_steps=2, top=8):
    """Per-kernel table of `n_steps` training steps (torch.profiler), per step: {'groups': {group: {'fwd': ms,
    'bwd': ms, 'rest': ms}} over KERNEL_GROUPS (the optimizer's in 'rest') plus 'host gaps, idle' (the wall time no
    kernel covers, in 'rest'; the groups add up to 'wall_ms' where no two kernels overlap), 'top': {'fwd' | 'bwd':
    [(name, calls per step, ms per step)]} the `top` kernels by time, 'launches': kernels per step, 'busy_ms' (the
    union of the kernels' intervals), 'wall_ms'}. step: bench_train_step's step, whose forward, backward and optimizer
    run in PHASES' ranges.

    CUDA: GPU kernels (memcpy / memset included), each in the phase whose range (its GPU-side annotation, else the
    CPU range) holds its start. CPU (the proxy): the outermost ops inside the phase ranges, their CPU time; under
    torch.compile an Inductor graph is one op (its C++ kernels are not recorded one by one)."""
    cuda = str(device).startswith("cuda")
    prof, wall = _profiled(step, device, n_steps)
    events = list(prof.events())
    names = {v: k for k, v in PHASES.items()}
    on_device = lambda e: e.device_type == torch.autograd.DeviceType.CUDA  # noqa: E731
    ranges = [(e.time_range.start, e.time_range.end, names[e.name]) for e in events if e.name in names]
    if cuda:
        gpu_ranges = [r for r, e in zip(ranges, [e for e in events if e.name in names]) if on_device(e)]
        ranges = gpu_ranges or [r for r, e in zip(ranges, [e for e in events if e.name in names]) if not on_device(e)]
        # kernels, not the GPU-side copies of record_function ranges (Optimizer.step#AdamW.step: counted twice before)
        annotation = lambda e: getattr(e, "is_user_annotation", False)  # noqa: E731
        kernels = [e for e in events if on_device(e) and e.name not in names and not annotation(e)]
    else:
        kernels = [e for e in events if not on_device(e) and _top_level(e)]
    groups = {g: {"fwd": 0.0, "bwd": 0.0, "rest": 0.0} for g in KERNEL_GROUPS}
    by_name = {}
    per = 1e3 * n_steps
    for e in kernels:
        phase = _phase_of(e.time_range.start, ranges) or "bwd"  # the autograd engine's own thread: the backward
        group = kernel_group(e.name, phase)
        ms = e.time_range.elapsed_us() / per
        groups[group]["rest" if group == "optimizer" else phase] += ms
        if phase in ("fwd", "bwd") and group != "optimizer":
            calls, total = by_name.get((phase, e.name), (0, 0.0))
            by_name[phase, e.name] = (calls + 1, total + ms)
    busy = _union_us([(e.time_range.start, e.time_range.end) for e in kernels])
    groups["host gaps, idle"] = {"fwd": 0.0, "bwd": 0.0, "rest": max(wall - busy, 0.0) / per}
    tops = {
        phase: sorted(((n, c / n_steps, ms) for (p, n), (c, ms) in by_name.items() if p == phase), key=lambda r: -r[2])[
            :top
        ]
        for phase in ("fwd", "bwd")
    }
    return {
        "groups": groups,
        "top": tops,
        "launches": len(kernels) / n_steps,
        "busy_ms": busy / per,
        "wall_ms": wall / per,
    }


def print_kernel_tables(rows, width=48):
    """bench_train_step's profile_kernels tables of rope and pope (rows with 'kernels', popped), side by side: ms per
    step by group and phase (rest: the optimizer and the time no kernel covers), the launches per step, then each
    phase's top kernels by rank."""
    tables = {r["pos_encoding"]: r.pop("kernels") for r in rows if "kernels" in r}
    if not tables:
        return
    cols = ("fwd", "bwd", "rest")
    group_rows = []
    for g in next(iter(tables.values()))["groups"]:
        row = {"group": g}
        for pe, t in tables.items():
            row.update({f"{pe} {c}": t["groups"][g][c] for c in cols})
        group_rows.append(row)
    total, launches = {"group": "total (wall)"}, {"group": "launches per step"}
    for pe, t in tables.items():
        total.update({f"{pe} {c}": sum(r[f"{pe} {c}"] for r in group_rows) for c in cols})
        launches.update({f"{pe} fwd": t["launches"], f"{pe} bwd": "", f"{pe} rest": ""})
    print_table(
        "where a step's time goes, ms per step (rest: optimizer, and host gaps / idle: the wall time no kernel covers)",
        group_rows + [total, launches],
    )
    for phase in ("fwd", "bwd"):
        top = []
        for i in range(max(len(t["top"][phase]) for t in tables.values())):
            row = {"rank": i + 1}
            for pe, t in tables.items():
                name, calls, ms = t["top"][phase][i] if i < len(t["top"][phase]) else ("", "", "")
                name = name.replace("autograd::engine::evaluate_function: ", "autograd: ")
                row[f"{pe} kernel"], row[f"{pe} calls"], row[f"{pe} ms"] = name[:width], calls, ms
            top.append(row)
        print_table(f"top kernels of the {phase} phase, per step", top)


def _union_us(intervals):
    """Total length of the union of (start, end) intervals (overlapping kernels on several streams count once)."""
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total, end = total + (b - a), b
        elif b > end:
            total, end = total + (b - end), b
    return total


def naive_pope(q, k, v, delta, rope_theta=10000.0):
    """PoPE the straightforward way: 2d-wide Cartesian q/k, d-wide v, straight into SDPA."""
    T, d = q.shape[-2], q.shape[-1]
    freqs, pos = pope_frequencies(d, rope_theta, q.device), torch.arange(T, device=q.device)
    qc = polar_to_cartesian(q, pos, freqs, None, "softplus", q.dtype)
    kc = polar_to_cartesian(k, pos, freqs, delta, "softplus", q.dtype)
    return F.scaled_dot_product_attention(qc, kc, v, is_causal=True, scale=1 / math.sqrt(d))


def bench_attention(device, T=4096, d=64, n_head=8, batch_size=1, rounds=6, dtype=torch.float32):
    """fwd and fwd+bwd ms of causal attention: RoPE via SDPA, PoPE via pope_attention, naive PoPE, in
    interleaved rounds; vs_rope: the median (min-max) of the per-round fwd+bwd ratios to RoPE."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(batch_size, n_head, T, d, device=device, dtype=dtype, generator=g, requires_grad=True)
        for _ in range(3)
    )
    delta = (-torch.rand(n_head, d, device=device, generator=g)).requires_grad_()
    pos = torch.arange(T, device=device)
    impls = {
        "rope_sdpa": lambda: F.scaled_dot_product_attention(apply_rope(q, pos), apply_rope(k, pos), v, is_causal=True),
        "pope": lambda: pope_attention(q, k, v, delta, causal=True),
        "pope_naive_sdpa": lambda: naive_pope(q, k, v, delta),
    }
    fns = {}
    for name, fn in impls.items():
        fns[name, "fwd"] = fn
        fns[name, "fwdbwd"] = lambda fn=fn: fn().sum().backward()
    times = interleaved(fns, device, rounds)
    rows = []
    for name in impls:
        rows.append(
            {
                "impl": name,
                "T": T,
                "d": d,
                "fwd_ms": 1000 * statistics.median(times[name, "fwd"]),
                "fwdbwd_ms": 1000 * statistics.median(times[name, "fwdbwd"]),
                "vs_rope": fmt_ratio(ratio_stats(times[name, "fwdbwd"], times["rope_sdpa", "fwdbwd"])),
            }
        )
    return rows


def bench_decode(
    device,
    contexts=(1024, 4096, 16384),
    n_layer=6,
    n_embd=384,
    n_head=6,
    n_new=24,
    vocab_size=50304,
    rounds=6,
    n_kv_heads=(None,),
    modes=("eager", "compiled"),
    dtype="auto",
):
    """ms per generated token, greedy, batch 1, with the KV cache: rope vs pope at each context length (tokens
    already in the cache), and the cache's bytes per token, for each n_kv_head in n_kv_heads (None = n_head).

    Each (model, context) runs a random prompt of min(contexts) tokens through a KVCache and fills the rest of
    the context by repeating its cache entries (a step's time does not depend on the cached values, and a
    16k-token prefill costs minutes on a CPU); then every round rewinds the cache to the context's end and decodes
    n_new tokens greedily, timing each step (logits of the last position, argmax, the forward of the new token):
    the same tokens and positions every round, prefill excluded. A round's figure is its median step time. The
    models take turns in `rounds` interleaved rounds; time_vs_rope is the median (min-max) of the per-round
    PoPE/RoPE ratios at the same context. cache_bytes_per_token: KVCache.cache_bytes() / max_len (keys and
    values, all layers, fp32); rotation_bytes_per_token: the model's rotation table (GPT.rotation, one for all
    layers: RoPE's cos/sin, PoPE's 2d-wide rows) per position. modes: 'eager' decodes through hidden_states (as
    generate(compile=False)), 'compiled' through GPT.compiled_decode_step (as generate(compile=True): a static
    cache, the position as a tensor, CUDA graphs on CUDA), one compile per model and context, outside the timing.
    dtype: the compute dtype, under autocast as sample.py runs ('auto': bf16 on a GPU from sm_80, so PoPE's Triton
    decode kernel runs; fp32 on a CPU); the cache holds it.
    """
    _, amp, _ = train_step_precision(device, dtype)
    prompt_len = min(contexts)
    prompt = torch.randint(0, vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0)).to(device)
    models, states = {}, {}
    for kv in n_kv_heads:
        for pe in ("rope", "pope"):
            torch.manual_seed(0)
            cfg = GPTConfig(
                block_size=max(contexts) + n_new,
                vocab_size=vocab_size,
                n_layer=n_layer,
                n_head=n_head,
                n_kv_head=kv,
                n_embd=n_embd,
                pos_encoding=pe,
            )
            models[pe, kv] = GPT(cfg).eval().to(device)
    with torch.no_grad(), amp:
        for (pe, kv), model in models.items():
            for ctx in contexts:
                cache = KVCache(n_layer, ctx + n_new)
                hidden = model.hidden_states(prompt, cache)
                for layer in range(n_layer):  # fill the rest of the context by repeating the prompt's entries
                    for buf in (cache.k[layer], cache.v[layer]):
                        for start in range(prompt_len, ctx, prompt_len):
                            n = min(prompt_len, ctx - start)
                            buf[:, :, start : start + n] = buf[:, :, :n]
                states[pe, kv, ctx] = (model, cache, hidden[:, -1:])

    @torch.no_grad()
    def decode_round(key, mode):
        with amp:
            return _decode_round(key, mode)

    def _decode_round(key, mode):
        model, cache, hidden = states[key]
        cache.q_offset = key[2]  # the context's end: the same positions and tokens every round
        logits, times = model.lm_head(hidden[:, -1]).float(), []
        if mode == "compiled":
            step, pos = model.compiled_decode_step(cache), torch.tensor(key[2], device=device)
        for _ in range(n_new):
            _sync(device)
            t = time.perf_counter()
            nxt = logits.argmax(-1, keepdim=True)
            if mode == "compiled":
                logits = step(nxt, cache, pos)
                pos += 1
                cache.q_offset += 1
            else:
                logits = model.lm_head(model.hidden_states(nxt, cache)[:, -1]).float()
            _sync(device)
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    arms = {(*key, mode): (lambda key=key, mode=mode: decode_round(key, mode)) for key in states for mode in modes}
    per_round = interleaved(arms, device, rounds, warmup=2 if "compiled" in modes else 1)
    rows = []
    for (pe, kv, ctx, mode), times in per_round.items():
        model, cache, _ = states[pe, kv, ctx]
        table = model.rotation[0].numel() * model.rotation.element_size()  # one row: the whole model's, per position
        ms = 1000 * statistics.median(times)
        rows.append(
            {
                "pos_encoding": pe,
                "mode": mode,
                "n_kv_head": kv or n_head,
                "context": ctx,
                "ms_per_token": ms,
                "tokens_per_s": 1000 / ms,
                "cache_bytes_per_token": cache.cache_bytes() // cache.max_len,
                "rotation_bytes_per_token": table,
            }
        )
        if pe == "pope":
            rows[-1]["time_vs_rope"] = fmt_ratio(ratio_stats(times, per_round["rope", kv, ctx, mode]))
    return sorted(
        rows, key=lambda r: (r["n_kv_head"], r["context"], modes.index(r["mode"]), r["pos_encoding"] != "rope")
    )


def bench_decode_attention(device, contexts=(1024, 4096, 16384), n_head=6, d=64, rounds=6, compiled=True):
    """One layer's attention for one new token over a cache of `context` keys (batch 1, fp32), ms: where a
    decoding step's attention time goes. rope: SDPA over rotated d-wide keys. pope_cartesian: the earlier cache,
    keys stored as their 2d-wide Cartesian form (two matmuls). pope: pope_attention_decode's torch path over
    d-wide magnitudes (rotated in chunks). pope_compiled: the same under torch.compile (Inductor fuses the
    rotation into the score loop). vs_rope: median (min-max) of per-round ratios."""
    from pope import pope_attention_decode, pope_key_magnitude, pope_rotation_table, sdpa_attention

    rows = []
    for ctx in contexts:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, n_head, t, d, generator=g).to(device) for t in (1, ctx, ctx))
        delta = (-2 * math.pi * torch.rand(n_head, d, generator=g)).to(device)
        mu, rot = pope_key_magnitude(k), pope_rotation_table(ctx, d, device=device)
        kc = polar_to_cartesian(k, torch.arange(ctx, device=device), pope_frequencies(d, device=device), delta)
        freqs = pope_frequencies(d, device=device)

        def cartesian():
            qc = polar_to_cartesian(q, torch.arange(ctx - 1, ctx, device=device), freqs)
            return torch.softmax((qc @ kc.transpose(-1, -2)) / math.sqrt(d), -1) @ v

        def pope(fn=pope_attention_decode):
            return fn(q, mu, v, delta, rotation=rot, q_offset=ctx - 1, backend="torch")

        fns = {"rope": lambda: sdpa_attention(q, k, v, q_offset=ctx - 1), "pope_cartesian": cartesian, "pope": pope}
        if compiled:
            step = torch.compile(pope_attention_decode, dynamic=False)
            fns["pope_compiled"] = lambda: pope(step)
        with torch.no_grad():
            times = interleaved({n: (lambda f=f: [f() for _ in range(5)]) for n, f in fns.items()}, device, rounds)
        for name in fns:
            rows.append(
                {
                    "context": ctx,
                    "impl": name,
                    "ms": 1000 * statistics.median(times[name]) / 5,
                    "vs_rope": fmt_ratio(ratio_stats(times[name], times["rope"])),
                }
            )
    return rows


def _status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _peak_forward_memory(T, d, n_head, device):
    """Child process: peak memory growth in MB during one PoPE forward, inputs excluded.

    CUDA: torch's peak allocated bytes. CPU (Linux): the resident-set high-water mark VmHWM, reset
    just before the call through /proc/self/clear_refs (ru_maxrss cannot be reset: the import of
    torch alone peaks higher than a small forward).
    """
    q, k, v = (torch.randn(1, n_head, T, d, device=device) for _ in range(3))
    delta = -torch.rand(n_head, d, device=device)
    if str(device).startswith("cuda"):
        return _cuda_peak_mb(torch.no_grad()(lambda: pope_attention(q, k, v, delta)), device)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kb("VmRSS")
    with torch.no_grad():
        pope_attention(q, k, v, delta)
    return (_status_kb("VmHWM") - base) / 1024


def bench_memory(device, seq_lens=(4096, 8192, 16384), d=64, n_head=8):
    """Peak memory of a PoPE forward per T, each in a fresh process (CPU RSS is a high-water mark).
    An O(T^2) kernel would need n_head * T^2 * 4 bytes for the scores: 8.6 GB at T=16384."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    rows = []
    with ctx.Pool(1, maxtasksperchild=1) as pool:
        for T in seq_lens:
            mb = pool.apply(_peak_forward_memory, (T, d, n_head, str(device)))
            rows.append(
                {
                    "T": T,
                    "peak_mb": mb,
                    "inputs_mb": 3 * n_head * T * d * 4 / 2**20,
                    "scores_if_materialised_mb": n_head * T * T * 4 / 2**20,
                }
            )
    return rows


SHARD_SHAPES = {  # GPT-2's sizes: the paper's 124M and 774M, and config/train_owt_1558m_*.py
    "124M": dict(n_layer=12, n_head=12, n_embd=768),
    "774M": dict(n_layer=36, n_head=20, n_embd=1280),
    "1.5B": dict(n_layer=48, n_head=25, n_embd=1600),
}


def bench_shard(vocab_size=50304, worlds=(1, 2, 8)):
    """Section 6 -> (rows: one per shape and set-up, GiB of params / grads / optimizer / total per rank at each
    world size; check: the 124M shape's FSDP bytes at world 2, estimated and measured by shard_worker in two gloo
    processes, and their difference)."""
    import json
    import subprocess

    import sharding

    rows = []
    for name, shape in SHARD_SHAPES.items():
        with torch.device("meta"):
            model = GPT(GPTConfig(**shape, vocab_size=vocab_size, block_size=1024, pos_encoding="pope"))
        per = {w: sharding.memory_per_rank(model, w) for w in worlds}
        for kind in ("ddp", "fsdp"):
            row = {"model": f"{name} pope", "set-up": kind.upper()}
            for w in worlds:
                parts = (per[w][kind][k] / 2**30 for k in ("params", "grads", "optimizer"))
                row[f"world {w}"] = " / ".join(f"{v:.2f}" for v in parts)
                row[f"total {w}"] = per[w][kind]["total"] / 2**30
            rows.append(row)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [*cmd, "--shard_worker", f"--vocab_size={vocab_size}"], env=env, capture_output=True, text=True, check=True
    )
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    with torch.device("meta"):
        model = GPT(GPTConfig(**SHARD_SHAPES["124M"], vocab_size=vocab_size, block_size=1024, pos_encoding="pope"))
    est = sharding.memory_per_rank(model, 2)["fsdp"]
    check = [{"": k, "estimate": est[k], "measured": measured[k], "difference": measured[k] - est[k]} for k in est]
    return rows, check


def bench_wrappers(
    device, n_layer, n_embd, n_head, T, batch_size, vocab_size=50304, rounds=6, dtype="auto", compile=None
):
    """Section 6's step: one PoPE AdamW training step (fwd + bwd + step) of the same GPT with no wrapper, under DDP
    and under FSDP (sharding.shard: bf16 compute with fp32 reduce where train.py autocasts in bf16), each at
    world 1 (a process group of one), in interleaved rounds -> one row per arm: ms per step and its time ratio to
    no wrapper (median and range of the per-round ratios). The issue's target on a GPU: all within 5 %."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sharding
    from train import compile_model

    name, amp, _ = train_step_precision(device, dtype)
    if name == "float16":
        raise UserError("the wrapper benchmark runs FSDP, which trains in bfloat16 or float32: give --dtype")
    compile = str(device).startswith("cuda") if compile is None else compile
    if not dist.is_initialized():
        sharding.init_single_process(str(device))
    steps = {}
    for arm in ("none", "DDP", "FSDP"):
        torch.manual_seed(0)
        cfg = GPTConfig(block_size=T, vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
        model = GPT(cfg).to(device)
        if arm == "FSDP":
            sharding.shard(model, str(device), name)
        opt = model.configure_optimizers(0.01, 1e-4, (0.9, 0.99), str(device).split(":")[0])
        fwd = compile_model(model, arm == "DDP") if compile else model  # train.py's DDP fallback included
        if arm == "DDP":
            fwd = DDP(fwd, broadcast_buffers=False)
        x = torch.randint(0, vocab_size, (batch_size, T), device=device)

        def step(model=fwd, opt=opt, x=x):
            with amp:
                _, loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        steps[arm] = step
    times = interleaved(steps, device, rounds, warmup=2 if compile else 1)
    rows = []
    for arm in steps:
        row = {"wrapper": arm, "dtype": name, "compiled": compile, "ms_per_step": 1000 * statistics.median(times[arm])}
        if arm != "none":
            row["time / none"] = fmt_ratio(ratio_stats(times[arm], times["none"]))
        rows.append(row)
    return rows


def shard_worker(vocab_size):
    """One rank of bench_shard's measurement: the 124M PoPE shape sharded over the torchrun processes, one AdamW
    step on 1 x 16 tokens, then this rank's bytes from its local shards (sharding.measured_bytes); rank 0 prints
    them as JSON."""
    import json

    import torch.distributed as dist

    import sharding

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHARD_SHAPES["124M"], vocab_size=vocab_size, block_size=16, pos_encoding="pope"))
    sharding.shard(model, "cpu", "float32")
    optimizer = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), "cpu")
    x = torch.randint(0, vocab_size, (1, 16))
    model(x, x)[1].backward()
    optimizer.step()
    b = sharding.measured_bytes(model, optimizer)
    if dist.get_rank() == 0:
        print(json.dumps(b))
    dist.destroy_process_group()


def print_table(title, rows):
    print(f"\n{title}")
    keys = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: f"{v:,.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    cells = [[fmt(r.get(k, "")) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print("  ".join(k.rjust(w) for k, w in zip(keys, widths)))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))


def main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["step", "attn", "memory", "decode", "kernel", "shard", "bytes"])
    p.add_argument("--device", default="auto", help="'auto' (cuda if available) | 'cpu' | 'cuda:1' ...")
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"interleaved rounds per table (at least {MIN_ROUNDS}; default {STEP_ROUNDS} for the step, 6 elsewhere)",
    )
    p.add_argument("--T", type=int, default=4096, help="attention micro-benchmark length")
    p.add_argument(
        "--tokens",
        type=int,
        nargs=2,
        default=list(BYTES_SHAPE["tokens"]),
        help="bytes: the two token counts whose byte counts give the bytes per token",
    )
    p.add_argument("--vocab_size", type=int, default=50304)
    p.add_argument("--shard_worker", action="store_true", help=argparse.SUPPRESS)  # one rank of section 6
    p.add_argument(
        "--contexts", type=int, nargs="+", default=[1024, 4096, 16384], help="decode: tokens already in the cache"
    )
    p.add_argument("--gqa", action="store_true", help="decode: also 8 heads sharing 2 key/value heads")
    p.add_argument(
        "--dtype",
        default="auto",
        help="training step's and decoding's compute dtype: 'auto' (bfloat16 on "
        "a GPU of compute capability >= 8.0, float16 below, float32 on a CPU) | float32 | bfloat16 | float16",
    )
    p.add_argument(
        "--compile",
        default="auto",
        choices=["auto", "on", "off"],
        help="step: torch.compile the model ('auto': on for CUDA, off on a CPU, as train.py)",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="step: add where the time goes (attention kernels, "
        "other kernels, GPU idle; on a CPU the ops' time and the rest)",
    )
    p.add_argument(
        "--eval-pass",
        action="store_true",
        help="step: time the steps again after one evaluation forward (eager, no_grad, as train.py evaluates)",
    )
    a = p.parse_args(argv)
    if a.shard_worker:
        return shard_worker(a.vocab_size)
    a.compile = {"auto": None, "on": True, "off": False}[a.compile]
    step_rounds, a.rounds = a.rounds or STEP_ROUNDS, a.rounds or 6
    if a.rounds < MIN_ROUNDS:
        p.error(f"--rounds must be at least {MIN_ROUNDS}: a ratio needs several interleaved rounds, got {a.rounds}")
    try:
        a.device = resolve_device(a.device)
        a.dtype = resolve_dtype(a.dtype, a.device)
    except UserError as e:
        p.error(str(e))  # one line and exit 2, as for the other bad arguments
    if a.only == "bytes" and not a.device.startswith("cuda"):
        import pope_kernel

        if not pope_kernel.INTERPRETING:
            p.error(
                "--only=bytes on a CPU runs the Triton kernels in the interpreter: TRITON_INTERPRET=1 python bench.py"
            )
    if a.device.startswith("cuda:"):
        torch.cuda.set_device(a.device)  # kernels and libraries that default to the current device use it too
    print(
        f"device {a.device}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads, {a.rounds} rounds"
        + (f" ({step_rounds} for the training step)" if step_rounds != a.rounds else "")
        + (f", load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}" if hasattr(os, "getloadavg") else "")
    )
    if a.only in (None, "step"):
        shape = STEP_SHAPES["cuda" if a.device.startswith("cuda") else "cpu"]
        kw = dict(
            vocab_size=a.vocab_size,
            rounds=step_rounds,
            dtype=a.dtype,
            compile=a.compile,
            profile=a.profile,
            eval_pass=a.eval_pass,
        )
        what = f"{shape['n_layer']} layers x {shape['n_embd']} wide, T={shape['T']}, batch {shape['batch_size']}"
        what += f", {a.dtype}"
        rows = bench_train_step(a.device, **shape, **kw)
        kernel_rows = [{"pos_encoding": r["pos_encoding"], "kernels": r.pop("kernels")} for r in rows if "kernels" in r]
        print_table(f"training step, {what}", rows)
        print_kernel_tables(kernel_rows)
        if not a.profile:
            print_table(
                f"training step, grouped-query attention: {what}, {shape['n_head']} heads sharing "
                f"{shape['n_head'] // 4} key/value heads",
                bench_train_step(a.device, **{**shape, "n_kv_head": shape["n_head"] // 4}, **kw),
            )
    if a.only in (None, "attn"):
        print_table(
            f"attention fwd+bwd, T={a.T}, d=64, 8 heads, fp32", bench_attention(a.device, T=a.T, rounds=a.rounds)
        )
    if a.only in (None, "memory"):
        print_table("PoPE forward peak memory, d=64, 8 heads, fp32", bench_memory(a.device))
    if a.only in (None, "shard"):
        table, check = bench_shard(a.vocab_size)
        print_table("bytes per rank, fp32 weights + AdamW, GiB (sharding.memory_per_rank)", table)
        print_table("FSDP at world 2, 124M shape: estimate vs measured from the local shards (bytes, rank 0)", check)
        shape = STEP_SHAPES["cuda" if a.device.startswith("cuda") else "cpu"]
        what = f"{shape['n_layer']} layers x {shape['n_embd']} wide, T={shape['T']}, batch {shape['batch_size']}"
        print_table(
            f"PoPE training step at world 1, {what}: no wrapper, DDP, FSDP",
            bench_wrappers(
                a.device, **shape, vocab_size=a.vocab_size, rounds=a.rounds, dtype=a.dtype, compile=a.compile
            ),
        )
    if a.only in (None, "decode"):
        contexts = tuple(a.contexts)
        print_table(
            f"greedy decoding with the KV cache, 6 layers x 384, batch 1, {a.dtype}, ms per new token at each context",
            bench_decode(a.device, contexts, vocab_size=a.vocab_size, rounds=a.rounds, dtype=a.dtype),
        )
        if a.gqa:
            print_table(
                "the same, grouped-query attention: 8 heads sharing 2 key/value heads",
                bench_decode(
                    a.device,
                    contexts,
                    vocab_size=a.vocab_size,
                    n_head=8,
                    n_kv_heads=(2,),
                    rounds=a.rounds,
                    dtype=a.dtype,
                ),
            )
        if hasattr(__import__("pope"), "pope_attention_decode"):
            print_table(
                "one layer's attention for one new token, 6 heads, d=64, fp32, ms",
                bench_decode_attention(a.device, contexts, rounds=a.rounds),
            )
    if a.only in (None, "kernel"):
        if not str(a.device).startswith("cuda"):
            print("\nTriton kernel benchmark: needs CUDA (python bench_kernel.py runs an interpreter smoke test)")
        else:
            import bench_kernel

            print("\nattention kernels, bf16, causal, fwd / bwd / fwd+bwd")
            bench_kernel.print_table(bench_kernel.bench_attention_kernels(a.device))
    if a.only == "bytes":  # not in the default run: four Inductor compiles on the CPU, minutes with the interpreter
        print_bytes(tuple(a.tokens), device=a.device)
    if hasattr(os, "getloadavg"):
        print(f"\nload average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main(sys.argv[1:])
