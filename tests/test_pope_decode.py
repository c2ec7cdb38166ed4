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


@pytest.mark.parametrize(
    "name, B, H, H_kv, Tq, Tk, n_split, dtype, magnitude, with_delta", CASES, ids=[c[0] for c in CASES]
)
def test_decode_kernel_equals_float64_reference_and_full_forward(
    name, B, H, H_kv, Tq, Tk, n_split, dtype, magnitude, with_delta
):
    """pope_attention_decode(backend='triton') with the queries at the cache's end (q_offset = Tk - Tq) equals the
    float64 reference and the full forward on the raw keys, for a split count of 1, many, one per tile, ragged
    and empty splits, a chunk whose rows see different splits, grouped heads, every magnitude, no delta, fp16."""
    q, k, v, delta = _cache(B, H, H_kv, Tq, Tk, with_delta=with_delta)
    kw = dict(q_offset=Tk - Tq, magnitude=magnitude)
    ref = pope.pope_attention_reference(q, k, v, delta, **kw)
    mu_buf = torch.zeros(B, H_kv, MAX_LEN, 16, device=DEV, dtype=dtype)
    mu_buf[:, :, :Tk] = pope.pope_key_magnitude(k, magnitude, dtype)
    rot = pope.pope_rotation_table(Tk if name == "shorter_than_a_tile" else MAX_LEN, 16, device=DEV)
    got = pope.pope_attention_decode(
        q.to(dtype), mu_buf[:, :, :Tk], v.to(dtype), delta, rotation=rot, backend="triton", n_split=n_split, **kw
    )
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
    for _o, lse in outs:
        torch.testing.assert_close(lse.double(), torch.logsumexp(logits, -1), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=1e-5)


class _Shapes(TorchDispatchMode):
    def __enter__(self):
        self.shapes = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [
            tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)
        ]
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

    for dtype, magnitude, with_delta, Tq, n_split in (
        (torch.float32, "softplus", True, 1, 1),
        (torch.float16, "relu", False, 1, 3),
        (torch.float32, "identity", True, 2, 0),
    ):
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
        mu_buf[:, :, t : t + 1] = pope.pope_key_magnitude(k_new)
        v_buf[:, :, t : t + 1] = v_new
        return pope.pope_attention_decode(
            q, mu_buf[:, :, : t + 1], v_buf[:, :, : t + 1], delta, rotation=rot, backend="triton", q_offset=t
        )

    torch._dynamo.reset()
    compiled = torch.compile(step)
    for t in (59,):
        mu_buf[:, :, :t], v_buf[:, :, :t] = pope.pope_key_magnitude(k[:, :, :t]), v[:, :, :t]
        eager_bufs = (mu_buf.clone(), v_buf.clone())
        want = step(q, k[:, :, t : t + 1], v[:, :, t : t + 1], *eager_bufs, t)
        got = compiled(q, k[:, :, t : t + 1], v[:, :, t : t + 1], mu_buf, v_buf, t)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(mu_buf, eager_bufs[0])
        ref = pope.pope_attention_reference(q, k[:, :, : t + 1], v[:, :, : t + 1], delta, q_offset=t)
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
    res = subprocess.run(
        [sys.executable, "-c", DECODE_COMPILE.format(repo=repo, cases=cases)],
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
    )
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


# ---- the decode path's edges: the torch step's shortcut, autocast, the merge, the table's end, the row limit ----


@pytest.mark.parametrize(
    "Tq, causal, q_offset, fast",
    [
        (1, True, 39, True),  # the token at the cache's end: it sees every key
        (1, True, 44, True),  # past the end (keys 40..44 not cached): still every key
        (1, False, 0, True),  # not causal: every key whatever its position
        (1, True, 38, False),  # one key after the token: masked, so SDPA with its causal mask
        (1, True, 5, False),
        (2, True, 38, False),  # two tokens
    ],
)
def test_the_torch_single_token_step_runs_exactly_where_the_token_sees_every_key(
    monkeypatch, Tq, causal, q_offset, fast
):
    """pope_attention_decode(backend='torch') takes its two-matmul step (no mask) for one token that sees every cached
    key (causal with q_offset >= Tk - 1, or not causal) and SDPA with the causal mask otherwise; both equal the
    float64 reference, and for the tokens that miss keys the missing keys matter (peaked attention)."""
    calls = []
    real = pope.sdpa_attention
    monkeypatch.setattr(pope, "sdpa_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    Tk = 40
    q, k, v, delta = _cache(1, 4, 2, Tq, Tk, seed=5, gain=3.0)
    v = v.clone()
    v[:, :, -2:] = 100.0  # the last keys' values: a token that attends to them (or not) shows
    rot = pope.pope_rotation_table(64, 16, device=DEV)
    got = pope.pope_attention_decode(
        q, pope.pope_key_magnitude(k), v, delta, rotation=rot, causal=causal, q_offset=q_offset, backend="torch"
    )
    ref = pope.pope_attention_reference(q, k, v, delta, causal=causal, q_offset=q_offset)
    assert (got.double() - ref).abs().max().item() < 1e-4
    assert (not calls) == fast, calls
    if not fast:  # what the two-matmul step would give (every key): far from the right answer
        every = pope.pope_attention_reference(q, k, v, delta, causal=False, q_offset=q_offset)
        assert (every - ref).abs().max() > 0.05


@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16])
def test_cached_magnitudes_are_in_the_autocast_dtype_rounded_from_float32(amp):
    """pope_key_magnitude: under autocast the cache's dtype is autocast's (whatever k's dtype), softplus computed in
    float32 and rounded once; an explicit dtype wins; outside autocast k's dtype. A PoPE GPT in fp32 under autocast
    caches keys and values in the autocast dtype, for the prefill, an eager step and the static step, and its
    cache_bytes is n_layer * B * H_kv * max_len * 2d * 2 bytes."""
    from model import KVCache

    k = 3 * torch.randn(1, 2, 7, 16, generator=torch.Generator().manual_seed(0))
    want = torch.nn.functional.softplus(k.double()).to(amp)
    with torch.autocast("cpu", dtype=amp):
        mu = pope.pope_key_magnitude(k)
        assert mu.dtype == amp and torch.equal(mu, want)
        assert pope.pope_key_magnitude(k, dtype=torch.float32).dtype == torch.float32
        assert pope.pope_key_magnitude(k.half(), "relu").dtype == amp
    assert pope.pope_key_magnitude(k).dtype == torch.float32 and pope.pope_key_magnitude(k.half()).dtype == torch.half
    from compiled import pope_gpt

    model = pope_gpt(n_head=4, n_kv_head=2, attn_backend="torch", n_layer=2).cpu()
    idx = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cpu", dtype=amp):
        cache = KVCache(2, 12)
        model.hidden_states(idx[:, :7], cache)
        model.hidden_states(idx[:, 7:8], cache)
        model.decode_step(idx[:, 8:9], cache, torch.tensor(8))
    assert {t.dtype for t in (*cache.k, *cache.v)} == {amp}
    assert cache.cache_bytes() == 2 * 2 * 2 * 12 * (2 * 16) * 2
    raw = model.transformer.h[0].attn.c_attn(model.transformer.h[0].ln_1(model.transformer.wte(idx)))
    k0 = raw.split((64, 32, 32), 2)[1].view(2, 9, 2, 16).transpose(1, 2)
    torch.testing.assert_close(
        cache.k[0][:, :, :9].float(), torch.nn.functional.softplus(k0.float()), atol=0.02, rtol=0.02
    )  # the magnitudes (rounded to 8 or 11 bits), not raw keys


def test_the_split_merge_is_exact_for_logits_hundreds_of_bits_apart():
    """decode's log-sum-exp merge of 4 splits against float64 when the splits' base-2 logsumexps lie hundreds apart
    (the largest in the last split for one head, in the first for another) and for a head whose logits are all near
    -300: a merge that scales by anything but the splits' running maximum overflows or underflows float32."""
    n = pk.DECODE_BLOCK_N
    Tk, D = 4 * n, 16
    j = torch.arange(Tk, dtype=torch.float64)
    mu = torch.zeros(1, 1, Tk, D, dtype=torch.float64)
    mu[..., 0] = torch.where(j < Tk // 2, -1.0, 1.0) * (1 + 0.01 * (j % n))  # split 0 low, split 3 high
    mu[..., 1] = -1 - 0.01 * (j % n)  # every key low
    q = torch.zeros(1, 3, 1, 2 * D, dtype=torch.float64)
    q[0, 0, 0, 0], q[0, 1, 0, 0], q[0, 2, 0, 1] = 300.0, -300.0, 300.0  # base-2 logits up to +-300
    rot = torch.cat((torch.ones(Tk, D), torch.zeros(Tk, D)), 1)  # theta = 0: the keys' x = mu, y = 0
    v = torch.randn(1, 1, Tk, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    logits = q[..., :D] @ mu.transpose(-1, -2)  # (1, 3, 1, Tk) base 2
    want_o = torch.softmax(logits * math.log(2), -1) @ v
    want_lse = torch.logsumexp(logits * math.log(2), -1)
    assert want_lse.max() > 200 and want_lse.min() < -200
    for n_split in (1, 4):
        o, lse = pk.decode(
            q.float().to(DEV), mu.float().to(DEV), v.float().to(DEV), rot.to(DEV), q_offset=Tk - 1, n_split=n_split
        )
        assert torch.isfinite(o).all() and torch.isfinite(lse).all(), n_split
        torch.testing.assert_close(o.double().cpu(), want_o, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lse.double().cpu(), want_lse, atol=1e-3, rtol=1e-6)


class _BoundsChecked:
    """Under the Triton interpreter: records the loads (element addresses with their mask on) that fall in
    [lo, hi) bytes; the interpreter reads raw host memory and checks no bounds itself."""

    def __init__(self, lo, hi):
        import triton.runtime.interpreter as interp

        self.interp, self.lo, self.hi, self.hits, self.loads = interp, lo, hi, [], 0

    def __enter__(self):
        real, outer = self.interp._interpreter, self

        class Proxy:
            def __getattr__(self, name):
                return getattr(real, name)

            def load(self, ptrs, mask, other, dtype):
                addr = ptrs[mask.astype(bool)] if ptrs.shape else ptrs.reshape(1)
                bad = addr[(addr >= outer.lo) & (addr < outer.hi)]
                outer.loads += 1
                outer.hits += bad.tolist()
                return real.load(ptrs, mask, other, dtype)

        self.real = real
        self.interp._interpreter = Proxy()
        return self

    def __exit__(self, *exc):
        self.interp._interpreter = self.real


@pytest.mark.skipif(CUDA, reason="checks the interpreter's loads")
@pytest.mark.parametrize("Tk", [1, 5, 15])
def test_decode_reads_no_rotation_row_past_a_table_shorter_than_a_tile(Tk):
    """A cache (and its rotation table) of fewer keys than a tile (DECODE_BLOCK_N): the kernel reads the table's
    first BLOCK_N rows for e^{i j theta} only where j < Tk. The table is the first Tk rows of a longer buffer
    filled with NaN: no load touches the rows after it, and the result equals the float64 reference."""
    assert Tk < pk.DECODE_BLOCK_N
    q, k, v, delta = _cache(1, 4, 2, 1, Tk, seed=2)
    buf = torch.full((pk.DECODE_BLOCK_N + 8, 32), float("nan"))
    buf[:Tk] = pope.pope_rotation_table(Tk, 16)
    rot = buf[:Tk]
    start = rot.data_ptr() + rot.numel() * rot.element_size()
    with _BoundsChecked(start, buf.data_ptr() + buf.numel() * buf.element_size()) as seen:
        got = pope.pope_attention_decode(
            q, pope.pope_key_magnitude(k), v, delta, rotation=rot, q_offset=Tk - 1, backend="triton"
        )
    assert seen.loads > 0, "the checker saw no load: Triton's interpreter no longer loads through _interpreter"
    assert not seen.hits, f"{len(seen.hits)} loads past the table's {Tk} rows"
    ref = pope.pope_attention_reference(q, k, v, delta, q_offset=Tk - 1)
    assert (got.double() - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "G, Tq, kernel", [(16, 4, "decode"), (64, 1, "decode"), (13, 5, "attention"), (65, 1, "attention")]
)
def test_decode_max_rows_is_where_the_decode_kernel_stops(monkeypatch, G, Tq, kernel):
    """G * Tq = DECODE_MAX_ROWS (64) query rows per key/value head run pope_kernel.decode (one 64-row tile), 65 run
    the prefill kernel on rotated keys; both equal the float64 reference. pope_kernel.decode takes 64 rows and
    refuses 65; the static step (decode_step_backend) takes the kernel for G <= 64 and the torch step above."""
    assert pk.DECODE_MAX_ROWS == 64
    ran = []
    for name in ("decode", "attention"):
        real = getattr(pk, name)
        monkeypatch.setattr(pk, name, lambda *a, _r=real, _n=name, **kw: ran.append(_n) or _r(*a, **kw))
    Tk = 20
    q, k, v, delta = _cache(1, G, 1, Tq, Tk, seed=4, gain=2.0)
    got = pope.pope_attention_decode(q, pope.pope_key_magnitude(k), v, delta, q_offset=Tk - Tq, backend="triton")
    assert ran == [kernel]
    ref = pope.pope_attention_reference(q, k, v, delta, q_offset=Tk - Tq)
    assert (got.double() - ref).abs().max().item() < 1e-4
    qd = torch.zeros(1, G, Tq, 32, device=DEV)
    mu, rot = pope.pope_key_magnitude(k), pope.pope_rotation_table(Tk, 16, device=DEV)
    if kernel == "decode":
        o, _ = pk.decode(qd, mu, v, rot, q_offset=Tk - Tq)
        assert o.shape == (1, G, Tq, 16)
    else:
        with pytest.raises(ValueError, match="query rows"):
            pk.decode(qd, mu, v, rot, q_offset=Tk - Tq)
    if Tq == 1:  # the static step: the group G = H / H_kv counts, here and with two key/value heads
        assert pope.decode_step_backend(q, mu, v, "triton") == ("triton" if G <= 64 else "torch")
        q2, kv2 = torch.zeros(1, 2 * G, 1, 16, device=DEV), torch.zeros(1, 2, Tk, 16, device=DEV)
        assert pope.decode_step_backend(q2, kv2, kv2, "triton") == ("triton" if G <= 64 else "torch")


@pytest.mark.parametrize("G, Tq", [(17, 1), (3, 7), (5, 9), (1, 33)])
def test_decode_rows_that_are_no_power_of_two_are_all_computed(G, Tq):
    """G * Tq = 17, 21, 45, 33 query rows per key/value head: the kernel's row tile (BLOCK_M) is the next power of
    two (32 or 64), so every row is computed; each equals the float64 reference, with one and three splits."""
    Tk = 40
    q, k, v, delta = _cache(1, G, 1, Tq, Tk, seed=6, gain=2.0)
    ref = pope.pope_attention_reference(q, k, v, delta, q_offset=Tk - Tq)
    for n_split in (1, 3):
        got = pope.pope_attention_decode(
            q, pope.pope_key_magnitude(k), v, delta, q_offset=Tk - Tq, backend="triton", n_split=n_split
        )
        err = (got.double() - ref).abs().amax(-1)  # (1, G, Tq): per row
        assert err.max().item() < 1e-4, (n_split, (err >= 1e-4).nonzero().tolist()[:5])


@pytest.mark.parametrize("dominant", [3, 147])  # in the first split, and in the last (ragged) one: keys 144..149
def test_the_split_merge_takes_the_rows_maximum_wherever_it_lies(dominant):
    """Flash-decoding's merge rescales each split by 2^(lse_split - m), m the row's maximum over the splits. One key
    is made dominant by 400 base-2 logits (mu 0 elsewhere, so the other 149 keys score 0): with m taken from any
    split but the one holding it, 2^400 overflows float32 and the row is inf / inf = nan. By hand: o is the dominant
    key's value to float32 precision, and lse = ln(2^400 + 149) = 400 ln 2 nats (149 * 2^-400 vanishes), for 4
    splits of 48, 48, 48 and 6 keys and for one split."""
    B, H, Tk, d = 1, 1, 150, 16
    rot = pope.pope_rotation_table(Tk, d, device=DEV)
    mu = torch.zeros(B, H, Tk, d, device=DEV)
    mu[0, 0, dominant] = 1.0
    v = torch.randn(B, H, Tk, d, generator=torch.Generator().manual_seed(0)).to(DEV)
    qd = (400.0 / d) * rot[dominant].view(1, 1, 1, 2 * d)  # score of key s: (400/d) sum_c cos((s - dominant) theta_c)
    for n_split in (4, 1):
        o, lse = pk.decode(qd, mu, v, rot, q_offset=Tk - 1, n_split=n_split)
        assert torch.isfinite(o).all() and torch.isfinite(lse).all(), n_split
        torch.testing.assert_close(o[0, 0, 0], v[0, 0, dominant], atol=1e-5, rtol=1e-5)
        assert lse.item() == pytest.approx(400 * math.log(2), rel=1e-5)
