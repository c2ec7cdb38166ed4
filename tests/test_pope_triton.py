"""PoPE's Triton backend (pope.pope_attention_triton over pope_kernel's FlashAttention-2) against float64 references.

Without CUDA the kernels run in the Triton interpreter on CPU tensors: tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports triton. With CUDA the same tests run on the GPU with the
compiled kernels, plus the bf16 test. Keep shapes small: the interpreter is slow. Tile sizes are set per
test through the kernels' autotune candidate lists (pope_kernel.KERNELS[role].configs).
"""

import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pope
import pope_kernel as pk

triton = pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
interpreter_only = pytest.mark.skipif(CUDA, reason="sets interpreter tiles; CUDA autotunes its own")

# (name, B, H, Tq, Tk, d, dv, causal, q_offset, magnitude, with_delta)
CASES = [
    ("causal_T37_softplus", 2, 2, 37, 37, 16, 16, True, 0, "softplus", True),
    ("bottom_right_chunk", 1, 2, 19, 53, 16, 16, True, 34, "softplus", True),
    ("offset_keys_unseen", 1, 2, 21, 50, 16, 16, True, 5, "relu", True),
    ("decode_one_token", 2, 2, 1, 29, 16, 16, True, 28, "softplus", True),
    ("noncausal_d64_relu", 1, 1, 33, 33, 64, 64, False, 0, "relu", True),
    ("noncausal_identity_nodelta", 1, 2, 30, 45, 16, 16, False, 7, "identity", False),
    ("causal_d64_identity", 1, 2, 40, 40, 64, 64, True, 0, "identity", True),
    ("causal_dv32_nodelta", 1, 2, 24, 24, 16, 32, True, 0, "softplus", False),
    ("tq_gt_tk", 1, 1, 45, 20, 16, 16, True, 0, "softplus", True),
]
# max |kernel - reference| <= TOL * max(1, max |reference|), per output / gradient
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 8e-2}


def _inputs(B, H, Tq, Tk, d, dv, with_delta, dtype, seed=0, H_kv=None):
    H_kv = H if H_kv is None else H_kv
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Tq, d, generator=g)
    k = torch.randn(B, H_kv, Tk, d, generator=g)
    v = torch.randn(B, H_kv, Tk, dv, generator=g)
    delta = -2 * torch.pi * torch.rand(H_kv, d, generator=g) if with_delta else None
    q, k, v = (t.to(DEV, dtype).requires_grad_() for t in (q, k, v))
    if delta is not None:
        delta = delta.to(DEV).requires_grad_()
    return q, k, v, delta


def _grads(out, leaves, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.device, out.dtype)
    return torch.autograd.grad(out, leaves, g)


def _check_against_reference(B, H, Tq, Tk, d, dv, causal, q_offset, magnitude, with_delta, dtype, **kw):
    q, k, v, delta = _inputs(B, H, Tq, Tk, d, dv, with_delta, dtype, **kw)
    return _check_leaves_against_reference(
        q, k, v, delta, dict(causal=causal, q_offset=q_offset, magnitude=magnitude), TOL[dtype]
    )


def _check_leaves_against_reference(q, k, v, delta, kw, tol, backend="triton"):
    """pope_attention(backend) and all its gradients vs pope_attention_reference in float64; returns the errors."""
    (B, H, Tq, _), dv, dtype = q.shape, v.shape[-1], q.dtype
    out = pope.pope_attention(q, k, v, delta, backend=backend, **kw)
    assert out.shape == (B, H, Tq, dv) and out.dtype == dtype
    leaves = [t for t in (q, k, v, delta) if t is not None]
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = pope.pope_attention_reference(*ref_leaves[:3], ref_leaves[3] if delta is not None else None, **kw)
    errors = {}
    for name, got, want in zip(
        ("out", "dq", "dk", "dv", "ddelta"), (out, *_grads(out, leaves)), (ref, *_grads(ref, ref_leaves))
    ):
        assert got.shape == want.shape, name
        assert torch.isfinite(got).all(), name
        err = (got.double() - want).abs().max().item()
        errors[name] = err
        assert err <= tol * max(1.0, want.abs().max().item()), (name, err, errors)
    return errors


def _set_tiles(monkeypatch, **tiles):
    """Run the kernels with these (BLOCK_M, BLOCK_N) tiles only (no autotuning), e.g. fwd=(16, 32)."""
    for role, (bm, bn) in tiles.items():
        monkeypatch.setattr(pk.KERNELS[role], "configs", [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn})])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fp32_forward_and_grads_match_reference(case):
    _check_against_reference(*case[1:], dtype=torch.float32)


@pytest.mark.parametrize("case", [CASES[1], CASES[4]], ids=[CASES[1][0], CASES[4][0]])
def test_fp16_forward_and_grads_match_reference(case):
    _check_against_reference(*case[1:], dtype=torch.float16)


@pytest.mark.skipif(
    not CUDA, reason="bf16 only on CUDA: the Triton interpreter's bf16 tl.dot is wrong (triton-lang/triton issue 11584)"
)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bf16_cuda_forward_and_grads_match_reference(case):
    _check_against_reference(*case[1:], dtype=torch.bfloat16)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("H, H_kv, Tq, Tk, q_offset", [(4, 2, 37, 37, 0), (6, 2, 19, 45, 26), (4, 1, 1, 30, 29)])
def test_grouped_query_attention_matches_reference_with_repeated_kv(backend, H, H_kv, Tq, Tk, q_offset):
    """H query heads share H_kv key/value heads (and their delta): output and every gradient equal the float64
    reference run on k, v, delta repeated over each group, with d(delta) and dK, dV summed over the group."""
    q, k, v, delta = _inputs(2, H, Tq, Tk, 16, 16, True, torch.float32, seed=11, H_kv=H_kv)
    G = H // H_kv
    out = pope.pope_attention(q, k, v, delta, q_offset=q_offset, backend=backend)
    got = _grads(out, (q, k, v, delta))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, delta)]
    rq, rk, rv, rdelta = leaves
    ref = pope.pope_attention_reference(
        rq, rk.repeat_interleave(G, 1), rv.repeat_interleave(G, 1), rdelta.repeat_interleave(G, 0), q_offset=q_offset
    )
    want = _grads(ref, leaves)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    for name, a, b in zip(("dq", "dk", "dv", "ddelta"), got, want):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-4, msg=name)


@interpreter_only
def test_other_block_sizes(monkeypatch):
    """Tile sizes the other way round (BLOCK_M < BLOCK_N in forward / dq, > in dkdv)."""
    _set_tiles(monkeypatch, fwd=(16, 32), dq=(16, 32), dkdv=(32, 16))
    _check_against_reference(1, 2, 29, 61, 16, 16, True, 32, "softplus", True, dtype=torch.float32)


@interpreter_only
def test_training_size_tiles_match_reference(monkeypatch):
    """The GPU's training tiles under the interpreter: Tq = Tk = 256, d = 64, a 128-row forward / dq tile and a
    128-key dK/dV tile (64 queries per step), every output and gradient against float64."""
    _set_tiles(monkeypatch, fwd=(128, 64), dkdv=(64, 128), dq=(128, 64))
    errors = _check_against_reference(1, 2, 256, 256, 64, 64, True, 0, "softplus", True, dtype=torch.float32)
    assert max(errors.values()) < 1e-4, errors


def test_large_q_offset_several_key_tiles():
    """Queries at absolute positions ~1e4 (phases ~1e4 rad) against keys spanning 5 key tiles."""
    q, k, v, delta = _inputs(1, 2, 40, 70, 16, 16, True, torch.float32, seed=3)
    _check_leaves_against_reference(q, k, v, delta, dict(causal=True, q_offset=10_000, magnitude="softplus"), tol=1e-4)


def test_long_keys_large_phases(monkeypatch):
    """~1e4 keys, so key phases reach 1e4 rad; a decode-style chunk of 20 queries at the end. Big
    interpreter tiles keep it fast."""
    if not CUDA:
        _set_tiles(monkeypatch, fwd=(32, 128), dq=(32, 128), dkdv=(32, 128))
    Tk = 10_020
    q, k, v, delta = _inputs(1, 1, 20, Tk, 16, 16, True, torch.float32, seed=4)
    _check_leaves_against_reference(q, k, v, delta, dict(causal=True, q_offset=Tk - 20, magnitude="softplus"), tol=1e-4)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_phases_exact_at_1e5_tokens(backend):
    """Queries at absolute positions ~1e5 (phases ~1e5 rad): every phase must be the exact s * theta_c of the
    fp32 frequency table (pope_frequencies), so out and every gradient match the float64 reference (which uses
    that same table) to fp32 rounding. fp32 phase products are off by up to ~4e-3 rad here."""
    q, k, v, delta = _inputs(1, 2, 20, 40, 16, 16, True, torch.float32, seed=7)
    _check_leaves_against_reference(
        q, k, v, delta, dict(causal=True, q_offset=100_000 - 20, magnitude="softplus"), tol=2e-5, backend=backend
    )


def test_strided_inputs_as_in_the_model():
    """q, k, v as transposed views of one (B, T, 3, H, d) projection, like model.py passes them."""
    B, T, H, d = 2, 27, 2, 16
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(B, T, 3, H, d, generator=g).to(DEV).requires_grad_()
    delta = (-2 * torch.pi * torch.rand(H, d, generator=g)).to(DEV).requires_grad_()
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    out = pope.pope_attention(q, k, v, delta, backend="triton")
    ref_qkv, ref_delta = qkv.detach().double().requires_grad_(), delta.detach().double().requires_grad_()
    ref = pope.pope_attention_reference(*(ref_qkv[:, :, i].transpose(1, 2) for i in range(3)), ref_delta)
    got, want = _grads(out, (qkv, delta)), _grads(ref, (ref_qkv, ref_delta))
    assert (out.double() - ref).abs().max() < 1e-5
    for a, b in zip(got, want):
        assert (a.double() - b).abs().max() < 1e-4 * max(1.0, b.abs().max().item())


# ---- the FlashAttention core on its own (pope_kernel.attention) ----------------------------------------


def _plain_reference(q, k, v, causal, q_offset):
    """float64 softmax(ln 2 * q k^T) v with k, v repeated over the query heads of each group, and its lse."""
    G = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    z = math.log(2) * q.double() @ k.transpose(-1, -2)
    if causal:
        z = z.masked_fill(~pope.causal_mask(q.shape[2], k.shape[2], q_offset, device=q.device), float("-inf"))
    return torch.softmax(z, -1) @ v, torch.logsumexp(z, -1)


@pytest.mark.parametrize(
    "H, H_kv, Tq, Tk, d_qk, d_v, causal, q_offset",
    [
        (2, 2, 37, 37, 32, 16, True, 0),
        (4, 2, 19, 53, 64, 32, True, 34),
        (2, 1, 45, 20, 32, 16, True, 0),
        (1, 1, 33, 40, 16, 64, False, 0),
        (2, 2, 1, 29, 32, 16, True, 28),
    ],
)
def test_kernel_core_matches_softmax_attention(H, H_kv, Tq, Tk, d_qk, d_v, causal, q_offset):
    """pope_kernel.attention alone (its own autograd registration): o, lse (nats) and dq, dk, dv of
    softmax(ln 2 * q k^T) v with d_qk != d_v, grouped heads, causal with q_offset."""
    g = torch.Generator().manual_seed(Tq)
    q = torch.randn(2, H, Tq, d_qk, generator=g).to(DEV).requires_grad_()
    k = torch.randn(2, H_kv, Tk, d_qk, generator=g).to(DEV).requires_grad_()
    v = torch.randn(2, H_kv, Tk, d_v, generator=g).to(DEV).requires_grad_()
    o, lse = pk.attention(q, k, v, causal=causal, q_offset=q_offset)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_o, ref_lse = _plain_reference(*ref_leaves, causal, q_offset)
    torch.testing.assert_close(o.double(), ref_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    for name, a, b in zip("qkv", _grads(o, (q, k, v)), _grads(ref_o, ref_leaves)):
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-4, msg=f"d{name}")


def test_backward_logits_reproduce_forward_lse(monkeypatch):
    """The dK/dV kernel recomputes P = exp(S - LSE) at other tile sizes than the forward. With dO[i, c] =
    1[c == i], dV[j, i] = P[i, j], so the column sums of dV are exp(LSE_backward - LSE_forward) per query row:
    they must be 1 to fp32 rounding."""
    if not CUDA:
        _set_tiles(monkeypatch, dkdv=(16, 32))
    B, H, Tq, Tk, d = 1, 2, 16, 45, 16
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(B, H, T, 2 * d, generator=g).to(DEV) for T in (Tq, Tk, Tk))
    v = v[..., :d].contiguous()
    o, lse = pk.attention_forward(q, k, v, True, Tk - Tq)
    do = torch.eye(Tq, d, device=DEV).expand(B, H, Tq, d).contiguous()
    _, _, dv = pk.attention_backward(do, q, k, v, o, lse, True, Tk - Tq)
    row_sums = dv.double().sum(dim=2)[..., :Tq]  # (B, H, Tq)
    assert (row_sums - 1).abs().max().item() < 1e-5


# ---- determinism and the autotuner ---------------------------------------------------------------------


def _ddelta(q, k, v, delta, **kw):
    out = pope.pope_attention(q, k, v, delta, backend="triton", **kw)
    return _grads(out, (q, k, v, delta))


def test_ddelta_is_bitwise_repeatable():
    """d(delta) (one torch reduction over the recomputed phases) and dq, dk, dv from two backward calls."""
    q, k, v, delta = _inputs(2, 2, 40, 40, 16, 16, True, torch.float32, seed=12)
    first, second = _ddelta(q, k, v, delta), _ddelta(q, k, v, delta)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@interpreter_only
def test_ddelta_agrees_across_pinned_tiles(monkeypatch):
    """Two pinned tile configs (pope_kernel.pin_configs, the function behind POPE_TRITON_CONFIG) sum in
    another order: d(delta) and every gradient agree to fp32 rounding, not more."""
    q, k, v, delta = _inputs(2, 2, 70, 70, 16, 16, True, torch.float32, seed=13)
    results = []
    for spec in ("fwd=16,32,4,2;dkdv=16,32,4,2;dq=16,32,4,2", "fwd=64,16,4,2;dkdv=64,16,4,2;dq=64,16,4,2"):
        for role in pk.KERNELS:
            monkeypatch.setattr(pk.KERNELS[role], "configs", pk.KERNELS[role].configs)  # restored after the test
        pk.pin_configs(spec)
        assert [c.kwargs["BLOCK_M"] for c in pk.KERNELS["dkdv"].configs] == [int(spec.split("=")[2].split(",")[0])]
        results.append(_ddelta(q, k, v, delta))
    for name, a, b in zip(("dq", "dk", "dv", "ddelta"), *results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


@interpreter_only
def test_every_autotune_candidate_overwrites_its_outputs(monkeypatch):
    """On a GPU the autotuner launches every candidate config, several times, on the live output buffers before
    the winner runs. Emulated here with two candidates per kernel and a benchmark that launches each twice:
    an output that a kernel accumulates into, or leaves partly unwritten, would no longer match the reference."""
    for role, tiles in (("fwd", ((16, 16), (32, 16))), ("dkdv", ((16, 16), (16, 64))), ("dq", ((32, 16), (16, 32)))):
        kernel = pk.KERNELS[role]
        monkeypatch.setattr(kernel, "configs", [triton.Config({"BLOCK_M": m, "BLOCK_N": n}) for m, n in tiles])
        monkeypatch.setattr(kernel, "cache", {})
        monkeypatch.setattr(kernel, "cache_results", False)
        # do_bench is a cached property that needs a GPU driver: set the instance's own value
        monkeypatch.setitem(kernel.__dict__, "do_bench", lambda fn, quantiles=None: (fn(), fn(), [1.0, 1.0, 1.0])[-1])
    q, k, v, delta = _inputs(2, 2, 37, 70, 16, 16, True, torch.float32, seed=6)
    _check_leaves_against_reference(q, k, v, delta, dict(causal=True, q_offset=0), tol=1e-4)
    assert all(len(pk.KERNELS[role].cache) == 1 for role in pk.KERNELS)  # the autotuner did run


@pytest.mark.parametrize(
    "spec, want",
    [
        ("", {}),
        ("fwd=128,64,8,3", {"fwd": (128, 64, 8, 3)}),
        (" dkdv=64,128,8,3 ; dq=64,32,4,3 ", {"dkdv": (64, 128, 8, 3), "dq": (64, 32, 4, 3)}),
    ],
)
def test_pinned_configs_parse(monkeypatch, spec, want):
    monkeypatch.setenv(pk.PIN_ENV, spec)
    assert pk.pinned_configs() == want


@pytest.mark.parametrize("spec", ["fwd=128,64,8", "bwd=64,64,4,3", "fwd=96,64,4,3", "dq=a,b,c,d"])
def test_pinned_configs_reject_bad_values(monkeypatch, spec):
    monkeypatch.setenv(pk.PIN_ENV, spec)
    with pytest.raises(ValueError, match=pk.PIN_ENV):
        pk.pinned_configs()


def test_pin_environment_variable_is_applied_at_import():
    """POPE_TRITON_CONFIG, read when pope_kernel is imported, leaves the pinned kernels one candidate each."""
    code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); import pope_kernel as pk\n"
        "print([(r, [(c.kwargs['BLOCK_M'], c.kwargs['BLOCK_N'], c.num_warps, c.num_stages) for c in k.configs])"
        " for r, k in pk.KERNELS.items()])"
    )
    env = dict(os.environ, POPE_TRITON_CONFIG="fwd=64,32,4,3;dq=128,64,8,2")
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    got = dict(eval(res.stdout))
    assert got["fwd"] == [(64, 32, 4, 3)] and got["dq"] == [(128, 64, 8, 2)] and len(got["dkdv"]) > 1


# ---- dispatch, errors, torch.compile ----------------------------------------------------------------------


def test_auto_backend_on_cpu_uses_torch(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("backend='auto' must not use the Triton kernel for CPU tensors")

    monkeypatch.setattr(pope, "pope_attention_triton", fail)
    q, k, v, delta = (t.detach().cpu() for t in _inputs(1, 2, 9, 9, 16, 16, True, torch.float32))
    out = pope.pope_attention(q, k, v, delta)  # default backend is 'auto'
    torch.testing.assert_close(out, pope.pope_attention(q, k, v, delta, backend="torch"), rtol=0, atol=0)


def _mock_gpu(monkeypatch, arch, limit=None):
    """Tensors claim to be on CUDA, and the device reports compute capability `arch` (e.g. 86) and `limit`
    bytes of opt-in shared memory per block (default: the part's, pope_kernel.SHARED_MEMORY_LIMITS).
    Returns the list of the devices the capability queries were asked about. device_unsupported_reason's cache
    starts empty under each mock and is restored after the test."""
    from types import SimpleNamespace

    asked = []
    monkeypatch.setattr(pk, "_device_reason", functools.lru_cache(maxsize=None)(pk._device_reason.__wrapped__))
    props = SimpleNamespace(
        major=arch // 10, minor=arch % 10, shared_memory_per_block_optin=limit or pk.SHARED_MEMORY_LIMITS[arch]
    )
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: (asked.append(device), props)[1])
    monkeypatch.setattr(
        torch.cuda, "get_device_capability", lambda device=None: (asked.append(device), (props.major, props.minor))[1]
    )
    return asked


def test_auto_backend_sends_fp32_to_torch_path(monkeypatch):
    """On CUDA, backend='auto' uses the kernel for fp16/bf16 only; checked with tensors that claim to be on CUDA."""
    _mock_gpu(monkeypatch, 90)
    for dtype, want in ((torch.float32, "torch"), (torch.float16, "triton"), (torch.bfloat16, "triton")):
        q, k, v = (torch.randn(1, 1, 4, 16, dtype=dtype) for _ in range(3))
        assert pope.pope_backend(q, k, v) == want
    q = torch.randn(1, 1, 4, 24, dtype=torch.float16)
    assert pope.pope_backend(q, q, q) == "torch"  # unsupported head dim


def test_auto_backend_needs_tensor_core_dot(monkeypatch):
    """Below compute capability 8.0 (V100 sm_70, T4 sm_75) Triton's tl.dot compiles to FMA loops, not mma:
    backend='auto' takes SDPA there, and asks the capability of q's own device, not the current one."""
    q, k, v = (torch.randn(1, 2, 4, 16, dtype=torch.float16) for _ in range(3))
    for arch, want in ((70, "torch"), (75, "torch"), (80, "triton"), (86, "triton"), (90, "triton")):
        asked = _mock_gpu(monkeypatch, arch, limit=101_376)
        assert pope.pope_backend(q, k, v) == want, arch
        assert asked and all(dev == q.device for dev in asked), asked


def test_device_unsupported_reason_is_remembered_per_device(monkeypatch):
    """The answer is remembered per (device, dtype, D_QK, D_V): the same as shared_memory_reason computes for the
    device's capability and limit, each device asked once. cuda:0 (an sm_86 part, 101,376 B) refuses fp32 at
    widths 256 / 128 and cuda:1 (sm_90) takes it, whichever is asked first; 'cuda' is the current device. An
    error of the device query is raised each time, never remembered."""
    from types import SimpleNamespace

    parts = {
        0: SimpleNamespace(major=8, minor=6, shared_memory_per_block_optin=101_376),
        1: SimpleNamespace(major=9, minor=0, shared_memory_per_block_optin=232_448),
    }
    asked = []

    def props(device=None):
        asked.append(device)
        if torch.device(device).index not in parts:
            raise RuntimeError(f"Invalid device id {device}")
        return parts[torch.device(device).index]

    monkeypatch.setattr(pk, "_device_reason", functools.lru_cache(maxsize=None)(pk._device_reason.__wrapped__))
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    cases = [(dtype, 2 * d, d) for dtype in (torch.float32, torch.bfloat16) for d in (16, 64, 128)]
    for order in ((1, 0), (0, 1)):
        for i in order:
            for dtype, d_qk, d_v in cases:
                arch = parts[i].major * 10 + parts[i].minor
                want = pk.shared_memory_reason(arch, parts[i].shared_memory_per_block_optin, dtype, d_qk, d_v)
                assert pk.device_unsupported_reason(torch.device("cuda", i), dtype, d_qk, d_v) == want
    n = len(asked)
    assert n == 2 * len(cases) and sorted({torch.device(d).index for d in asked}) == [0, 1], asked
    assert "sm_86's 101,376 bytes" in pk.device_unsupported_reason(torch.device("cuda:0"), torch.float32, 256, 128)
    assert pk.device_unsupported_reason(torch.device("cuda:1"), torch.float32, 256, 128) is None
    assert pk.device_unsupported_reason("cuda", torch.float32, 256, 128) is None  # the current device, cuda:1
    assert len(asked) == n  # all remembered
    for _ in range(2):
        with pytest.raises(RuntimeError, match="Invalid device id"):
            pk.device_unsupported_reason(torch.device("cuda:2"), torch.float32, 256, 128)
    assert len(asked) == n + 2


@pytest.mark.parametrize("d", [8, 24, 256])
def test_unsupported_head_dim_raises(d):
    q, k, v, _ = _inputs(1, 1, 4, 4, d, d, False, torch.float32)
    with pytest.raises(ValueError, match="head dims"):
        pope.pope_attention(q, k, v, backend="triton")


@pytest.mark.parametrize("d_qk, d_v", [(16, 8), (8, 16), (32, 256)])
def test_the_custom_ops_refuse_widths_the_kernels_do_not_take(d_qk, d_v):
    """pope::attention_forward / attention_backward called directly (unchecked entries) raise the same sentence
    as attention for a width outside QK_DIMS / V_DIMS: a value width of 8 ran in the interpreter and failed to
    compile on an H200 (a tl.dot needs K >= 16)."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 8, d_qk, generator=g).to(DEV) for _ in range(2))
    v = torch.randn(1, 2, 8, d_v, generator=g).to(DEV)
    with pytest.raises(ValueError, match="supports query/key widths"):
        pk.attention_forward(q, k, v, True, 0)
    o, lse = torch.zeros(1, 2, 8, d_v, device=DEV), torch.zeros(1, 2, 8, device=DEV)
    with pytest.raises(ValueError, match="supports query/key widths"):
        pk.attention_backward(torch.ones_like(o), q, k, v, o, lse, True, 0)


def test_float64_raises():
    q, k, v, _ = _inputs(1, 1, 4, 4, 16, 16, False, torch.float64)
    with pytest.raises(ValueError, match="float16, bfloat16 and float32"):
        pope.pope_attention(q, k, v, backend="triton")


def test_triton_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setattr(pk, "INTERPRETING", False)
    q, k, v = (t.detach().cpu() for t in _inputs(1, 1, 4, 4, 16, 16, False, torch.float32)[:3])
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        pope.pope_attention(q, k, v, backend="triton")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        pk.attention(q, k, v)


def test_bad_backend_raises():
    q, k, v = (t.detach().cpu() for t in _inputs(1, 1, 4, 4, 16, 16, False, torch.float32)[:3])
    with pytest.raises(ValueError, match="backend"):
        pope.pope_attention(q, k, v, backend="cuda")


def test_torch_compile_keeps_custom_op_in_graph(tmp_path, monkeypatch):
    """fullgraph=True fails on a graph break, so the autograd.Function around the custom ops (with their fake
    kernels) must trace, backward included; the default backend (Inductor, a fresh cache) runs the graph."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    q, k, v, delta = _inputs(1, 2, 20, 20, 16, 16, True, torch.float32)

    def f(q, k, v, delta):
        return pope.pope_attention(q, k, v, delta, backend="triton", q_offset=0).sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    got = compiled(q, k, v, delta)
    got.backward()
    grads = [t.grad.clone() for t in (q, k, v, delta)]
    for t in (q, k, v, delta):
        t.grad = None
    want = f(q, k, v, delta)
    want.backward()
    torch.testing.assert_close(got, want)
    for a, t in zip(grads, (q, k, v, delta)):
        torch.testing.assert_close(a, t.grad)


def _saved_cartesian(backend, compiled, B=2, T=32, H=2, d=16):
    """How many (B, H, T, 2d) tensors a 2-layer PoPE GPT keeps for the backward of one fp16-autocast training step.
    compiled: the whole step under torch.compile (fullgraph) with a backend that runs AOTAutograd with Inductor's
    decompositions and min-cut partitioner (what the default torch.compile does before code generation): the
    forward graph's outputs besides the loss. Eager: the tensors the forward created that are still
    alive after it, each storage once (tests/saved.py; the bytes are not counted)."""
    from functools import partial

    from saved import kept_for_backward
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    from model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=H, n_embd=H * d, block_size=T, vocab_size=64, attn_backend=backend)).to(DEV)
    x = torch.randint(0, 64, (B, T)).to(DEV)
    saved = []

    def step(x):
        with torch.autocast(DEV, dtype=torch.float16):
            return model(x, x)[1]

    wide = lambda t: tuple(t.shape) == (B, H, T, 2 * d)
    if not compiled:
        return len(kept_for_backward(lambda: step(x), wide)[1])

    def forward_compiler(gm, example_inputs):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        saved.extend(
            a.meta["val"] for a in out.args[0] if hasattr(a, "meta") and isinstance(a.meta.get("val"), torch.Tensor)
        )
        return gm

    def aot_backend(gm, example_inputs):
        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=forward_compiler,
            bw_compiler=lambda gm, _: gm,
            partition_fn=partial(min_cut_rematerialization_partition, compiler="inductor"),
            decompositions=select_decomp_table(),
        )

    torch._dynamo.reset()
    torch.compile(step, backend=aot_backend, fullgraph=True)(x)
    return len([t for t in saved if wide(t)])


@pytest.mark.parametrize("backend, eager_count", [("triton", 0), ("torch", 8)])
def test_compiled_training_step_keeps_no_more_cartesian_tensors_than_eager(backend, eager_count):
    """Traced by Dynamo, an autograd.Function's forward and backward share one joint graph: AOTAutograd's CSE
    merged the backward's recomputation of q~, k~ with the forward's, and the partitioner then saved both, 4
    (B, H, T, 2d) tensors for 2 layers. The Triton path keeps none (its selective checkpoint recomputes q~, k~);
    the torch path keeps SDPA's inputs and output, as eager autograd does."""
    n_eager = _saved_cartesian(backend, compiled=False)
    n_compiled = _saved_cartesian(backend, compiled=True)
    assert n_eager == eager_count
    assert n_compiled <= n_eager, (backend, n_compiled, n_eager)


def test_opcheck():
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 12, 32, generator=g).to(DEV).requires_grad_() for _ in range(2))
    v = torch.randn(1, 2, 12, 16, generator=g).to(DEV).requires_grad_()
    torch.library.opcheck(pk.attention_forward, (q, k, v, True, 0))
    torch.library.opcheck(pk.attention_forward, (q, k[:, :1], v[:, :1], False, 3))
    o, lse = pk.attention_forward(q, k, v, True, 0)
    torch.library.opcheck(
        pk.attention_backward, (torch.randn_like(o), q.detach(), k.detach(), v.detach(), o.detach(), lse, True, 0)
    )


def test_launch_limits_raise_clear_errors():
    """Limits of the kernels' index arithmetic are checked on the host (no allocation needed)."""
    with pytest.raises(ValueError, match="int32 positions"):
        pk.check_limits(1, 1, 16, 16, 2**31 - 8, (64, 64))
    with pytest.raises(ValueError, match="grid limit"):
        pk.check_limits(2**16, 2**8, 2**11, 2**11, 0, (64, 64))
    with pytest.raises(ValueError, match="row stride"):
        pk.check_limits(1, 1, 16, 16, 0, (64, 2**24))
    pk.check_limits(2**12, 32, 4096, 4096, 0, (3 * 4096, 3 * 4096))  # B * H = 131072 > 65,535: fine


def test_grid_is_one_dimensional(monkeypatch):
    """B * H must not sit on CUDA's grid axis 1 (at most 65,535): every autotuned launch uses a 1-D grid over
    (batch, head, tile), with H_kv heads for the dK/dV kernel."""
    grids = []
    for role, kernel in pk.KERNELS.items():
        run = kernel.run

        def record(*args, grid, _run=run, _role=role, **kw):
            grids.append((_role, grid({"BLOCK_M": 16, "BLOCK_N": 16})))
            return _run(*args, grid=grid, **kw)

        monkeypatch.setattr(kernel, "run", record)
    q, k, v, delta = _inputs(2, 6, 20, 20, 16, 16, True, torch.float32, H_kv=3)
    pope.pope_attention(q, k, v, delta, backend="triton").sum().backward()
    assert dict(grids) == {"fwd": (2 * 6 * 2,), "dkdv": (2 * 3 * 2,), "dq": (2 * 6 * 2,)}, grids


def test_every_kernel_is_launched_with_fp_fusion_set(monkeypatch):
    """Triton 3.9 warns when FP fusion is left to its default and 3.10 turns the default off: each of the four
    kernels gets enable_fp_fusion=True at its launch (pope_kernel.COMPILE_OPTIONS), seen here where the
    autotuner hands the call to the jitted function, which compiles with it on a GPU."""
    seen = {}
    for role, fn in (
        ("fwd", pk.KERNELS["fwd"].fn),
        ("pre", pk.PRE_KERNEL),
        ("dkdv", pk.KERNELS["dkdv"].fn),
        ("dq", pk.KERNELS["dq"].fn),
    ):

        def record(*args, _run=fn.run, _role=role, **kw):
            seen[_role] = kw.get("enable_fp_fusion")
            return _run(*args, **kw)

        monkeypatch.setattr(fn, "run", record)
    q, k, v, delta = _inputs(1, 2, 20, 20, 16, 16, True, torch.float32)
    pope.pope_attention(q, k, v, delta, backend="triton").sum().backward()
    assert seen == {"fwd": True, "pre": True, "dkdv": True, "dq": True}, seen


TF32_PROBE = """
import sys
sys.path.insert(0, {repo!r})
import torch, pope_kernel as pk
{setup}
print(pk.dot_precision(torch.float32), pk.dot_precision(torch.bfloat16))
"""

TF32_CASES = {  # what torch was told -> tl.dot precision for fp32 operands
    "": "ieee",
    "torch.backends.cuda.matmul.allow_tf32 = True": "tf32",
    "torch.backends.cuda.matmul.fp32_precision = 'tf32'": "tf32",
    "torch.backends.cuda.matmul.fp32_precision = 'ieee'": "ieee",
    "torch.backends.fp32_precision = 'tf32'": "tf32",
    "torch.backends.cuda.matmul.allow_tf32 = True\ntorch.backends.cuda.matmul.fp32_precision = 'ieee'": "ieee",
}


def test_dot_precision_reads_both_tf32_apis():
    """torch's newer fp32_precision API makes a later read of the legacy allow_tf32 flag raise. The flags are
    global, so each case runs in a fresh process (all at once)."""
    procs = {
        setup: subprocess.Popen(
            [sys.executable, "-c", TF32_PROBE.format(repo=str(REPO), setup=setup)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for setup in TF32_CASES
    }
    for setup, proc in procs.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, (setup, err[-2000:])
        assert out.split() == [TF32_CASES[setup], "tf32"], setup


@pytest.fixture(scope="module")
def tf32_turned_on_by_a_module_fixture():
    """TF32 on for the rest of the process, as a module or session fixture that trains on CUDA leaves it
    (train.main) or as transformers' enable_tf32 sets it (process-wide); set before any test's own fixtures run."""
    b = torch.backends
    if hasattr(b, "fp32_precision"):
        b.fp32_precision = "tf32"
    else:  # torch < 2.9
        b.cuda.matmul.allow_tf32 = True
    yield


def test_no_test_inherits_tf32_from_a_fixture(tf32_turned_on_by_a_module_fixture):
    """conftest's _tf32_restored gives every test the process's starting fp32 precision, also after a fixture of
    a wider scope turned TF32 on (on an H200 the Triton kernel's fp32 tests then missed 1e-5 by 1e-3)."""
    assert pk.dot_precision(torch.float32) == "ieee"


# ---- shared memory per architecture (no GPU) ----------------------------------------------------------------
# Triton refuses a launch whose shared memory exceeds the part's opt-in limit; when every candidate the
# autotuner keeps does, the first backward (or forward) dies. For every part, dtype and head dim the kernel
# takes, the kept candidates of each kernel must fit, by the model pope_kernel.shared_memory_bytes, which the
# compile-only tests below check against Triton's own metadata.shared; cases nothing fits are refused.

PROBLEMS = {"training": (1024, 1024, ("fwd", "dq", "dkdv")), "decoding": (1, 4096, ("fwd",))}
REFUSED = [(86, torch.float32, 128), (89, torch.float32, 128), (120, torch.float32, 128)]  # the 101,376-B parts


def _kept(role, tq, tk, d, dtype, arch):
    """[(config tuple, model bytes)] the autotuner keeps for PoPE at raw head dim d (D_QK = 2d, D_V = d) on
    sm_<arch>."""
    e = torch.empty((), dtype=dtype).element_size()
    cfgs = pk.select_configs(
        role,
        pk.gpu_configs(role),
        pk.pow2_bucket(tq),
        pk.pow2_bucket(tk),
        2 * d,
        d,
        e,
        arch,
        pk.SHARED_MEMORY_LIMITS[arch],
    )
    keys = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in cfgs]
    return [(key, pk.shared_memory_bytes(role, key, 2 * d, d, e, arch)) for key in keys]


def test_every_part_dtype_and_head_dim_keeps_tiles_that_fit_or_is_refused():
    """sm_80 (A100, 166,912 B), sm_86 / sm_89 (A10, 3090, L4, L40: 101,376 B), sm_90 (H100, 232,448 B), sm_100
    (B200, 232,448 B), sm_120 (RTX 50xx, RTX PRO 6000 Blackwell: 101,376 B); fp16, bf16, fp32; d in 16..128; the
    forward, dQ and dK/dV kernels of a training step (Tq = Tk = 1024) and the forward of decoding (Tq = 1, Tk =
    4096): every candidate kept fits the part, and training keeps >= 64-row tiles where one fits. Only fp32 at d =
    128 on the 101,376-byte parts fits nowhere: refused with a reason."""
    refused = []
    for arch, limit in pk.SHARED_MEMORY_LIMITS.items():
        for dtype in pk.DTYPES:
            for d in pope.TRITON_HEAD_DIMS:
                if pk.shared_memory_reason(arch, limit, dtype, 2 * d, d) is not None:
                    refused.append((arch, dtype, d))
                    continue
                for problem, (tq, tk, roles) in PROBLEMS.items():
                    for role in roles:
                        kept = _kept(role, tq, tk, d, dtype, arch)
                        case = (arch, dtype, d, problem, role, kept)
                        assert kept and all(b <= limit for _, b in kept), case
                        big = [c for c in pk.CONFIGS[role][pk.head_class(2 * d, d)] if c[0] >= 64]
                        if (
                            problem == "training"
                            and role != "dkdv"
                            and any(
                                pk.shared_memory_bytes(role, c, 2 * d, d, 2 if dtype != torch.float32 else 4, arch)
                                <= limit
                                for c in big
                            )
                        ):
                            assert all(c[0] >= 64 for c, _ in kept), case
    assert refused == REFUSED


def test_backend_refuses_a_case_no_tile_fits_and_auto_takes_torch(monkeypatch):
    """fp32 at d = 128 on an sm_86 part: backend='triton' (and pope_kernel.attention) raise a ValueError that says
    why, up front; a bf16 case on a (made-up) part with 48 KB per block: backend='auto' takes the torch path.
    The shared-memory query names q's device."""
    asked = _mock_gpu(monkeypatch, 86)
    q, k, v = (torch.randn(1, 1, 4, 128) for _ in range(3))
    with pytest.raises(ValueError, match="shared memory"):
        pope.pope_attention(q, k, v, backend="triton")
    with pytest.raises(ValueError, match="no fwd tile .* sm_86's 101,376 bytes"):
        pk.attention(torch.randn(1, 1, 4, 256), torch.randn(1, 1, 4, 256), v)
    assert asked and all(dev == q.device for dev in asked)
    qh, kh, vh = (t.half() for t in (q, k, v))
    assert pope.pope_backend(qh, kh, vh) == "triton"
    _mock_gpu(monkeypatch, 86, limit=48 * 1024)
    assert pope.pope_backend(qh, kh, vh) == "torch"
    with pytest.raises(ValueError, match="shared memory"):
        pope.pope_attention(qh, kh, vh, backend="triton")


SHARED = """
import json, sys
sys.path.insert(0, {repo!r})
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import bench_kernel as bk, pope_kernel as pk
for role, d, cfg, arch, dtype, prec in {cases!r}:
    fn = pk.KERNELS[role].fn
    consts = dict(GROUP=1, D_QK=2 * d, D_V=d, CAUSAL=True, DOT_PREC=prec, BLOCK_M=cfg[0], BLOCK_N=cfg[1])
    consts.update(bk.NO_DOCUMENTS)
    sig, attrs = {{}}, {{}}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in bk._POINTERS:
            sig[name] = "*fp32" if name in bk._FP32_ARGS else "*" + dtype
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            if name not in bk._RUNTIME_INTS:
                attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", arch, 32),
                            options=dict(num_warps=cfg[2], num_stages=cfg[3]))
    print(json.dumps([role, d, cfg, arch, dtype, prec, kernel.metadata.shared]), flush=True)
"""


def _compiled_shared(cases):
    """Triton's metadata.shared (bytes) of each (role, d, config, arch, 'bf16' | 'fp16' | 'fp32', 'tf32' | 'ieee')
    case, compiled in a subprocess without TRITON_INTERPRET (no GPU needed)."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", SHARED.format(repo=str(REPO), cases=cases)],
        capture_output=True,
        text=True,
        timeout=7200,
        env=env,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return [json.loads(line) for line in res.stdout.splitlines()]


def _check_model_bounds_compiled(cases):
    for role, d, cfg, arch, dtype, prec, shared in _compiled_shared(cases):
        model = pk.shared_memory_bytes(role, tuple(cfg), 2 * d, d, 4 if dtype == "fp32" else 2, arch)
        assert shared <= model, (role, d, cfg, arch, dtype, prec, shared, model)


@pytest.mark.skipif(CUDA, reason="compile-only check for CPU machines")
def test_shared_memory_model_bounds_the_compiled_kernels_of_the_tight_cases():
    """The first candidate kept for the tightest cases of the test above (d = 128, training: bf16 on sm_86, the
    wgmma forward on sm_90, fp32 on sm_80; the tcgen05 dQ on sm_100, whose (64, 64, 8, 3) compiles to 230,400 of
    its 232,448 bytes; the mma.sync forward on sm_120), compiled: Triton's metadata.shared is at most the model's
    bytes."""
    cases = [
        (role, 128, _kept(role, 1024, 1024, 128, dtype, arch)[0][0], arch, name, "tf32")
        for arch, dtype, name, roles in (
            (86, torch.bfloat16, "bf16", ("fwd", "dq", "dkdv")),
            (90, torch.bfloat16, "bf16", ("fwd",)),
            (80, torch.float32, "fp32", ("fwd", "dq")),
            (100, torch.bfloat16, "bf16", ("dq",)),
            (120, torch.bfloat16, "bf16", ("fwd",)),
        )
        for role in roles
    ]
    assert (cases[6][2], cases[6][3]) == ((64, 64, 8, 3), 100)
    _check_model_bounds_compiled(cases)


@pytest.mark.skipif(CUDA, reason="compile-only check for CPU machines")
def test_shared_memory_model_keeps_its_kilobyte_over_the_compiled_dkdv_and_fp32_builds():
    """Three builds whose compiled shared memory lies within a few hundred bytes of a term of the model, d = 64: the
    tcgen05 dK/dV on sm_100 (32, 128, 8, 3), bf16 (its num_stages + 1 buffers of query rows); the mma.sync dK/dV on
    sm_80 (32, 64, 4, 3), bf16 (the per-row lse and Di in each buffer); the fp32 forward on sm_120 (32, 64, 4, 2) (the
    row-reduction scratch). Each model figure is at least the compiled one plus the documented 1 KB."""
    cases = [
        ("dkdv", 64, (32, 128, 8, 3), 100, "bf16", "tf32"),
        ("dkdv", 64, (32, 64, 4, 3), 80, "bf16", "tf32"),
        ("fwd", 64, (32, 64, 4, 2), 120, "fp32", "tf32"),
    ]
    for role, d, cfg, arch, dtype, _, shared in _compiled_shared(cases):
        model = pk.shared_memory_bytes(role, tuple(cfg), 2 * d, d, 4 if dtype == "fp32" else 2, arch)
        assert shared + 1024 <= model, (role, d, cfg, arch, dtype, shared, model)


def test_blackwell_tiles_that_fit_are_kept():
    """Tiles whose builds fit the part are kept (Triton 3.7.1 compile-only figures, docs/kernel.md). sm_120 /
    sm_121 build mma.sync as sm_80-89 do, so Hopper's rules (the model before) pruned its 64-row d = 128 forward
    (90,112 B compiled) and left the training forward only 32- and 16-row tiles; sm_100's tcgen05 dQ at d = 128
    (64, 64, 8, 3) compiles to 230,400 B, 24,576 B more than Hopper's rules said, and still fits."""
    e = 2
    for role, d, cfg, arch, compiled in (
        ("fwd", 128, (64, 64, 4, 2), 120, 90_112),
        ("fwd", 64, (128, 64, 8, 3), 120, 81_920),
        ("dq", 64, (64, 64, 4, 3), 120, 81_920),
        ("dq", 128, (64, 64, 8, 3), 100, 230_400),
    ):
        model = pk.shared_memory_bytes(role, cfg, 2 * d, d, e, arch)
        assert compiled <= model <= pk.SHARED_MEMORY_LIMITS[arch], (role, d, cfg, arch, model)
        assert cfg in [c for c, _ in _kept(role, 1024, 1024, d, torch.bfloat16, arch)], (role, d, cfg, arch)
    assert pk.mma_kind("fwd", (64, 64, 4, 2), 120) == "mma" and pk.mma_kind("dq", (64, 64, 8, 3), 100) == "tcgen05"
    assert pk.mma_kind("dkdv", (32, 64, 8, 3), 90) == "wgmma" and pk.mma_kind("fwd", (32, 64, 4, 2), 100) == "mma"


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="compile-only check for CPU machines")
def test_shared_memory_model_bounds_every_compiled_candidate():
    """Every autotune candidate of its head-dim class, d in 16..128, sm_80 / 86 / 89 / 90 / 100 / 120, bf16, fp16
    and fp32 (tf32 and IEEE dots): compiled shared memory <= pope_kernel.shared_memory_bytes (about 1,500
    compiles)."""
    _check_model_bounds_compiled(
        [
            (role, d, cfg, arch, dtype, prec)
            for arch in pk.SHARED_MEMORY_LIMITS
            for dtype, prec in (("bf16", "tf32"), ("fp16", "tf32"), ("fp32", "tf32"), ("fp32", "ieee"))
            for d in pope.TRITON_HEAD_DIMS
            for role in ("fwd", "dkdv", "dq")
            for cfg in pk.CONFIGS[role][pk.head_class(2 * d, d)]
        ]
    )


# ---- compile-only checks (no GPU): the kernels build for sm_80 / sm_90 without spilling in their loops ----

COMPILE = """
import sys
sys.path.insert(0, {repo!r})
import bench_kernel as bk, pope_kernel as pk
for role, d, cfg, arch in {configs!r}:
    kernel = bk.compile_kernel(role, cfg, d, arch)
    ptx = kernel.asm["ptx"]
    assert "mma" in ptx, (role, arch)  # tensor cores
    want = dict(mma="mma.sync", wgmma="wgmma", tcgen05="tcgen05.mma")[pk.mma_kind(role, cfg, arch)]
    assert want in ptx, ("no " + want, role, d, cfg, arch)  # what shared_memory_bytes assumes
    # FP fusion under TRITON_DEFAULT_FP_FUSION=0 (Triton 3.10's default): set by the kernels' own options
    assert kernel.metadata.enable_fp_fusion and (role != "fwd" or "fma.rn.f32" in ptx), ("no FP fusion", role, d)
    regs, st, ld, loop_ops = bk.spill_stats(kernel, arch)
    print(role, d, cfg, arch, regs, st, ld, loop_ops, flush=True)
    assert loop_ops == 0, ("local memory in a loop", role, d, cfg, arch, loop_ops)
print("ok")
"""


def _compile_check(configs):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "0"  # the default from Triton 3.10 on; the kernels must not depend on it
    res = subprocess.run(
        [sys.executable, "-c", COMPILE.format(repo=str(REPO), configs=configs)],
        capture_output=True,
        text=True,
        timeout=3600,
        env=env,
    )
    if res.returncode != 0 and ("ptxas" in res.stderr and "not found" in res.stderr.lower()):
        pytest.skip("no ptxas in this triton install")
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]


@pytest.mark.skipif(CUDA, reason="on CUDA the other tests compile and run the kernels")
def test_kernels_compile_for_sm90():
    """The interpreter compiles nothing: build the three kernels (training tile, d = 64) for sm_90 with the
    ptxas Triton picks for sm_90 (no GPU needed), so GPU-only compile errors show up on CPU machines too,
    and check that their loops use wgmma and no local memory, and that FP fusion is on although Triton's default
    says off. Runs in a subprocess without TRITON_INTERPRET."""
    _compile_check([(role, 64, pk.CONFIGS[role][64][0], 90) for role in ("fwd", "dkdv", "dq")])


MATMUL_BOUND = """
import sys
sys.path.insert(0, {repo!r})
import json
import bench_kernel as bk, pope_kernel as pk
cfg = pk.CONFIGS["dkdv"][128][0]
stats = bk.loop_body_stats(bk.compile_kernel("dkdv", cfg, 128, 90), 90)
flops = bk.block_flops("dkdv", 256, 128)
print(json.dumps(dict(stats, cycles=bk.block_cycles(stats, cfg, flops), floor=flops / 4096)))
"""


@pytest.mark.skipif(CUDA, reason="compile-only check for CPU machines")
def test_dkdv_loop_at_d128_is_bound_by_its_matmuls_on_sm90():
    """Under Triton 3.9 the dK/dV loop at d = 128 (training tile, sm_90) became instruction-bound: 4,000
    instructions per warp and 128 x 128 block, 8,000 cycles against its matmuls' 6,144 (docs/kernel.md). The
    cycle estimate of bench_kernel.py --sass must equal the matmul floor under the installed Triton."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-c", MATMUL_BOUND.format(repo=str(REPO))],
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
    )
    if res.returncode != 0 and ("ptxas" in res.stderr and "not found" in res.stderr.lower()):
        pytest.skip("no ptxas in this triton install")
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["cycles"] == got["floor"] == 6144 and got["loop_local_ops"] == 0, got


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="compile-only check for CPU machines")
def test_every_autotune_config_compiles_for_sm80_and_sm90_without_loop_spills():
    """Every autotune candidate, both head-dim classes, sm_80 and sm_90: the claim in the comment above
    pope_kernel.CONFIGS. `python bench_kernel.py --spills` prints the table, sm_100 and sm_120 too, where two
    candidates have local memory in a loop (docs/kernel.md)."""
    _compile_check(
        [
            (role, d, cfg, arch)
            for role in ("fwd", "dkdv", "dq")
            for d in (64, 128)
            for cfg in pk.CONFIGS[role][d]
            for arch in (80, 90)
        ]
    )


@pytest.mark.slow
def test_row_offsets_past_2_pow_31_elements():
    """The model's (B, T, 3C) layout puts value row s at s * 3C elements: past 2^31 at T * 3C >= 2^31. Rows
    here are 2^24 - 64 elements apart (the largest stride class the kernel accepts), so rows >= 129 lie past
    2^31: int32 row offsets (a key tile's start times the row stride) would wrap and read the wrong rows.
    The 10 GB buffer is allocated but only 300 rows of it are touched."""
    if CUDA:
        pytest.skip("interpreter version; on CUDA the same views run the compiled kernels")
    T, d, stride = 300, 16, 2**24 - 64
    base = torch.empty(T * stride, dtype=torch.float16)
    g = torch.Generator().manual_seed(9)
    views = [base.as_strided((1, 1, T, d), (0, 0, stride, 1), storage_offset=i * d) for i in range(3)]
    for t in views:
        t.copy_(torch.randn(1, 1, T, d, generator=g).half())
    q, k, v = (t[:, :, -20:] if i == 0 else t for i, t in enumerate(views))  # 20 queries at the end
    delta = -2 * torch.pi * torch.rand(1, d, generator=g)
    out = pope.pope_attention(q, k, v, delta, backend="triton", q_offset=T - 20)
    ref = pope.pope_attention_reference(q.double(), k.double(), v.double(), delta, q_offset=T - 20)
    assert (out.double() - ref).abs().max().item() < 2e-3
    # the backward kernels read the same value rows (the dK/dV kernel from its key tile's start): the kernel on
    # the strided v and on a contiguous copy of it must give the same gradients
    qc, kc = (torch.randn(1, 1, n, 2 * d, generator=g).half() for n in (20, T))
    grads = []
    for vv in (v, v.contiguous()):
        o, lse = pk.attention_forward(qc, kc, vv, True, T - 20)
        grads.append(pk.attention_backward(torch.ones_like(o), qc, kc, vv, o, lse, True, T - 20))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
