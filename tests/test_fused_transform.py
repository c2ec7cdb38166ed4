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

import bench_kernel
from compiled import fresh_inductor
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
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=64, vocab_size=64, pos_encoding=pos_encoding,
                          dropout=0.0, **kw)).to(DEV)
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
        before = code[:m.start()]
        nests, numels = list(CPP_NEST.finditer(before)), list(TRITON_NUMEL.finditer(before))
        if nests and (not numels or nests[-1].start() > numels[-1].start()):
            extents.append(math.prod(int(b) for b in CPP_BOUND.findall(before[nests[-1].start():])))
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
