"""Benchmarks on the current device: RoPE vs PoPE, as tables.

    python bench.py                 # train step + attention micro-benchmark + O(T) memory check
    python bench.py --only=attn     # one section: step | attn | memory | decode | kernel

1. Training step of the same GPT with rope vs pope (default: 6 layers, 384 wide, T=1024, GPT-2 vocab):
   ms/iter, tokens/s, and the PoPE/RoPE time ratio next to the FLOP ratio of model.flops_per_token.
2. Attention forward+backward at T=4096, d=64, 8 heads: RoPE through SDPA, PoPE through pope_attention,
   and the naive PoPE that hands SDPA 2d-wide q/k with d-wide v (SDPA then falls back to its O(T^2)
   math kernel, as PoPE-pytorch 0.2.1 does).
3. Peak memory of a PoPE forward at growing T (child processes): O(T) means doubling T doubles it.
4. Greedy decoding (6 layers x 384, a 960-token prompt): ms per new token for rope and pope, with the KV
   cache and re-running the whole sequence every step: the median time of the steps that make
   new tokens 17..48 (what (time for 48 tokens - time for 16) / 32 measures, minus the load spikes),
   and the cache's size; then with 8 query heads sharing 8 or 2 key/value heads (grouped-query attention).
   Sections 1 and 4 also run grouped-query attention (n_head 8, n_kv_head 2).
5. On CUDA: PoPE through pope_kernel.py's FlashAttention-2 vs PoPE through flex_attention vs RoPE through
   FlashAttention, bf16, T in {1k, 4k, 16k}, d in {64, 128} (bench_kernel.py, which also runs on its own).
Timings are the median of --repeats runs after a warm-up.
"""

import argparse
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from cli import resolve_device
from model import GPT, GPTConfig, KVCache, apply_rope
from pope import polar_to_cartesian, pope_attention, pope_frequencies


def _sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device, repeats, warmup=1):
    """Median seconds of fn() over `repeats` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_train_step(device, n_layer=6, n_embd=384, n_head=6, T=1024, batch_size=2, vocab_size=50304, repeats=3,
                     n_kv_head=None):
    """ms per AdamW training step (fwd + bwd + step) for rope and pope; returns rows of dicts.
    n_kv_head: key/value heads (grouped-query attention), None = n_head."""
    rows = []
    for pe in ("rope", "pope"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=T, vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                              n_kv_head=n_kv_head, pos_encoding=pe)).to(device)
        opt = model.configure_optimizers(0.01, 1e-4, (0.9, 0.99), str(device).split(":")[0])
        x = torch.randint(0, vocab_size, (batch_size, T), device=device)
        amp = torch.autocast("cuda", dtype=torch.bfloat16) if str(device).startswith("cuda") else torch.autocast("cpu", enabled=False)

        def step():
            with amp:
                _, loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        dt = timed(step, device, repeats)
        rows.append({"pos_encoding": pe, "ms_per_iter": 1000 * dt, "tokens_per_s": batch_size * T / dt,
                     "flops_per_token": model.flops_per_token(T)})
    rows[1]["time_ratio"] = rows[1]["ms_per_iter"] / rows[0]["ms_per_iter"]
    rows[1]["flop_ratio"] = rows[1]["flops_per_token"] / rows[0]["flops_per_token"]
    return rows


def naive_pope(q, k, v, delta, rope_theta=10000.0):
    """PoPE the straightforward way: 2d-wide Cartesian q/k, d-wide v, straight into SDPA."""
    T, d = q.shape[-2], q.shape[-1]
    freqs, pos = pope_frequencies(d, rope_theta, q.device), torch.arange(T, device=q.device)
    qc = polar_to_cartesian(q, pos, freqs, None, "softplus", q.dtype)
    kc = polar_to_cartesian(k, pos, freqs, delta, "softplus", q.dtype)
    return F.scaled_dot_product_attention(qc, kc, v, is_causal=True, scale=1 / math.sqrt(d))


def bench_attention(device, T=4096, d=64, n_head=8, batch_size=1, repeats=3, dtype=torch.float32):
    """fwd+bwd ms of causal attention: RoPE via SDPA, PoPE via pope_attention, naive PoPE."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch_size, n_head, T, d, device=device, dtype=dtype, generator=g, requires_grad=True)
               for _ in range(3))
    delta = (-torch.rand(n_head, d, device=device, generator=g)).requires_grad_()
    pos = torch.arange(T, device=device)
    impls = {
        "rope_sdpa": lambda: F.scaled_dot_product_attention(apply_rope(q, pos), apply_rope(k, pos), v, is_causal=True),
        "pope": lambda: pope_attention(q, k, v, delta, causal=True),
        "pope_naive_sdpa": lambda: naive_pope(q, k, v, delta),
    }
    rows = []
    for name, fn in impls.items():
        def fwd_bwd():
            fn().sum().backward()
        rows.append({"impl": name, "T": T, "d": d, "fwd_ms": 1000 * timed(fn, device, repeats),
                     "fwdbwd_ms": 1000 * timed(fwd_bwd, device, repeats)})
    base = rows[0]["fwdbwd_ms"]
    for r in rows:
        r["vs_rope"] = r["fwdbwd_ms"] / base
    return rows


def bench_decode(device, n_layer=6, n_embd=384, n_head=6, prompt_len=960, n_short=16, n_long=48,
                 vocab_size=50304, repeats=3, reforward_repeats=1, n_kv_heads=(None,)):
    """ms per generated token, greedy, batch 1: rope vs pope, KV cache vs a full forward every step,
    and the KV cache's size (MB, fp32, prompt + n_long tokens) for each n_kv_head in n_kv_heads
    (None = n_head; fewer heads: grouped-query attention).

    The prompt is run, then n_long tokens are generated one step at a time, and each step (logits of
    the last position, argmax, then the forward of the new token) is timed. The figure is the median
    step time of tokens n_short+1..n_long: the tokens that (time for n_long - time for n_short) /
    (n_long - n_short) covers, with the prefill excluded by construction, and robust to load spikes
    on a shared machine. `repeats` runs per encoding (`reforward_repeats` for the slow baseline that
    runs the whole sequence again at every step); RoPE and PoPE runs alternate.
    """
    models, prompt = {}, torch.randint(0, vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    for kv in n_kv_heads:
        for pe in ("rope", "pope"):
            torch.manual_seed(0)
            cfg = GPTConfig(block_size=prompt_len + n_long, vocab_size=vocab_size, n_layer=n_layer, n_head=n_head,
                            n_kv_head=kv, n_embd=n_embd, pos_encoding=pe)
            models[pe, kv] = GPT(cfg).eval().to(device)
    prompt = prompt.to(device)
    cache_mb = {}

    @torch.no_grad()
    def step_times(model, use_cache):
        cache = KVCache(model.config.n_layer, prompt_len + n_long) if use_cache else None
        idx, hidden, times = prompt, model.hidden_states(prompt, cache), []
        for _ in range(n_long):
            _sync(device)
            t = time.perf_counter()
            nxt = model.lm_head(hidden[:, -1]).argmax(-1, keepdim=True)
            idx = torch.cat((idx, nxt), 1)
            hidden = model.hidden_states(nxt, cache) if use_cache else model.hidden_states(idx)
            _sync(device)
            times.append(time.perf_counter() - t)
        if use_cache:
            cache_mb[model] = cache.cache_bytes() / 2**20
        return times[n_short:]

    for pe in models:  # warm-up
        models[pe].generate(prompt, 2, temperature=0)
    times = {(pe, c): [] for pe in models for c in (True, False)}
    for r in range(max(repeats, reforward_repeats)):
        for pe in models:
            for use_cache, reps in ((True, repeats), (False, reforward_repeats)):
                if r < reps:
                    times[pe, use_cache] += step_times(models[pe], use_cache)
    ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
    rows = [{"pos_encoding": pe, "n_kv_head": kv or n_head, "kv_cache_ms_per_token": ms[(pe, kv), True],
             "reforward_ms_per_token": ms[(pe, kv), False], "speedup": ms[(pe, kv), False] / ms[(pe, kv), True],
             "cache_mb": cache_mb[models[pe, kv]]} for pe, kv in models]
    for rope, pope in zip(rows[::2], rows[1::2]):
        pope["cache_vs_rope"] = pope["kv_cache_ms_per_token"] / rope["kv_cache_ms_per_token"]
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
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.no_grad():
            pope_attention(q, k, v, delta)
        return (torch.cuda.max_memory_allocated() - base) / 2**20
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
            rows.append({"T": T, "peak_mb": mb, "inputs_mb": 3 * n_head * T * d * 4 / 2**20,
                         "scores_if_materialised_mb": n_head * T * T * 4 / 2**20})
    return rows


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
    p.add_argument("--only", choices=["step", "attn", "memory", "decode", "kernel"])
    p.add_argument("--device", default="auto", help="'auto' (cuda if available) | 'cpu' | 'cuda:1' ...")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--T", type=int, default=4096, help="attention micro-benchmark length")
    p.add_argument("--vocab_size", type=int, default=50304)
    a = p.parse_args(argv)
    a.device = resolve_device(a.device)
    print(f"device {a.device}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    if a.only in (None, "step"):
        print_table("training step, 6 layers x 384 wide, T=1024, batch 2",
                    bench_train_step(a.device, vocab_size=a.vocab_size, repeats=a.repeats))
        print_table("training step, grouped-query attention: 6 layers x 384 wide, 8 heads, 2 key/value heads",
                    bench_train_step(a.device, vocab_size=a.vocab_size, repeats=a.repeats, n_head=8, n_kv_head=2))
    if a.only in (None, "attn"):
        print_table(f"attention fwd+bwd, T={a.T}, d=64, 8 heads, fp32",
                    bench_attention(a.device, T=a.T, repeats=a.repeats))
    if a.only in (None, "memory"):
        print_table("PoPE forward peak memory, d=64, 8 heads, fp32", bench_memory(a.device))
    if a.only in (None, "decode"):
        print_table("greedy decoding, 6 layers x 384, 960-token prompt, batch 1, ms per new token",
                    bench_decode(a.device, vocab_size=a.vocab_size))
        print_table("greedy decoding, grouped-query attention: 6 layers x 384, 8 heads, 8 or 2 key/value heads",
                    bench_decode(a.device, vocab_size=a.vocab_size, n_head=8, n_kv_heads=(None, 2)))
    if a.only in (None, "kernel"):
        if not str(a.device).startswith("cuda"):
            print("\nTriton kernel benchmark: needs CUDA (python bench_kernel.py runs an interpreter smoke test)")
        else:
            import bench_kernel
            print("\nattention kernels, bf16, causal, fwd / bwd / fwd+bwd")
            bench_kernel.print_table(bench_kernel.bench_attention_kernels(a.device))


if __name__ == "__main__":
    main(sys.argv[1:])
