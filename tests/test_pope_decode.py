"""PoPE decoding over a cache of key magnitudes: pope_kernel.decode (flash-decoding, rotation in registers) and
pope.pope_attention_decode's Triton backend, against the float64 reference and the full forward.

Without CUDA the kernel runs in the Triton interpreter (tests/conftest.py), with 16-key tiles
(pope_kernel.DECODE_BLOCK_N), so a cache of 150 keys has 10 tiles to split. The cache is what the model
passes: (B, H_kv, max_len, d) buffers sliced to the first Tk positions, queries at the cache's end.
"""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import pope

pk = pytest.importorskip("pope_kernel")
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 2e-2}
MAX_LEN = 160  # cache buffers are longer than the keys in them: mu and v are strided slices


def _cache(B, H, H_kv, Tq, Tk, d=16, dv=16, seed=0, gain=2.5, with_delta=True):
    """Raw q (B, H, Tq, d), raw k, v as slices (B, H_kv, Tk, .) of (B, H_kv, MAX_LEN, .) buffers, delta or None.
    gain scales q and k: peaked attention, so a key read from the wrong head, position or split shows."""
    g = torch.Generator().manual_seed(seed)
    q = gain * torch.randn(B, H, Tq, d, generator=g)
    k_buf = torch.zeros(B, H_kv, MAX_LEN, d)
    v_buf = torch.zeros(B, H_kv, MAX_LEN, dv)
    k_buf[:, :, :Tk] = gain * torch.randn(B, H_kv, Tk, d, generator=g)
    v_buf[:, :, :Tk] = torch.randn(B, H_kv, Tk, dv, generator=g)
    delta = -2 * math.pi * torch.rand(H_kv, d, generator=g) if with_delta else None
    k, v = k_buf[:, :, :Tk], v_buf[:, :, :Tk]
    return q.to(DEV), k.to(DEV), v.to(DEV), None if delta is None else delta.to(DEV)


# (name, B, H, H_kv, Tq, Tk, n_split, dtype, magnitude, with_delta)
CASES = [
    ("one_token_one_split_gqa3", 2, 6, 2, 1, 150, 1, torch.float32, "softplus", True),
    ("one_token_ragged_last_split", 1, 4, 2, 1, 150, 4, torch.float32, "softplus", True),  # 10 tiles: 3, 3, 3, 1
    ("one_token_empty_splits", 1, 4, 1, 1, 150, 7, torch.float32, "relu", True),  # 2 tiles each: splits 5, 6 empty
    ("one_split_per_tile", 1, 2, 2, 1, 150, 10, torch.float32, "identity", False),
    ("chunk_of_3_many_splits", 2, 4, 2, 3, 100, 5, torch.float32, "softplus", True),  # a split past some rows
    ("heuristic_splits_fp16", 1, 4, 2, 1, 150, 0, torch.float16, "softplus", True),
    ("fp16_no_delta_relu", 1, 2, 1, 2, 37, 3, torch.float16, "relu", False),
    ("shorter_than_a_tile", 1, 2, 2, 1, 5, 1, torch.float32, "softplus", True),
]


@pytest.mark.parametrize("name, B, H, H_kv, Tq, Tk, n_split, dtype, magnitude, with_delta", CASES,
                         ids=[c[0] for c in CASES])
def test_decode_kernel_equals_float64_reference_and_full_forward(name, B, H, H_kv, Tq, Tk, n_split, dtype, magnitude,
                                                                 with_delta):
    """pope_attention_decode(backend='triton') with the queries at the cache's end (q_offset = Tk - Tq) equals the
    float64 reference and the full forward on the raw keys, for a split count of 1, many, one per tile, ragged
    and empty splits, a chunk whose rows see different splits, grouped heads, every magnitude, no delta, fp16."""
    q, k, v, delta = _cache(B, H, H_kv, Tq, Tk, with_delta=with_delta)
    kw = dict(q_offset=Tk - Tq, magnitude=magnitude)
    ref = pope.pope_attention_reference(q, k, v, delta, **kw)
    mu_buf = torch.zeros(B, H_kv, MAX_LEN, 16, device=DEV, dtype=dtype)
    mu_buf[:, :, :Tk] = pope.pope_key_magnitude(k, magnitude, dtype)
    rot = pope.pope_rotation_table(Tk if name == "shorter_than_a_tile" else MAX_LEN, 16, device=DEV)
    got = pope.pope_attention_decode(q.to(dtype), mu_buf[:, :, :Tk], v.to(dtype), delta, rotation=rot,
                                     backend="triton", n_split=n_split, **kw)
    assert got.dtype == dtype and got.is_contiguous()
    err = (got.double() - ref).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, ref.abs().max().item()), (name, err)
    full = pope.pope_attention(q, k, v, delta, backend="torch", **kw)
    assert (got.float() - full).abs().max().item() <= TOL[dtype] * max(1.0, ref.abs().max().item())
    uniform = v.double().mean(2, keepdim=True).repeat_interleave(H // H_kv, 1)  # what uniform attention gives
    assert (ref - uniform).abs().max() > 0.3  # peaked: a wrong key position, head or split shows


def test_decode_logsumexp_is_the_merged_one():
    """The kernel's lse (nats) after the log-sum-exp merge of 4 splits (one ragged) equals logsumexp of the float64
    logits, and o does not depend on the split count."""
    B, H, H_kv, Tq, Tk = 1, 4, 2, 2, 150
    q, k, v, delta = _cache(B, H, H_kv, Tq, Tk, seed=3)
    scale = 1 / math.sqrt(16)
    qd = pope.pope_query_decode_form(q, Tk - Tq, delta, scale=scale * pope.LOG2E)
    mu = pope.pope_key_magnitude(k)
    rot = pope.pope_rotation_table(Tk, 16, device=DEV)
    outs = [pk.decode(qd, mu, v, rot, q_offset=Tk - Tq, n_split=n) for n in (1, 4)]
    freqs = pope.pope_frequencies(16, device=DEV)
    kc = pope.polar_to_cartesian(k.double(), torch.arange(Tk, device=DEV), freqs, delta, dtype=torch.float64)
    qc = pope.polar_to_cartesian(q.double(), torch.arange(Tk - Tq, Tk, device=DEV), freqs, dtype=torch.float64)
    logits = scale * qc @ kc.repeat_interleave(2, 1).transpose(-1, -2)
    logits = logits.masked_fill(~pope.causal_mask(Tq, Tk, Tk - Tq, device=DEV), float("-inf"))
    for o, lse in outs:
        torch.testing.assert_close(lse.double(), torch.logsumexp(logits, -1), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=1e-5)


class _Shapes(TorchDispatchMode):
    def __enter__(self):
        self.shapes = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else (out,))
                        if isinstance(t, torch.Tensor)]
        return out


def test_decode_makes_no_copies_of_keys_or_values():
    """Grouped heads read their key/value head's tiles in the kernel: no op of a decoding step makes a tensor
    holding the cached keys or values repeated over the query heads, or rotated keys (Tk x 2d)."""
    q, k, v, delta = _cache(1, 8, 2, 1, 150)
    mu = pope.pope_key_magnitude(k)
    rot = pope.pope_rotation_table(MAX_LEN, 16, device=DEV)
    with _Shapes() as seen:
        pope.pope_attention_decode(q, mu, v, delta, rotation=rot, backend="triton", q_offset=149, n_split=3)
    big = [s for s in seen.shapes if len(s) == 4 and s[2] == 150]
    assert not big, big


def test_decode_opcheck_on_the_layouts_decoding_passes():
    """torch.library.opcheck of pope::decode (schema, fake kernel against the real one, AOT dispatch) on cache
    slices, grouped heads, q_offset at the cache's end, fp32 and fp16, queries formed with and without delta,
    each magnitude, one and several splits; both outputs are contiguous from the real and the fake kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    for dtype, magnitude, with_delta, Tq, n_split in ((torch.float32, "softplus", True, 1, 1),
                                                      (torch.float16, "relu", False, 1, 3),
                                                      (torch.float32, "identity", True, 2, 0)):
        q, k, v, delta = _cache(1, 4, 2, Tq, 70, with_delta=with_delta)
        mu_buf = torch.zeros(1, 2, MAX_LEN, 16, device=DEV, dtype=dtype)
        mu_buf[:, :, :70] = pope.pope_key_magnitude(k, magnitude, dtype)
        v_buf = torch.zeros(1, 2, MAX_LEN, 16, device=DEV, dtype=dtype)
        v_buf[:, :, :70] = v
        mu, vv = mu_buf[:, :, :70], v_buf[:, :, :70]
        assert not mu.is_contiguous() and not vv.is_contiguous()
        qd = pope.pope_query_decode_form(q, 70 - Tq, delta, magnitude=magnitude, dtype=dtype, scale=0.36)
        rot = pope.pope_rotation_table(MAX_LEN, 16, device=DEV)
        args = (qd, mu, vv, rot, True, 70 - Tq, n_split)
        torch.library.opcheck(pk.decode_forward, args)
        o, lse = pk.decode_forward(*args)
        with FakeTensorMode() as mode:
            fo, flse = pk.decode_forward(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
        for real, fake in ((o, fo), (lse, flse)):
            assert real.is_contiguous() and fake.is_contiguous()
            assert (real.shape, real.stride(), real.dtype) == (fake.shape, fake.stride(), fake.dtype)


@pytest.mark.slow
def test_compiled_decode_step_equals_eager(tmp_path, monkeypatch):
    """A decoding step (query transform, pope::decode, and the cache append before it) under the default
    torch.compile (Inductor, a fresh cache dir) equals eager, at two successive positions. Slow (Inductor
    builds its C++ kernels) and outside the default suite: no default path compiles the decode step
    (sample.py and generate run it eagerly; bench.py --only=decode compiles it to time it), and opcheck
    above already checks pope::decode's fake kernel against the real one."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    q, k, v, delta = _cache(1, 4, 2, 1, 60)
    mu_buf = torch.zeros(1, 2, MAX_LEN, 16, device=DEV)
    v_buf = torch.zeros(1, 2, MAX_LEN, 16, device=DEV)
    rot = pope.pope_rotation_table(MAX_LEN, 16, device=DEV)

    def step(q, k_new, v_new, mu_buf, v_buf, t):
        mu_buf[:, :, t:t + 1] = pope.pope_key_magnitude(k_new)
        v_buf[:, :, t:t + 1] = v_new
        return pope.pope_attention_decode(q, mu_buf[:, :, :t + 1], v_buf[:, :, :t + 1], delta, rotation=rot,
                                          backend="triton", q_offset=t)

    torch._dynamo.reset()
    compiled = torch.compile(step)
    for t in (59,):
        mu_buf[:, :, :t], v_buf[:, :, :t] = pope.pope_key_magnitude(k[:, :, :t]), v[:, :, :t]
        eager_bufs = (mu_buf.clone(), v_buf.clone())
        want = step(q, k[:, :, t:t + 1], v[:, :, t:t + 1], *eager_bufs, t)
        got = compiled(q, k[:, :, t:t + 1], v[:, :, t:t + 1], mu_buf, v_buf, t)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(mu_buf, eager_bufs[0])
        ref = pope.pope_attention_reference(q, k[:, :, :t + 1], v[:, :, :t + 1], delta, q_offset=t)
        assert (got.double() - ref).abs().max().item() < 1e-4


def test_split_heuristic():
    """decode_splits: one split when B * H_kv fills the GPU or the cache is short; else enough splits for two
    programs per multiprocessor, each at least DECODE_MIN_BLOCKS tiles, none empty."""
    assert pk.decode_splits(264, 131072, 132, 64) == (1, 2048)
    assert pk.decode_splits(1, 200, 132, 64) == (1, 4)
    for bh in (1, 3, 8, 64):
        for Tk in (4096, 5000, 131072):
            n, per = pk.decode_splits(bh, Tk, 132, 64)
            blocks = -(-Tk // 64)
            assert (n - 1) * per < blocks <= n * per  # every split has a tile; together they cover the cache
            assert n == 1 or per >= pk.DECODE_MIN_BLOCKS
            assert n * bh <= 2 * 132 + bh


def test_decode_refuses_what_it_does_not_take():
    q, k, v, delta = _cache(1, 4, 2, 1, 20)
    qd = pope.pope_query_decode_form(q, 19, delta)
    rot = pope.pope_rotation_table(20, 16, device=DEV)
    mu = pope.pope_key_magnitude(k)
    with pytest.raises(ValueError, match="rot"):
        pk.decode(qd, mu, v, rot[:10], q_offset=19)
    with pytest.raises(ValueError, match="query rows"):
        pk.decode(torch.cat([qd] * 40, 2), mu, v, rot, q_offset=0)
    with pytest.raises(ValueError, match="rotation"):
        pope.pope_attention_decode(q, mu, v, delta, rotation=rot[:10], backend="triton", q_offset=19)


# ---- compile-only (no GPU): the decode kernel builds for each part without spilling in its loop ----------

DECODE_COMPILE = """
import json, sys
sys.path.insert(0, {repo!r})
import bench_kernel as bk
for arch, d in {cases!r}:
    kernel = bk.compile_decode(arch, d)
    regs, st, ld, loop_ops = bk.spill_stats(kernel, arch)
    print(json.dumps(dict(arch=arch, d=d, shared=kernel.metadata.shared, regs=regs, loop_ops=loop_ops)), flush=True)
"""


def _decode_compile(cases):
    import json
    import os
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", DECODE_COMPILE.format(repo=repo, cases=cases)], capture_output=True,
                         text=True, timeout=1800, env=env)
    if res.returncode != 0 and "ptxas" in res.stderr and "not found" in res.stderr.lower():
        pytest.skip("no ptxas in this triton install")
    assert res.returncode == 0, res.stderr[-3000:]
    import bench_kernel as bk
    for row in map(json.loads, res.stdout.splitlines()):
        assert row["loop_ops"] == 0 and row["shared"] <= bk.DECODE_ARCH_LIMITS[row["arch"]], row


@pytest.mark.skipif(CUDA, reason="compile-only check for CPU machines")
def test_decode_kernel_compiles_for_sm90_at_d128_without_loop_spills():
    """The widest head (d = 128, bf16, 4 query heads per key/value head) for sm_90: local memory in the loop
    (4 warps spilled there) and shared memory within the part's limit."""
    _decode_compile([(90, 128)])


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="compile-only check for CPU machines")
def test_decode_kernel_compiles_for_every_part_without_loop_spills():
    """sm_80, 86, 89, 90, 100, 120 at d = 64 and 128: `python bench_kernel.py --decode-sass` prints the table."""
    import bench_kernel as bk
    _decode_compile([(arch, d) for arch in bk.DECODE_ARCH_LIMITS for d in (64, 128)])
