"""The compiled step around the attention kernels (issue 51), measured where a CPU can measure it.

On a GPU every eager PyTorch op is a kernel launch, and a small model's step is bound by them. PoPE's Cartesian
transform and its chain rule are PyTorch ops that torch.compile fuses (pope.py, _triton_region): what runs
eagerly around the Triton kernels is only their outputs' allocation (bench_kernel.count_eager_ops). The
rotations come from tables (GPT.rotation): Inductor's code for a compiled RoPE step holds no cos/sin, and a
PoPE step's only trigonometry is cos/sin of delta's H_kv * d entries, never per element of q~, k~."""

import math
import re

import pytest
import torch
from compiled import fresh_inductor

import bench_kernel
from model import GPT, GPTConfig

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


@pytest.mark.parametrize("kw", [dict(), dict(H=4, H_kv=2, delta=False)], ids=["mha_delta", "gqa_no_delta"])
def test_a_compiled_attention_call_runs_at_most_8_eager_ops_around_its_kernels(kw, tmp_path):
    """Before the transform left the opaque ops: 94 (MHA, delta) and 84 (GQA) eager ops per call, fwd + bwd."""
    with fresh_inductor(tmp_path):
        got = bench_kernel.count_eager_ops(device=DEV, **kw)
    assert got["ops"] <= 8, got
    assert got["triton_kernels"] == (0 if CUDA else 4), got  # fwd, Di, dK/dV, dQ (interpreter launches)


def _generated_code(pos_encoding, tmp_path, **kw):
    """Inductor's generated code (wrapper and kernels) for one compiled training step of a 1-layer GPT."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            n_layer=1, n_head=2, n_embd=32, block_size=64, vocab_size=64, pos_encoding=pos_encoding, dropout=0.0, **kw
        )
    ).to(DEV)
    x = torch.randint(0, 64, (2, 64), device=DEV)

    def step(x):
        loss = model(x, x)[1]
        loss.backward()
        return loss

    with fresh_inductor(tmp_path):
        _, code = run_and_get_code(torch.compile(step), x)
    return "\n".join(code)


TRIG = re.compile(r"\.cos\(\)|\.sin\(\)|\b(?:std::|tl_math\.|libdevice\.)?(?:cos|sin)\(")
CPP_NEST = re.compile(r"for\(int64_t x0=")  # a C++ loop nest starts at its x0 loop
CPP_BOUND = re.compile(r"x\d+<static_cast<int64_t>\((\d+)L\)")
TRITON_NUMEL = re.compile(r"xnumel = (\d+)")


def _trig_extents(code):
    """For each cos/sin in the generated code, the elements its loop nest (C++: the product of the bounds of the
    loops around it) or kernel (Triton: xnumel) runs over."""
    extents = []
    for m in TRIG.finditer(code):
        before = code[: m.start()]
        nests, numels = list(CPP_NEST.finditer(before)), list(TRITON_NUMEL.finditer(before))
        if nests and (not numels or nests[-1].start() > numels[-1].start()):
            extents.append(math.prod(int(b) for b in CPP_BOUND.findall(before[nests[-1].start() :])))
        else:
            extents.append(int(numels[-1].group(1)) if numels else None)
    return extents


def test_a_compiled_yarn_step_computes_no_cos_or_sin(tmp_path):
    """RoPE (here with YaRN's frequencies) reads its rotations from GPT.rotation (rope_table); before, Inductor
    recomputed cos/sin of the angles per element of q and k in three fused kernels (31 % of an H200 step)."""
    assert _trig_extents(_generated_code("rope", tmp_path, rope_scaling=4.0, rope_original_block_size=16)) == []


def test_a_compiled_pope_step_takes_cos_and_sin_of_delta_only(tmp_path):
    """The Triton path's delta enters by angle addition; its cos/sin (H_kv * d = 32 numbers per layer) are saved by
    the selective checkpoint, so the fused kernels read them: no trigonometry per element of k~ or of its gradient
    (where Inductor, left alone, inlines cos(delta) into every element)."""
    extents = _trig_extents(_generated_code("pope", tmp_path, attn_backend="triton", pope_delta_init="uniform"))
    assert extents and set(extents) == {2 * 16}, extents


def _cartesian_formula(x, delta, n_positions):
    """PoPE's Cartesian form written out in float64: softplus(x) [cos(phi), sin(phi)], phi = t theta_c + delta_c."""
    from pope import pope_frequencies

    phase = torch.arange(n_positions, dtype=torch.float64)[:, None] * pope_frequencies(x.shape[-1]).double()
    phase = phase + delta.double()[:, None, :]
    mu = torch.nn.functional.softplus(x.double())
    return torch.cat((mu * torch.cos(phase), mu * torch.sin(phase)), dim=-1)


def test_the_transform_computes_in_float32_for_16_bit_inputs():
    """pope_cartesian (both backends' transform) forms magnitudes, table rows and products in float32 and rounds once,
    to the dtype asked for: from bf16 raw values, a float32 result is the float64 formula to float32 precision, and
    a bf16 one is that formula rounded once to bf16. Computed in bf16 instead (the rows rounded to 8 bits, two
    roundings per product) it is off by up to 7e-2 and two elements in three differ."""
    from pope import pope_cartesian, pope_rotation_table

    g = torch.Generator().manual_seed(0)
    x = (2 * torch.randn(2, 2, 40, 16, generator=g)).bfloat16()
    delta = -2 * math.pi * torch.rand(2, 16, generator=g)
    rows, want = pope_rotation_table(40, 16), _cartesian_formula(x, delta, 40)
    got = pope_cartesian(x, rows, delta, dtype=torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=5e-6, rtol=0)
    got16 = pope_cartesian(x, rows, delta)
    assert got16.dtype == torch.bfloat16
    assert (got16 == want.to(torch.bfloat16)).float().mean() > 0.99


def test_pope_refuses_a_rotation_table_that_does_not_cover_its_positions():
    """A table shorter than the positions (or of the wrong width) is a ValueError, not a silent broadcast: one row
    would give every query and key position 0's phase."""
    from pope import pope_attention, pope_attention_decode, pope_rotation_table

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 16, generator=g) for _ in range(3))
    table = pope_rotation_table(5, 16)
    for bad in (table[:1], table[:3], table[:, :16]):
        with pytest.raises(ValueError, match="rotation must be"):
            pope_attention(q, k, v, backend="torch", rotation=bad)
        with pytest.raises(ValueError, match="rotation must be"):
            pope_attention_decode(q[:, :, -1:], k, v, q_offset=4, backend="torch", rotation=bad)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=8, vocab_size=64, pos_encoding="pope"))
    with pytest.raises(ValueError, match="rotation must be"):
        model.transformer.h[0].attn(torch.randn(1, 5, 32), model.rotation[:1])


@pytest.mark.parametrize("pos_encoding", ["pope", "rope"])
def test_the_rotation_tables_are_exact_to_float32_at_100k_positions(pos_encoding):
    """The tables' phases t * theta are formed in float64 and rounded only after cos/sin, so a row is the float64
    formula to float32 rounding (6e-8) at any position; a float32 product t * theta is off by up to ~4e-3 rad at
    1e5 tokens (YaRN's and PoPE's long contexts read exactly those rows)."""
    from model import rope_table
    from pope import pope_frequencies, pope_rotation_table

    n, d = 100_001, 16
    if pos_encoding == "pope":
        got, freqs = pope_rotation_table(n, d), pope_frequencies(d).double()
    else:
        got, freqs = rope_table(n, d), 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    t = torch.arange(n - 2000, n, dtype=torch.float64)[:, None]
    want = torch.cat((torch.cos(t * freqs), torch.sin(t * freqs)), dim=-1)
    torch.testing.assert_close(got[n - 2000 :].double(), want, atol=2e-7, rtol=0)


@pytest.mark.parametrize("Tq, Tk, q_offset", [(4, 12, 8), (3, 8, 7)], ids=["decode_chunk", "queries_past_the_keys"])
def test_the_triton_path_reads_the_queries_rows_at_their_offset(Tq, Tk, q_offset):
    """backend='triton' takes the queries' rotations from rows q_offset.. of the table and builds a table that
    covers max(q_offset + Tq, Tk) positions: equal to the float64 polar formula for a chunk at the end of the
    keys and for queries that run past the last key (one row short of that would broadcast silently)."""
    from pope import pope_attention, pope_attention_reference

    g = torch.Generator().manual_seed(1)
    q, k, v = (2 * torch.randn(1, 2, T, 16, generator=g) for T in (Tq, Tk, Tk))
    delta = -2 * math.pi * torch.rand(2, 16, generator=g)
    want = pope_attention_reference(q, k, v, delta, q_offset=q_offset)
    got = pope_attention(q.to(DEV), k.to(DEV), v.to(DEV), delta.to(DEV), q_offset=q_offset, backend="triton")
    torch.testing.assert_close(got.cpu().double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("what", ["no_delta", "delta_frozen_v", "delta_only"])
def test_the_triton_path_saves_no_cartesian_tensors_whatever_requires_grad(what):
    """Eager autograd around backend='triton': the selective checkpoint runs whenever any input needs a gradient,
    so what the forward keeps for the backward holds no (B, H, T, 2d) q~ or k~, with delta None, with only q, k
    trainable, and with only delta trainable (a delta-only probe or fine-tune: k~ depends on delta); the gradients
    still equal the torch backend's. Measured by storage lifetime (tests/saved.py), which sees the checkpoint's own
    cache: saved_tensors_hooks did not, and passed with a policy that saved q~ and k~. The torch backend, which
    saves them for SDPA, is the known answer that the measure finds them: q~, k~, v padded to 2d and the output."""
    from saved import kept_for_backward

    from pope import pope_attention

    g = torch.Generator().manual_seed(2)
    B, H, T, d = 1, 2, 32, 16
    q, k, v = (torch.randn(B, H, T, d, generator=g).to(DEV) for _ in range(3))
    delta = None if what == "no_delta" else (-2 * math.pi * torch.rand(H, d, generator=g)).to(DEV)
    trainable = {"no_delta": (q, k, v), "delta_frozen_v": (q, k), "delta_only": (delta,)}[what]
    for t in trainable:
        t.requires_grad_()
    wide = lambda t: tuple(t.shape) == (B, H, T, 2 * d)
    out, kept = kept_for_backward(lambda: pope_attention(q, k, v, delta, backend="triton"), wide)
    assert kept == [], kept
    _, kept_torch = kept_for_backward(lambda: pope_attention(q, k, v, delta, backend="torch"), wide)
    assert len(kept_torch) == 4, kept_torch
    got = torch.autograd.grad(out.pow(2).sum(), trainable)
    want = torch.autograd.grad(pope_attention(q, k, v, delta, backend="torch").pow(2).sum(), trainable)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_the_triton_path_runs_in_the_autocast_dtype_for_float32_inputs():
    """Under fp16 autocast, float32 q, k, v (a caller's, or a layer kept in float32) go to the kernel as fp16,
    values included, and the output is fp16 (pope_attention's contract for both backends): the float64 formula
    to fp16 precision, and the torch backend's dtype."""
    from pope import pope_attention, pope_attention_reference

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 16, 16, generator=g) for _ in range(3))
    delta = -2 * math.pi * torch.rand(2, 16, generator=g)
    want = pope_attention_reference(q, k, v, delta)
    with torch.autocast(DEV, dtype=torch.float16):
        got = pope_attention(q.to(DEV), k.to(DEV), v.to(DEV), delta.to(DEV), backend="triton")
        torch_path = pope_attention(q.to(DEV), k.to(DEV), v.to(DEV), delta.to(DEV), backend="torch")
    assert got.dtype == torch_path.dtype == torch.float16
    torch.testing.assert_close(got.cpu().double(), want, atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("magnitude", ["softplus", "relu", "identity"])
@pytest.mark.parametrize("per_token", [False, True], ids=["table_rows", "position_ids_rows"])
def test_the_transforms_written_out_chain_rule_is_the_derivative(magnitude, per_token):
    """pope_cartesian's backward is written out (pope._Cartesian, issue 67): in float64 its gradients in x and delta
    equal finite differences (torch.autograd.gradcheck), for each magnitude function, a scale, table rows and
    per-token rows (position_ids), and with only x or only delta trainable (delta fine-tuning)."""
    from pope import pope_cartesian, pope_rotation_table

    g = torch.Generator().manual_seed(4)
    x = (2 * torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)).requires_grad_()
    if magnitude == "relu":  # away from the kink, where finite differences are not the derivative
        x = (x.detach().sign() * (x.detach().abs() + 0.1)).requires_grad_()
    delta = (-2 * math.pi * torch.rand(3, 4, generator=g, dtype=torch.float64)).requires_grad_()
    rows = pope_rotation_table(9, 4).double()[:5]
    if per_token:
        rows = pope_rotation_table(9, 4).double()[torch.randint(0, 9, (2, 5), generator=g)].unsqueeze(1)

    def f(x, delta):
        return pope_cartesian(x, rows, delta, magnitude, 0.7)

    assert torch.autograd.gradcheck(f, (x, delta))
    assert torch.autograd.gradcheck(lambda x: f(x, delta.detach()), (x,))
    assert torch.autograd.gradcheck(lambda d: f(x.detach(), d), (delta,))
