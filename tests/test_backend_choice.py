"""The Triton backend's edges seen from outside: the custom ops' fake kernels give the real outputs' shapes
when dv != d, H_kv < H and Tk != Tq; the shared-memory check asks about the compute dtype (autocast's
under autocast) at the widths the kernel will see (2d for PoPE's q~, k~; the given width at
pope_kernel.attention). CUDA is mocked (tests/test_pope_triton.py's _mock_gpu); kernels run in the interpreter."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import pope
import pope_kernel as pk
from test_pope_triton import _mock_gpu

pytest.importorskip("triton")

# (B, H, H_kv, Tq, Tk, d, dv): grouped heads, fewer queries than keys (a chunk after a cache), dv != d
SHAPES = [(1, 4, 2, 3, 5, 16, 32), (2, 2, 1, 6, 2, 32, 16)]


def _raw(B, H, H_kv, Tq, Tk, d, dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Tq, d, generator=g)
    k = torch.randn(B, H_kv, Tk, d, generator=g)
    v = torch.randn(B, H_kv, Tk, dv, generator=g)
    delta = -torch.rand(H_kv, d, generator=g)
    return q, k, v, delta


def _meta(ts):
    return [(tuple(t.shape), t.dtype) for t in ts]


def _fake_equals_real(op, args):
    real = op(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    assert _meta(fake) == _meta(real), (op, _meta(fake), _meta(real))
    return real


@pytest.mark.parametrize("shape", SHAPES)
def test_fake_kernels_give_the_real_shapes_for_grouped_heads_a_short_query_and_dv_not_d(shape):
    B, H, H_kv, Tq, Tk, d, dv = shape
    q, k, v, _ = _raw(*shape)
    q_offset = max(Tk - Tq, 0)
    # pope_kernel's ops on the Cartesian operands (width 2d for q~, k~)
    qc, kc = torch.cat((q, q), -1), torch.cat((k, k), -1)
    o, lse = _fake_equals_real(pk.attention_forward, (qc, kc, v, True, q_offset))
    assert o.shape == (B, H, Tq, dv) and lse.shape == (B, H, Tq)
    grads = _fake_equals_real(pk.attention_backward, (torch.randn_like(o), qc, kc, v, o, lse, True, q_offset))
    assert _meta(grads) == _meta((qc, kc, v))


def _need(D_QK, D_V, dtype, arch=86):
    """The fewest bytes of shared memory per block with which every kernel keeps a candidate (the kernel's model)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return max(min(pk.shared_memory_bytes(role, c, D_QK, D_V, elem, arch)
                   for c in pk.CONFIGS[role][pk._head_class(D_QK, D_V)]) for role in ("fwd", "dkdv", "dq"))


@pytest.mark.parametrize("d, dv", [(64, 64), (128, 32), (32, 128)])
def test_the_backend_checks_shared_memory_at_the_cartesian_width_2d_and_dv(monkeypatch, d, dv):
    # a part with exactly the shared memory the kernels need at (2d, dv) in bf16 takes them; one byte less refuses
    q, k, v = (torch.randn(1, 2, 4, w, dtype=torch.bfloat16) for w in (d, d, dv))
    need = _need(2 * d, dv, torch.bfloat16)
    assert need > _need(d, dv, torch.bfloat16) and need < _need(4 * d, dv, torch.bfloat16)  # the width matters
    _mock_gpu(monkeypatch, 86, limit=need)
    assert pope.pope_backend(q, k, v) == "triton"
    _mock_gpu(monkeypatch, 86, limit=need - 1)
    assert pope.pope_backend(q, k, v) == "torch"
    with pytest.raises(ValueError, match=f"shared memory .* at widths {2 * d}/{dv}"):
        pope.pope_attention(q, k, v, backend="triton")


def test_the_kernels_entry_point_checks_the_widths_it_is_given(monkeypatch):
    launched = []
    monkeypatch.setattr(pk, "attention_forward", lambda q, k, v, causal, q_offset: launched.append(q.shape) or (0, 0))
    q, k = (torch.randn(1, 2, 4, 128, dtype=torch.float16) for _ in range(2))
    v = torch.randn(1, 2, 4, 64, dtype=torch.float16)
    need = _need(128, 64, torch.float16)
    _mock_gpu(monkeypatch, 86, limit=need - 1)
    with pytest.raises(ValueError, match="at widths 128/64"):
        pk.attention(q, k, v)
    _mock_gpu(monkeypatch, 86, limit=need)
    pk.attention(q, k, v)
    assert launched == [q.shape]


def test_the_shared_memory_check_assumes_the_autocast_dtype(monkeypatch):
    # fp32 tensors at d = 128 under bf16 autocast: the kernels run in bf16, which fits an sm_86 part; fp32 would not
    q, k, v = (torch.randn(1, 2, 4, 128) for _ in range(3))
    asked = []
    real = pk.device_unsupported_reason
    monkeypatch.setattr(pk, "device_unsupported_reason",
                        lambda device, dtype, D_QK, D_V: asked.append((dtype, D_QK, D_V)) or real(device, dtype, D_QK, D_V))
    _mock_gpu(monkeypatch, 86)
    assert _need(256, 128, torch.bfloat16) <= pk.SHARED_MEMORY_LIMITS[86] < _need(256, 128, torch.float32)
    with pytest.raises(ValueError, match="shared memory"):
        pope.pope_attention(q, k, v, backend="triton")  # plain fp32: refused up front
    assert asked == [(torch.float32, 256, 128)]
    ran = []
    monkeypatch.setattr(pk, "attention_forward", lambda qc, kc, v, *rest: ran.append((qc.dtype, v.dtype)) or (v, None))
    for dtype in (torch.bfloat16, torch.float16):
        asked.clear()
        with torch.autocast("cpu", dtype=dtype):
            assert pope.pope_backend(q, k, v) == "triton"
            pope.pope_attention(q, k, v, backend="triton")
        assert asked == [(dtype, 256, 128)] * 2 and ran[-1] == (dtype, dtype)


def test_outside_autocast_attention_runs_in_vs_dtype(monkeypatch):
    """The documented compute dtype: v's (not q's) outside autocast, for the result and for the backend choice."""
    q, k, v, delta = _raw(1, 2, 1, 3, 5, 16, 16)
    for qk, vd in ((torch.float32, torch.float64), (torch.float64, torch.float32)):
        out = pope.pope_attention(q.to(qk), k.to(qk), v.to(vd), delta, q_offset=2, backend="torch")
        ref = pope.pope_attention_reference(q, k, v, delta, q_offset=2)
        assert out.dtype == vd and torch.allclose(out.double(), ref, atol=1e-5)
    _mock_gpu(monkeypatch, 90)
    h, f = torch.float16, torch.float32
    assert pope.pope_backend(q.to(f), k.to(f), v.to(h)) == "triton" and pope.pope_backend(q.to(h), k.to(h), v.to(f)) == "torch"


def test_the_autotuners_prune_keeps_tiles_that_fit_at_the_operands_element_size(monkeypatch):
    # sm_86 (101,376 bytes), d = 64 (q~ width 128, dv 64), training length: fp16 keeps 128-row forward tiles that
    # fp32 cannot hold; the prune sizes each candidate at Q's element size, and a candidate needing exactly the
    # limit fits
    _mock_gpu(monkeypatch, 86)
    configs = pk.gpu_configs("fwd")
    key = lambda c: (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)  # noqa: E731
    kept = {}
    for dtype in (torch.float16, torch.float32):
        Q = torch.empty(1, 1, 1024, 128, dtype=dtype)
        kept[dtype] = pk._prune("fwd")(configs, {"Q": Q, "TQ_BUCKET": 1024, "TK_BUCKET": 1024, "D_QK": 128, "D_V": 64})
        need = [pk.shared_memory_bytes("fwd", key(c), 128, 64, Q.element_size(), 86) for c in kept[dtype]]
        assert kept[dtype] and max(need) <= pk.SHARED_MEMORY_LIMITS[86], (dtype, need)
    assert {key(c) for c in kept[torch.float16]} != {key(c) for c in kept[torch.float32]}
    c = pk._config(64, 64, 4, 2)
    exact = pk.shared_memory_bytes("fwd", key(c), 128, 64, 4, 86)
    assert pk.select_configs("fwd", [c], 64, 64, 128, 64, 4, 86, limit=exact) == [c]
    assert pk.select_configs("fwd", [c], 64, 64, 128, 64, 4, 86, limit=exact - 1) == []
