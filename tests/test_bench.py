"""bench.py: ratios from interleaved rounds, and each section runs (tiny sizes)."""

import time
from unittest import mock

import pytest
import torch

import bench


def test_rounds_alternate_their_order_and_ratios_are_per_round():
    """Each round calls every arm once, the order reversed on odd rounds; an arm may report its own seconds.
    A ratio is the median (min, max) of the per-round ratios."""
    calls, own = [], iter([3.0, 1.0, 5.0, 2.0, 4.0, 6.0])
    fns = {"rope": lambda: calls.append("rope"), "pope": lambda: (calls.append("pope"), next(own))[1]}
    times = bench.interleaved(fns, "cpu", rounds=5, warmup=1)
    assert calls == ["rope", "pope"] + ["rope", "pope", "pope", "rope"] * 2 + ["rope", "pope"]
    assert times["pope"] == [1.0, 5.0, 2.0, 4.0, 6.0] and len(times["rope"]) == 5  # the first value warmed up
    assert bench.ratio_stats([2.0, 3.0, 9.0], [1.0, 1.0, 3.0]) == (3.0, 2.0, 3.0)
    assert bench.fmt_ratio((1.153, 1.071, 1.236)) == "1.15 (1.07-1.24)"


def test_torch_path_flops_count_v_padded_to_2d():
    """At 6 x 384, T=1024: PoPE/RoPE is 1.068 in model FLOPs (q/k at 2d, v at d) and 1.136 on the torch
    path (v padded to 2d too), the bound a CPU step can reach."""
    from model import GPT, GPTConfig

    kw = dict(block_size=1024, vocab_size=50304, n_layer=6, n_head=6, n_embd=384)
    with (
        mock.patch.object(torch.nn.init, "normal_", lambda t, *a, **k: t),
        mock.patch.object(torch.nn.Linear, "reset_parameters", lambda self: None),
        mock.patch.object(torch.nn.Embedding, "reset_parameters", lambda self: None),
    ):  # shapes only: no init
        rope, pope = GPT(GPTConfig(pos_encoding="rope", **kw)), GPT(GPTConfig(pos_encoding="pope", **kw))
    assert pope.flops_per_token(1024) / rope.flops_per_token(1024) == pytest.approx(1.068, abs=5e-4)
    assert "PoPE/RoPE = 1.068" in pope.flops_per_token.__doc__  # the docstring's worked example is this number
    attn = 6 * 6 * 6 * 1024 * 4 * 64  # 6 n_layer n_head T (2d + 2d)
    assert bench.torch_path_flops_per_token(pope, 1024) == 6 * pope.get_num_params() + attn
    assert bench.torch_path_flops_per_token(rope, 1024) == rope.flops_per_token(1024)
    ratio = bench.torch_path_flops_per_token(pope, 1024) / bench.torch_path_flops_per_token(rope, 1024)
    assert ratio == pytest.approx(1.136, abs=5e-4)


def test_every_section_runs_at_a_tiny_size():
    small = dict(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    rows = bench.bench_train_step("cpu", T=16, batch_size=2, rounds=5, eval_pass=True, **small)
    assert [r["pos_encoding"] for r in rows] == ["rope", "pope"] and rows[1]["flop_ratio"] > 1
    assert all(r["ms_after_eval"] > 0 for r in rows)
    assert "(" in rows[1]["time_ratio"] and rows[1]["cpu_flop_ratio"] > rows[1]["flop_ratio"]
    rows = bench.bench_attention("cpu", T=32, d=16, n_head=2, rounds=5)
    assert [r["impl"] for r in rows] == ["rope_sdpa", "pope", "pope_naive_sdpa"]
    rows = bench.bench_decode(
        "cpu", contexts=(8, 12), n_new=3, rounds=5, n_kv_heads=(None, 1), modes=("eager",), **small
    )
    assert [(r["pos_encoding"], r["mode"], r["n_kv_head"], r["context"]) for r in rows] == [
        (pe, "eager", kv, ctx) for kv in (1, 2) for ctx in (8, 12) for pe in ("rope", "pope")
    ]
    assert all("time_vs_rope" in r for r in rows[1::2])
    for rope, pope in zip(rows[0::2], rows[1::2]):  # PoPE's cache: RoPE's bytes per token, exactly
        assert pope["cache_bytes_per_token"] == rope["cache_bytes_per_token"] == 1 * pope["n_kv_head"] * 2 * 16 * 4
        assert rope["rotation_bytes_per_token"] == 16 * 4 and pope["rotation_bytes_per_token"] == 2 * 16 * 4
    rows = bench.bench_decode_attention("cpu", contexts=(16,), n_head=2, d=16, rounds=5, compiled=False)
    assert [r["impl"] for r in rows] == ["rope", "pope_cartesian", "pope"]


def test_train_step_table_reports_pope_over_rope_and_the_whole_batchs_tokens(monkeypatch):
    """With PoPE's steps timed at 3, 4, 6, 6, 8 s against RoPE's 2, 2, 3, 3, 4 s: the ratio is the median of
    the per-round PoPE/RoPE ratios, 2.00 (1.50-2.00); tokens/s counts batch_size x T tokens per step."""
    monkeypatch.setattr(
        bench,
        "interleaved",
        lambda fns, device, rounds, warmup=1: {"rope": [2.0, 2.0, 3.0, 3.0, 4.0], "pope": [3.0, 4.0, 6.0, 6.0, 8.0]},
    )
    monkeypatch.setattr(bench, "device_peak_flops", lambda device, dtype: 1e6)  # MFU against a 1 MFLOP/s part
    rows = bench.bench_train_step("cpu", n_layer=1, n_embd=32, n_head=2, T=16, batch_size=2, vocab_size=64, rounds=5)
    assert rows[1]["time_ratio"] == "2.00 (1.50-2.00)"
    assert rows[0]["ms_per_step"] == 3000.0 and rows[0]["tokens_per_s"] == 2 * 16 / 3.0
    assert rows[1]["ms_per_step"] == 6000.0 and rows[1]["tokens_per_s"] == 2 * 16 / 6.0
    for r in rows:  # MFU = FLOPs per token x tokens per step / seconds per step / peak
        assert r["mfu"] == f"{100 * r['flops_per_token'] * 32 / (r['ms_per_step'] / 1e3) / 1e6:.1f} %"
    assert not rows[0]["compiled"]  # a CPU step runs eagerly by default, as train.py's


def _spy_profile(monkeypatch):
    """bench._profiled, recorded: after the call, {'prof': the torch.profiler profile, 'wall': the wall time in us
    that bench measured, 'n': steps} — the very numbers the figures are made from, so a test compares them exactly
    and no machine's load can move the reference away from the figure."""
    seen, real = {}, bench._profiled

    def spy(step, device, n_steps):
        prof, wall = real(step, device, n_steps)
        seen.update(prof=prof, wall=wall, n=n_steps)
        return prof, wall

    monkeypatch.setattr(bench, "_profiled", spy)
    return seen


def _outermost(seen):
    """{name: [us of each outermost CPU event of that name]} in the recorded profile (events inside no other)."""
    out = {}
    for e in seen["prof"].events():
        if e.device_type == torch.autograd.DeviceType.CPU and e.cpu_parent is None:
            out.setdefault(e.name, []).append(e.time_range.elapsed_us())
    return out


def test_profile_splits_a_cpu_step_into_attention_other_ops_and_the_rest(monkeypatch):
    """--profile on a CPU: a step that sleeps 50 ms and calls SDPA and a matmul. Each step's outermost ops are
    exactly those two; attention is SDPA's own recorded time, other the matmul's, idle the wall time outside both,
    each per step and exactly (issue 75: a sleep-timed bound failed under load); the sleep is idle, at least 50 ms
    a step however long it overslept."""
    q = torch.randn(1, 2, 256, 64)
    w = torch.randn(512, 512)

    def step():
        time.sleep(0.05)
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        w @ w

    seen = _spy_profile(monkeypatch)
    got = bench.profile_step(step, "cpu", n_steps=2)
    ops = _outermost(seen)
    assert {k: len(v) for k, v in ops.items()} == {"aten::scaled_dot_product_attention": 2, "aten::matmul": 2}, ops
    attention, other = sum(ops["aten::scaled_dot_product_attention"]), sum(ops["aten::matmul"])
    assert got["attention_ms"] == pytest.approx(attention / 2e3, rel=1e-12), got
    assert got["other_ms"] == pytest.approx(other / 2e3, rel=1e-12), got
    assert got["idle_ms"] == pytest.approx((seen["wall"] - attention - other) / 2e3, rel=1e-12), got
    assert got["idle_ms"] >= 50 and got["attention_ms"] > 0 and got["other_ms"] > 0, got


def test_union_of_kernel_intervals_counts_overlap_once():
    assert bench._union_us([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25


def test_five_rounds_are_enough_and_four_are_refused(monkeypatch, capsys):
    """The docstring says "at least 5": --rounds=5 runs, --rounds=4 exits 2 naming the minimum."""
    monkeypatch.setattr(bench, "bench_memory", lambda device: [{"T": 1}])
    bench.main(["--only=memory", "--device=cpu", "--rounds=5"])
    assert "5 rounds" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        bench.main(["--only=memory", "--device=cpu", "--rounds=4"])
    assert e.value.code == 2 and "--rounds must be at least 5" in capsys.readouterr().err


def test_cuda_device_n_is_synchronized_and_measured(monkeypatch):
    """--device=cuda:1 times and measures GPU 1: synchronize and the memory statistics name the device
    (without it they act on the current device, GPU 0). Mocked CUDA calls record the device they are given."""
    calls = []
    for name, result in (
        ("synchronize", None),
        ("reset_peak_memory_stats", None),
        ("memory_allocated", 100),
        ("max_memory_allocated", 100 + 3 * 2**20),
    ):
        monkeypatch.setattr(
            torch.cuda, name, lambda device=None, _n=name, _r=result: (calls.append((_n, device)), _r)[1]
        )
    bench._sync("cuda:1")
    assert bench._cuda_peak_mb(lambda: calls.append(("fn", None)), "cuda:1") == 3.0
    one = torch.device("cuda:1")
    assert calls == [
        ("synchronize", one),
        ("reset_peak_memory_stats", one),
        ("memory_allocated", one),
        ("fn", None),
        ("max_memory_allocated", one),
    ]
    calls.clear()
    bench._sync("cpu")
    assert calls == []


def test_train_step_precision_is_train_pys(monkeypatch):
    """dtype 'auto' resolves as train.py does, asked of the device named (cuda:1): bf16 autocast on a GPU of compute
    capability >= 8.0, fp16 autocast with an enabled GradScaler below (V100 sm_70, T4 sm_75: no native bf16), no
    autocast on a CPU. CUDA is mocked: the capability, and is_available (and autocast's bf16 check) so autocast and
    the scaler stay enabled."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    for capability, want in (((7, 0), "float16"), ((7, 5), "float16"), ((8, 0), "bfloat16"), ((9, 0), "bfloat16")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=capability: (asked.append(d), c)[1])
        name, amp, scaler = bench.train_step_precision("cuda:1", "auto")
        assert name == want and amp.device == "cuda" and amp.fast_dtype == getattr(torch, want), capability
        assert scaler.is_enabled() == (want == "float16"), capability
    assert asked and all(torch.device(d) == torch.device("cuda:1") for d in asked), asked
    name, amp, scaler = bench.train_step_precision("cpu", "auto")
    assert name == "float32" and not isinstance(amp, torch.autocast) and not scaler.is_enabled()


@pytest.mark.parametrize("dtype, want", [("auto", None), ("bfloat16", torch.bfloat16)])
def test_train_step_runs_in_the_resolved_dtype(monkeypatch, capsys, dtype, want):
    """Every forward of the timed CPU step runs under the autocast of its dtype ('auto' on a CPU: float32, none);
    the rows say which; an unknown dtype exits 2 with one line."""
    from model import GPT

    seen, forward = [], GPT.forward

    def spy(self, *a, **k):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return forward(self, *a, **k)

    monkeypatch.setattr(GPT, "forward", spy)
    rows = bench.bench_train_step(
        "cpu", n_layer=1, n_embd=32, n_head=2, T=16, batch_size=2, vocab_size=64, rounds=5, dtype=dtype
    )
    assert len(seen) >= 10 and set(seen) == {want}, seen
    assert [r["dtype"] for r in rows] == [str(want or torch.float32).replace("torch.", "")] * 2
    with pytest.raises(SystemExit) as e:
        bench.main(["--only=step", "--device=cpu", "--dtype=float64"])
    assert e.value.code == 2 and "dtype must be 'auto' or one of" in capsys.readouterr().err


# ---- issue 61: --profile's figures against known times -------------------------------------------------------------
# Ops of known duration: each sleeps inside a dispatcher op, so the profiler sees it as that op's time. The attention
# op's work is a nested op that is attention too (as SDPA's CPU kernel sits inside aten::scaled_dot_product_attention);
# the other op's work is a real matmul nested in it.


# Each op's body is also a named profiler range: torch 2.15 records no event of its own for a custom op called from
# Python (2.13 does), so without the range its time would fall into no op on one torch and into the op on the other.
@torch.library.custom_op("benchtestpope::attention", mutates_args=())
def _slow_attention(x: torch.Tensor) -> torch.Tensor:
    with torch.profiler.record_function("benchtestpope::attention"):
        return _slow_attention_kernel(x)


@torch.library.custom_op("benchtestpope::attention_kernel", mutates_args=())
def _slow_attention_kernel(x: torch.Tensor) -> torch.Tensor:
    with torch.profiler.record_function("benchtestpope::attention_kernel"):
        time.sleep(0.020)
        return x.clone()


@torch.library.custom_op("benchtest::matmul", mutates_args=())
def _slow_matmul(w: torch.Tensor) -> torch.Tensor:
    with torch.profiler.record_function("benchtest::matmul"):
        time.sleep(0.010)
        return w @ w


def test_profile_figures_are_per_step_and_count_nested_attention_once(monkeypatch):
    """A step of known parts: 30 ms of Python sleep (in no op: idle), an attention op of 20 ms whose time is all in a
    nested attention op, and a 10 ms op around a real matmul (other). profile_step over 3 steps gives each per step,
    each counted once: attention is the outer attention ops' recorded time (not that plus the nested op's), other
    the matmul ops', idle the rest of the step's wall time, and the three add up to it. Compared exactly with the
    durations the profiler recorded inside the step (issue 75: against the step's own perf_counter a busy machine
    moved idle 3 ms past its allowance); the sleeps only bound each part from below, which load cannot break."""
    x, w = torch.randn(8, 8), torch.randn(64, 64)

    def step():
        time.sleep(0.030)
        _slow_attention(x)
        _slow_matmul(w)

    seen = _spy_profile(monkeypatch)
    got = bench.profile_step(step, "cpu", n_steps=3)
    ops = _outermost(seen)
    assert {k: len(v) for k, v in ops.items()} == {"benchtestpope::attention": 3, "benchtest::matmul": 3}, ops
    attention, other, wall = sum(ops["benchtestpope::attention"]), sum(ops["benchtest::matmul"]), seen["wall"]
    assert got["attention_ms"] == pytest.approx(attention / 3e3, rel=1e-12), got
    assert got["other_ms"] == pytest.approx(other / 3e3, rel=1e-12), got
    assert got["idle_ms"] == pytest.approx((wall - attention - other) / 3e3, rel=1e-12), got
    assert sum(got.values()) == pytest.approx(wall / 3e3, rel=1e-12), got
    assert got["attention_ms"] >= 20 and got["other_ms"] >= 10 and got["idle_ms"] >= 30, got


@torch.library.custom_op("benchtest::pointwise", mutates_args=())
def _quick_pointwise(x: torch.Tensor) -> torch.Tensor:
    with torch.profiler.record_function("benchtest::pointwise"):
        return x * 2


@torch.library.custom_op("benchtestpope::quick_attention", mutates_args=())
def _quick_attention(x: torch.Tensor) -> torch.Tensor:
    with torch.profiler.record_function("benchtestpope::quick_attention"):
        return x + 1


def test_the_kernel_table_counts_launches_and_calls_per_step(monkeypatch):
    """Issue 76, bn-launches-not-per-step: --profile's per-kernel table of a step of known ops, in the step's phase
    ranges (bench.PHASES): forward 2 attention ops and 1 matmul, backward 1 attention op and 2 pointwise ops,
    optimizer 1 pointwise op: 7 launches per step, whatever the number of steps profiled (2 and 3); each top
    kernel's calls per step are its count in one step, its ms per step its recorded time over the steps; each group's
    time is its ops' recorded time per step, and the groups with the host gaps add up to the step's wall time."""
    x, w = torch.randn(8, 8), torch.randn(16, 16)

    def step():
        with torch.profiler.record_function(bench.PHASES["fwd"]):
            _quick_attention(x)
            torch.mm(w, w)
            _quick_attention(x)
        with torch.profiler.record_function(bench.PHASES["bwd"]):
            _quick_pointwise(x)
            _quick_attention(x)
            _quick_pointwise(x)
        with torch.profiler.record_function(bench.PHASES["optimizer"]):
            _quick_pointwise(x)

    for n in (2, 3):
        seen = _spy_profile(monkeypatch)
        got = bench.profile_kernels(step, "cpu", n_steps=n)
        by = {}  # (phase, name) -> recorded us: the ops directly inside a phase range
        for e in seen["prof"].events():
            p = e.cpu_parent
            if p is not None and p.name in bench.PHASES.values() and p.cpu_parent is None:
                phase = next(k for k, v in bench.PHASES.items() if v == p.name)
                by.setdefault((phase, e.name), []).append(e.time_range.elapsed_us())
        counts = {k: len(v) for k, v in by.items()}
        assert counts == {
            ("fwd", "benchtestpope::quick_attention"): 2 * n,
            ("fwd", "aten::mm"): n,
            ("bwd", "benchtest::pointwise"): 2 * n,
            ("bwd", "benchtestpope::quick_attention"): n,
            ("optimizer", "benchtest::pointwise"): n,
        }, counts
        assert got["launches"] == 7, got["launches"]
        ms = {k: sum(v) / (1e3 * n) for k, v in by.items()}
        tops = {(phase, name): (calls, t) for phase in ("fwd", "bwd") for name, calls, t in got["top"][phase]}
        assert tops.keys() == {k for k in by if k[0] != "optimizer"}, tops
        for key, (calls, t) in tops.items():
            assert calls == counts[key] / n and t == pytest.approx(ms[key], rel=1e-12), (key, calls, t)
        g = got["groups"]
        assert g["attention"]["fwd"] == pytest.approx(ms["fwd", "benchtestpope::quick_attention"], rel=1e-12), g
        assert g["matmul"]["fwd"] == pytest.approx(ms["fwd", "aten::mm"], rel=1e-12), g
        assert g["attention"]["bwd"] == pytest.approx(ms["bwd", "benchtestpope::quick_attention"], rel=1e-12), g
        assert g["norms, pointwise"]["bwd"] == pytest.approx(ms["bwd", "benchtest::pointwise"], rel=1e-12), g
        assert g["optimizer"]["rest"] == pytest.approx(ms["optimizer", "benchtest::pointwise"], rel=1e-12), g
        total = sum(v for phases in g.values() for v in phases.values())
        assert total == pytest.approx(seen["wall"] / (1e3 * n), rel=1e-12) == got["wall_ms"], (total, got)


def test_the_timed_step_is_train_pys_clipped_and_clamped_with_15_rounds(monkeypatch):
    """--only=step times train.py's step: the gradients clipped to 1.0 (train.py's grad_clip) after unscaling, then
    AdamW, then every delta clamped; 15 interleaved rounds by default (6 gave ratios as wide as the effect),
    --rounds sets it. The step's work is spied (each arm's step runs twice), its time is not measured."""
    from model import GPT

    clipped, clamped, got = [], [], {}
    real_clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda p, m: clipped.append(m) or real_clip(p, m))
    real_clamp = GPT.clamp_pope_delta_
    monkeypatch.setattr(
        GPT, "clamp_pope_delta_", lambda self: clamped.append(self.config.pos_encoding) or real_clamp(self)
    )

    def run_twice(fns, device, rounds, warmup=1):
        got["rounds"] = rounds
        for _ in range(2):
            for f in fns.values():
                f()
        return {name: [1.0] * rounds for name in fns}

    monkeypatch.setattr(bench, "interleaved", run_twice)
    bench.bench_train_step("cpu", n_layer=1, n_embd=32, n_head=2, T=16, batch_size=2, vocab_size=64)
    assert got["rounds"] == 15 and clipped == [1.0] * 4 and sorted(clamped) == ["pope", "pope", "rope", "rope"]
    rounds = []
    monkeypatch.setattr(bench, "bench_train_step", lambda device, **kw: rounds.append(kw["rounds"]) or [{}, {}])
    monkeypatch.setattr(bench, "print_table", lambda *a: None)
    bench.main(["--only=step", "--device=cpu", "--profile"])
    bench.main(["--only=step", "--device=cpu", "--profile", "--rounds=7"])
    assert rounds == [15, 7]


def test_dispatch_bytes_counts_each_ops_tensors_and_pope_cartesian_stays_within_its_bound():
    """bench.dispatch_bytes sums every data-moving aten op's tensors: x.to(float32) alone is one op of 2 + 4 bytes per
    bf16 element, a broadcast input counts its elements once, views count nothing. bench.eager_transform_bytes,
    PoPE's transform op by op in eager mode per element of x, stays within today's bound: forward <= 60 (83 while
    eager mode also broadcast x before softplus, as Inductor wants), backward <= 136 (155 while the 2d-wide gradient
    was copied to float32 first); design 6 and 14."""
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    assert bench.dispatch_bytes(lambda: x.to(torch.float32))[1:] == (1, 6 * x.numel())
    assert bench.dispatch_bytes(lambda: x.expand(3, 4, 8).to(torch.float32))[1:] == (1, 2 * 32 + 4 * 96)
    assert bench.dispatch_bytes(lambda: x.unsqueeze(0).transpose(1, 2))[1:] == (0, 0)
    got = bench.eager_transform_bytes()
    assert got["design_fwd"] == 6 and got["design_bwd"] == 14
    assert got["fwd_bytes"] <= 60 and got["bwd_bytes"] <= 136, got
