"""bench_kernel.py's rows (issue 61): pope_triton is the whole attention call (transform, checkpoint, kernels) and
pope_kernel the kernels alone on ready q~, k~; a row that cannot run (rope_fa3 without FA3's package) says why
instead of showing nan. Tiny shapes through the Triton interpreter on a CPU."""

import math

import pytest
import torch

import bench_kernel
import pope

pytest.importorskip("pope_kernel")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rows(monkeypatch, impls):
    calls = []
    real = pope.pope_cartesian
    monkeypatch.setattr(pope, "pope_cartesian", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    kw = dict(dtype=torch.float32, seq_lens=(16,), head_dims=(16,), batch=1, n_head=2, verbose=False)
    return bench_kernel.bench_attention_kernels(DEV, impls=impls, **kw), calls


def test_the_kernel_row_times_the_kernels_alone_and_the_triton_row_the_whole_call(monkeypatch):
    """pope_kernel forms q~, k~ once (2 transforms) and then times only pope_kernel.attention: no transform in its
    forward, backward or fwd+bwd timings (pope_triton runs it in every call, and again in each backward: the
    selective checkpoint). Its times are finite, and its output equals the whole call's."""
    rows, calls = _rows(monkeypatch, ("pope_kernel",))
    assert len(calls) == 2 and math.isfinite(rows[0]["fwdbwd_ms"]) and "error" not in rows[0]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 16, generator=g).to(DEV) for _ in range(3))
    delta = (-2 * math.pi * torch.rand(2, 16, generator=g)).to(DEV)
    got = bench_kernel._kernel_alone(q, k, v, delta)()
    torch.testing.assert_close(got, pope.pope_attention(q, k, v, delta, backend="triton"), atol=1e-5, rtol=1e-5)


def test_a_row_that_cannot_run_says_why_instead_of_nan(monkeypatch, capsys):
    """rope_fa3 where FlashAttention-3 cannot be activated (its package missing; here torch refuses it on this
    machine, or a stand-in refusal): the printed row carries the reason and no 'nan'; the ratios skip it."""
    import torch.nn.attention as tna

    def refuse(name):
        raise ModuleNotFoundError("No module named 'flash_attn_interface'")

    monkeypatch.setattr(tna, "activate_flash_attention_impl", refuse, raising=False)
    rows, _ = _rows(monkeypatch, ("rope_fa3",))
    fa3 = rows[0]
    assert fa3["impl"] == "rope_fa3" and "FA3 not available" in fa3["error"] and "flash_attn_interface" in fa3["error"]
    bench_kernel.print_table(rows)
    out = capsys.readouterr().out
    line = next(s for s in out.splitlines() if s.startswith("rope_fa3"))
    assert "nan" not in out and "flash_attn_interface" in line, out
