"""The default GPU training step, rehearsed on the CPU: torch.compile's default backend (Inductor, its
partitioner and generated code) on model.py's GPT with attn_backend='triton' (the Cartesian transform in
PyTorch under a selective checkpoint, the custom ops pope::attention_forward / attention_backward, the Triton
kernels in the interpreter), forward and backward.
Loss and every parameter's gradient equal eager's, on the same model and batch. Each test compiles in
its own fresh Inductor cache (compiled.fresh_inductor). Then train.py itself with the CUDA defaults
(--compile=True --attn_backend=triton): one and two processes, a resume, the final evaluation.

What only a GPU shows (timings, bf16 numerics, shared memory, autotuning): docs/kernel.md."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn
from compiled import DEV, fresh_inductor, loss_and_grads, pope_gpt, relative_errors

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# max |compiled - eager| / max |eager| per gradient. fp32: the compiled step runs the same custom ops on
# the same inputs, and Inductor's fused C++ kernels (RMSNorm, GELU, cross-entropy) reorder float32 sums:
# a few float32 ulps of the largest entry (measured up to 7e-7). fp16 autocast: Inductor keeps fused fp16
# chains in float32 and rounds once where eager rounds after each op (measured up to 4e-4). A gradient
# read through wrong strides is off by O(1) (issue 42: 1.35).
TOL = {torch.float32: 2e-5, torch.float16: 5e-3}


def _batch(T, seed=0, B=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (B, T), generator=g).to(DEV), torch.randint(0, 64, (B, T), generator=g).to(DEV)


def _check(got_loss, want_loss, got, want, tol, what):
    """The losses and every gradient agree within tol (relative to each gradient's largest entry);
    returns the largest relative gradient error."""
    torch.testing.assert_close(got_loss, want_loss, rtol=tol, atol=0, msg=f"loss, {what}")
    errors = relative_errors(got, want)
    assert max(errors.values()) <= tol, (what, {n: e for n, e in errors.items() if e > tol})
    return max(errors.values())


def test_compiled_training_step_equals_eager_and_saves_no_cartesian_tensors(tmp_path, monkeypatch):
    """The GPU default's model (one query head per key/value head, δ, softplus), fp32. Also what the min-cut
    partitioner keeps for the backward: no (B, H, T, 2d) Cartesian q~, k~ (the selective checkpoint recomputes
    them); and a second compiled step gives δ's gradient bit for bit (no atomics on any device), and every other
    gradient bit for bit on a CPU; on CUDA the tied wte/lm_head's gradient goes through Inductor's atomic
    scatter-add, so there the others are compared to the last bits of fp32."""
    import torch._inductor.compile_fx as compile_fx

    saved = []
    partition = compile_fx.min_cut_rematerialization_partition

    def recording_partition(joint, inputs, **kw):  # Inductor's own partitioner; records the forward's outputs
        fw, bw = partition(joint, inputs, **kw)
        out = next(n for n in fw.graph.nodes if n.op == "output")
        vals = (getattr(a, "meta", {}).get("val") for a in out.args[0])
        saved.extend(v for v in vals if isinstance(v, torch.Tensor))
        return fw, bw

    monkeypatch.setattr(compile_fx, "min_cut_rematerialization_partition", recording_partition)

    model = pope_gpt()
    x, y = _batch(32)
    step = lambda m: lambda x, y: m(x, y)[1]
    with fresh_inductor(tmp_path):
        want_loss, want = loss_and_grads(model, step(model), x, y)
        compiled = step(torch.compile(model))
        got_loss, got = loss_and_grads(model, compiled, x, y)
        again = loss_and_grads(model, compiled, x, y)[1]
    err = _check(got_loss, want_loss, got, want, TOL[torch.float32], "compiled GPT")
    delta = "transformer.h.0.attn.pope_delta"  # its gradient: Inductor's reduction over batch and positions, no atomics
    assert torch.equal(again[delta], got[delta]) and got[delta].abs().max() > 0
    for n in got:  # on CUDA the tied wte/lm_head's gradient is an atomic scatter-add (the embedding's backward)
        if DEV == "cpu":
            assert torch.equal(again[n], got[n]), n
        else:  # summation order varies run to run: equal to the last bits of fp32
            torch.testing.assert_close(again[n], got[n], rtol=1e-5, atol=1e-7, msg=n)
    B, T, H, d = 2, 32, 2, 16
    shapes = [tuple(t.shape) for t in saved]
    print(f"max relative gradient error {err:.2e}; saved for the backward: {shapes}")
    assert shapes and (B, H, T, 2 * d) not in shapes, shapes


class Arms(nn.Module):
    """Several GPTs in one module; forward returns their losses as a vector. Compiled together they share one
    Inductor compile (kernels of equal shapes are built once). amps[i]: model i's autocast dtype, or None."""

    def __init__(self, models, amps):
        super().__init__()
        self.models, self.amps = nn.ModuleList(models), amps

    def forward(self, x, y):
        losses = []
        for model, amp in zip(self.models, self.amps):
            with torch.autocast(DEV, dtype=amp or torch.float16, enabled=amp is not None):
                losses.append(model(x, y)[1])
        return torch.stack(losses)


ARMS = [  # (name, GPTConfig fields, autocast dtype)
    ("mha_softplus", dict(), None),
    ("gqa_relu_no_delta", dict(n_head=4, n_kv_head=2, pope_use_delta=False, pope_magnitude="relu"), None),
    ("mha_identity", dict(pope_magnitude="identity"), None),
    ("gqa_softplus_fp16", dict(n_head=4, n_kv_head=2), torch.float16),
]


@pytest.mark.slow
def test_compiled_step_equals_eager_for_each_arm_and_after_a_change_of_T(tmp_path):
    """Grouped-query attention, no δ, every magnitude, fp16 autocast, in one compiled module; then a second
    sequence length, which recompiles with a dynamic T. Slow: two compiles of four models (minutes)."""
    arms = Arms([pope_gpt(seed=i, **kw) for i, (_, kw, _) in enumerate(ARMS)], [a for _, _, a in ARMS])
    errors = {}
    with fresh_inductor(tmp_path):
        compiled = torch.compile(arms)
        for T in (32, 24):
            x, y = _batch(T, seed=T)
            want_loss, want = loss_and_grads(arms, arms, x, y)
            got_loss, got = loss_and_grads(arms, compiled, x, y)
            for i, (name, _, amp) in enumerate(ARMS):
                arm = {n: t for n, t in got.items() if n.startswith(f"models.{i}.")}
                errors[(name, T)] = _check(
                    got_loss[i],
                    want_loss[i],
                    arm,
                    {n: want[n] for n in arm},
                    TOL[amp or torch.float32],
                    f"{name}, T={T}",
                )
    print("max relative gradient error per arm:", {k: f"{e:.2e}" for k, e in errors.items()})


def _ddp_rank(rank, world_size, port, cache_dir, out):
    """One process of test_ddp_of_the_compiled_model_equals_eager: DDP(torch.compile(model)) over gloo, as
    train.py builds it, on this rank's half of the batch; rank 0 writes its loss and gradients to `out`."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHINDUCTOR_CACHE_DIR=cache_dir)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    model = pope_gpt()
    x, y = _batch(32, B=4)
    half = slice(2 * rank, 2 * rank + 2)
    wrapped = {"ddp": DDP(torch.compile(model))}  # as train.py: DDP around the compiled model
    loss, grads = loss_and_grads(model, lambda x, y: wrapped["ddp"](x, y)[1], x[half], y[half])
    loss = loss.clone()
    dist.all_reduce(loss)
    if rank == 0:
        torch.save({"loss": loss / world_size, "grads": grads}, out)
    dist.barrier()
    wrapped.clear()  # free DDP's reducer while its gloo group is alive (train.py explains the hang otherwise)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="needs the Triton interpreter (two gloo processes on CPU); "
    "train.py's torchrun test below runs DDP on CUDA machines too",
)
def test_ddp_of_the_compiled_model_equals_eager(tmp_path):
    """Two gloo processes, each with half of a batch of 4: DDP's averaged gradients equal eager's on the whole
    batch (the losses are means over equal token counts). Slow: each process compiles (minutes)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "rank0.pt")
    mp.spawn(_ddp_rank, args=(2, port, str(tmp_path / "inductor"), out), nprocs=2, join=True)
    model = pope_gpt()
    x, y = _batch(32, B=4)
    want_loss, want = loss_and_grads(model, lambda x, y: model(x, y)[1], x, y)
    got = torch.load(out, weights_only=True)
    err = _check(got["loss"], want_loss, got["grads"], want, TOL[torch.float32], "DDP of the compiled GPT")
    print(f"DDP: max relative gradient error {err:.2e}")


def _tiny_stream(root):
    """A 168-token stream dataset (vocab 16, no tokenizer: no end-of-run sample) in root/data/toy."""
    from prepare.common import BinWriter, write_meta

    path = os.path.join(root, "data", "toy")
    seq = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7] * 12) % 16
    for split in ("train", "val", "test"):
        with BinWriter(os.path.join(path, f"{split}.bin"), np.uint16) as w:
            w.write(seq)
    write_meta(
        path,
        {
            "dataset": "toy",
            "vocab_size": 16,
            "dtype": "uint16",
            "layout": "stream",
            "splits": {
                s: {"file": f"{s}.bin", "shape": [len(seq)], "tokens": len(seq)} for s in ("train", "val", "test")
            },
            "pad_id": None,
            "loss": "all",
            "tokenizer": {"kind": "none"},
        },
    )
    return os.path.join(root, "data")


@pytest.mark.slow
def test_train_py_with_the_cuda_defaults_one_and_two_processes_and_a_resume(tmp_path):
    """train.py --compile=True --attn_backend=triton on a tiny stream: 4 steps in one process; 2 steps, then a
    resume to 4, equal to it; two gloo processes (torchrun) with the same global batch equal to it; the final
    evaluation of best.pt on the val and test splits in every run. Slow: four processes compile."""
    data_root = _tiny_stream(str(tmp_path))
    args = [
        "--n_layer=1",
        "--n_head=2",
        "--n_embd=32",
        "--batch_size=2",
        "--gradient_accumulation_steps=2",
        "--block_size=16",
        "--eval_iters=1",
        "--eval_interval=2",
        "--log_interval=1",
        "--warmup_iters=1",
        "--dropout=0.0",
        "--device=cpu",
        "--compile=True",
        "--attn_backend=triton",
        "--dataset=toy",
        f"--data_root={data_root}",
        "--pope_delta_init=uniform",
    ]
    env = dict(
        os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor")
    )

    def train(out, *extra, procs=1):
        torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
        launch = [sys.executable, *(torchrun if procs > 1 else []), "train.py"]
        p = subprocess.run(
            launch + [*args, f"--out_dir={tmp_path / out}", *extra],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        with open(tmp_path / out / "log.jsonl") as f:
            rows = [json.loads(line) for line in f]
        with open(tmp_path / out / "metrics.json") as f:
            return {r["iter"]: r["loss"] for r in rows if "loss" in r}, json.load(f)

    one, m_one = train("one", "--max_iters=4")
    train("part", "--max_iters=2")
    part, m_part = train("part", "--max_iters=4", "--init_from=resume")
    two, m_two = train("two", "--max_iters=4", procs=2)
    assert sorted(one) == sorted(part) == sorted(two) == [1, 2, 3, 4]
    assert [part[i] for i in (3, 4)] == [one[i] for i in (3, 4)]  # the resumed steps: bit for bit
    np.testing.assert_allclose([two[i] for i in one], [one[i] for i in one], rtol=1e-5)
    for m in (m_part, m_two):
        for split in ("val", "test"):
            assert m[split]["targets"] == m_one[split]["targets"] > 0
            np.testing.assert_allclose(m[split]["loss"], m_one[split]["loss"], rtol=1e-5)
