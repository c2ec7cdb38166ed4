"""The Triton backend's edges seen from outside: the custom ops' fake kernels give the real outputs' shapes
when dv != d, H_kv < H and Tk != Tq; the shared-memory check asks about the compute dtype (autocast's
under autocast) at the widths the kernel will see (2d for PoPE's q~, k~; the given width at
pope_kernel.attention). CUDA is mocked (tests/test_pope_triton.py's _mock_gpu); kernels run in the interpreter."""

import pytest
import torch
from test_pope_triton import _mock_gpu
from torch._subclasses.fake_tensor import FakeTensorMode

import pope
import pope_kernel as pk

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
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the real kernels' device (CPU: the interpreter)
    q, k, v = (t.to(dev) for t in _raw(*shape)[:3])
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
    return max(
        min(pk.shared_memory_bytes(role, c, D_QK, D_V, elem, arch) for c in pk.CONFIGS[role][pk.head_class(D_QK, D_V)])
        for role in ("fwd", "dkdv", "dq")
    )


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
    monkeypatch.setattr(
        pk,
        "device_unsupported_reason",
        lambda device, dtype, D_QK, D_V: asked.append((dtype, D_QK, D_V)) or real(device, dtype, D_QK, D_V),
    )
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
    assert (
        pope.pope_backend(q.to(f), k.to(f), v.to(h)) == "triton"
        and pope.pope_backend(q.to(h), k.to(h), v.to(f)) == "torch"
    )


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
        kept[dtype] = pk.prune_configs("fwd")(
            configs, {"Q": Q, "TQ_BUCKET": 1024, "TK_BUCKET": 1024, "D_QK": 128, "D_V": 64}
        )
        need = [pk.shared_memory_bytes("fwd", key(c), 128, 64, Q.element_size(), 86) for c in kept[dtype]]
        assert kept[dtype] and max(need) <= pk.SHARED_MEMORY_LIMITS[86], (dtype, need)
    assert {key(c) for c in kept[torch.float16]} != {key(c) for c in kept[torch.float32]}
    c = pk.tile_config(64, 64, 4, 2)
    exact = pk.shared_memory_bytes("fwd", key(c), 128, 64, 4, 86)
    assert pk.select_configs("fwd", [c], 64, 64, 128, 64, 4, 86, limit=exact) == [c]
    assert pk.select_configs("fwd", [c], 64, 64, 128, 64, 4, 86, limit=exact - 1) == []


def test_shared_memory_model_worked_by_hand_term_by_term():
    """pope_kernel.shared_memory_bytes against byte counts worked by hand from its documented model, PoPE at d = 64
    (q~, k~ 128 wide, v 64: a row of q~ and dO, or of k~ and v, is 192 elements), one term per tile it names."""
    row2, row4 = 192 * 2, 192 * 4  # bytes of a row in 16 bits and in fp32
    cases = [
        # dK/dV, mma.sync (sm_80), bf16, (32, 64, 4, 3): num_stages - 1 = 2 buffers of 32 query rows with their lse and
        # Di (4 + 4 bytes each); the key tile's k~, v once; one 16-bit score tile; 1 KB
        (("dkdv", (32, 64, 4, 3), 2, 80), 2 * 32 * (row2 + 8) + 64 * row2 + 32 * 64 * 2 + 1024),
        # the same in fp32: two fp32 score tiles (S^T and dS^T) and 16 bytes of row-reduction scratch per query row
        (("dkdv", (32, 64, 4, 3), 4, 80), 2 * 32 * (row4 + 8) + 64 * row4 + 2 * 32 * 64 * 4 + 16 * 32 + 1024),
        # dK/dV with tcgen05 (sm_100, 128 keys): num_stages + 1 = 4 buffers; 2 KB
        (("dkdv", (32, 128, 8, 3), 2, 100), 4 * 32 * (row2 + 8) + 128 * row2 + 32 * 128 * 2 + 2048),
        # ... and with wgmma (sm_90): num_stages = 3 buffers; 1 KB
        (("dkdv", (32, 128, 8, 3), 2, 90), 3 * 32 * (row2 + 8) + 128 * row2 + 32 * 128 * 2 + 1024),
        # dQ, fp32, sm_80, (64, 64, 4, 3): 2 buffers of 64 key rows (k~, v); q~ and dO resident; two score tiles and
        # the scratch; V^T for dO V^T; 1 KB
        (("dq", (64, 64, 4, 3), 4, 80), 2 * 64 * row4 + 64 * row4 + 2 * 64 * 64 * 4 + 16 * 64 + 64 * 64 * 4 + 1024),
        # dQ with tcgen05 (sm_100), bf16, (64, 64, 8, 3): 3 buffers; q~, dO; no score tile (dS in tensor memory); a
        # second copy of the k~ tile; 2 KB
        (("dq", (64, 64, 8, 3), 2, 100), 3 * 64 * row2 + 64 * row2 + 64 * 128 * 2 + 2048),
        # forward, fp32, sm_80, (64, 64, 4, 3): 2 buffers; q~ only; one score tile and the scratch; 1 KB
        (("fwd", (64, 64, 4, 3), 4, 80), 2 * 64 * row4 + 64 * 128 * 4 + 64 * 64 * 4 + 16 * 64 + 1024),
        # forward, bf16, 128 rows (sm_90 wgmma): scores in registers
        (("fwd", (128, 64, 8, 3), 2, 90), 3 * 64 * row2 + 128 * 128 * 2 + 1024),
    ]
    for (role, cfg, e, arch), want in cases:
        assert pk.shared_memory_bytes(role, cfg, 128, 64, e, arch) == want, (role, cfg, e, arch)


def _keys(configs):
    return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in configs]


@pytest.mark.parametrize("T, training_tiles_only", [(512, True), (300, True), (1024, True), (256, False)])
def test_a_training_step_of_512_tokens_or_more_autotunes_no_decoding_tiles(T, training_tiles_only):
    """From Tq = 512 on (the query bucket pow2_bucket(Tq) >= 512: 300 -> 512) the forward and dQ keep no 16/32-row
    decoding tile, only the >= 64-row ones, in CONFIGS' order; below (256) every tile that fits the problem is
    kept, decoding tiles included. dK/dV (rows = keys) keeps all of its tiles either way. No shared-memory limit."""
    assert [pk.pow2_bucket(t) for t in (1, 2, 257, 300, 511, 512, 513)] == [1, 2, 512, 512, 512, 512, 1024]
    b = pk.pow2_bucket(T)
    for d in (16, 64, 128):
        cls = pk.head_class(2 * d, d)
        for role in ("fwd", "dq", "dkdv"):
            cands = [pk.tile_config(*c) for c in pk.CONFIGS[role][cls]]
            kept = _keys(pk.select_configs(role, cands, b, b, 2 * d, d))
            fits = [c for c in pk.CONFIGS[role][cls] if c[0] <= b and c[1] <= b]
            want = [c for c in fits if c[0] >= 64] if training_tiles_only and role != "dkdv" else fits
            assert kept == want and any(c[0] < 64 for c in fits), (T, d, role, kept)


def test_the_prune_sizes_tiles_by_the_query_bucket_for_rows_and_the_key_bucket_for_columns(monkeypatch):
    """prune_configs reads the launch's TQ_BUCKET as the queries (BLOCK_M) and TK_BUCKET as the keys (BLOCK_N): a
    16-query chunk over 1,024 keys keeps the 16-row tiles with long key tiles; 1,024 queries over 32 keys keep the
    128-row tile with 32 keys; swapped, each would keep the other's. Hand-worked from the d = 64 candidates, on a
    mocked sm_90 (every candidate fits its 232,448 bytes in bf16)."""
    _mock_gpu(monkeypatch, 90)
    Q = torch.empty(1, 1, 1, 128, dtype=torch.bfloat16)
    configs = [pk.tile_config(*c) for c in pk.CONFIGS["fwd"][64]]
    prune = pk.prune_configs("fwd")
    for tq, tk, want in (
        (16, 1024, [(16, 64, 4, 2), (16, 128, 4, 2)]),
        (1024, 32, [(128, 32, 4, 3)]),
        (32, 1024, [(16, 64, 4, 2), (32, 64, 4, 2), (16, 128, 4, 2)]),
    ):
        got = _keys(prune(configs, {"Q": Q, "TQ_BUCKET": tq, "TK_BUCKET": tk, "D_QK": 128, "D_V": 64}))
        assert got == want, (tq, tk, got)
        assert _keys(pk.select_configs("fwd", configs, tq, tk, 128, 64, 2, 90, 232_448)) == want
