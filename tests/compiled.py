"""Helpers for the tests that run torch.compile's default backend (Inductor) on model.py's GPT.

Without CUDA, Inductor compiles on the CPU (C++ kernels around the custom ops) and the Triton kernels run
in the interpreter (tests/conftest.py sets TRITON_INTERPRET=1): the GPU's graph, fake kernels, partition
and wrapper code, with the interpreter in place of the GPU.
"""

import contextlib

import torch

from model import GPT, GPTConfig

# where the Triton path runs: the GPU where there is one (real kernels), else the CPU under the interpreter
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@contextlib.contextmanager
def fresh_inductor(folder):
    """Dynamo reset and a new, empty Inductor cache under `folder` (TORCHINDUCTOR_CACHE_DIR) for the block:
    Inductor's FX graph and AOTAutograd caches do not key on a custom op's fake kernel, so a cache written
    by other code could hand back a compiled graph built from another fake."""
    from torch._inductor.utils import fresh_cache

    torch._dynamo.reset()
    try:
        with fresh_cache(dir=str(folder)):
            yield
    finally:
        torch._dynamo.reset()


def pope_gpt(seed=0, **kw):
    """A 1-layer PoPE GPT (n_embd 32 per 2 query heads of width 16, vocab 64) on the Triton backend, δ drawn
    on [-2π, 0], with c_attn scaled up so that attention is peaked (position and phase matter) and lm_head
    so that the loss's gradient is not flat; on DEV. kw: GPTConfig fields."""
    torch.manual_seed(seed)
    n_head = kw.pop("n_head", 2)
    cfg = GPTConfig(
        **{
            "n_layer": 1,
            "n_head": n_head,
            "n_embd": 16 * n_head,
            "block_size": 64,
            "vocab_size": 64,
            "attn_backend": "triton",
            "pope_delta_init": "uniform",
            "dropout": 0.0,
            "bias": False,
            **kw,
        }
    )
    model = GPT(cfg)
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight.mul_(8.0)
            block.attn.c_proj.weight.mul_(10.0)
        model.lm_head.weight.mul_(5.0)
    return model.to(DEV)


def loss_and_grads(model, step, x, y):
    """step(x, y) -> loss (a tensor); backward; -> (loss, {name: grad}) with model's grads cleared after."""
    loss = step(x, y)
    loss.sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def relative_errors(got, want):
    """{name: max |got - want| / max |want|} over the gradients of want (the eager run's)."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return {n: ((got[n] - want[n]).abs().max() / want[n].abs().max()).item() for n in want}
