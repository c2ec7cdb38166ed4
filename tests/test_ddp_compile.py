"""DDP + torch.compile and PoPE's selective checkpoint (issue 61; pytorch issue 178765, fixed by PR 179496): on torch
2.8 to 2.12 Dynamo's DDPOptimizer splits the graph at DDP's bucket boundaries and overwrites the checkpoint body's
metadata, so the policy is lost and the backward reruns the attention kernel. train.compile_model detects it and turns
DDPOptimizer off. The old code is modelled on this torch (2.13, fixed) by patching its propagate_metadata back."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch._dynamo.backends import distributed as ddp_backend

import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_sac_probe import old_propagate_metadata  # noqa: E402


def test_the_affected_torch_is_told_by_the_fix_itself_else_by_the_version(monkeypatch):
    """This torch's propagate_metadata has the fix (PR 179496); the old one patched in does not; without readable
    source the version decides: 2.8 to 2.12 affected (the device image's 2.11 among them), 2.7 and 2.13 not."""
    import inspect

    fixed = not train.ddp_drops_selective_checkpoint()
    assert fixed == ("partition_names" in inspect.getsource(ddp_backend.propagate_metadata))
    monkeypatch.setattr(ddp_backend, "propagate_metadata", old_propagate_metadata)
    assert train.ddp_drops_selective_checkpoint()

    def no_source(obj):
        raise OSError("could not get source code")

    monkeypatch.setattr(inspect, "getsource", no_source)
    for version, affected in (("2.7.1", False), ("2.8.0", True), ("2.11.0+cu128", True), ("2.12.1", True)):
        monkeypatch.setattr(torch, "__version__", version)
        assert train.ddp_drops_selective_checkpoint() == affected, version
    for version in ("2.13.0+cpu", "2.15.0.dev20260901"):
        monkeypatch.setattr(torch, "__version__", version)
        assert not train.ddp_drops_selective_checkpoint(), version


def test_compile_model_turns_ddpoptimizer_off_only_under_ddp_on_an_affected_torch(monkeypatch):
    """compile_model: optimize_ddp is switched off under DDP on an affected torch (the old code patched in) and left
    on otherwise (one process; a fixed torch). torch.compile spied: what it is given is the model itself."""
    monkeypatch.setattr(torch, "compile", lambda model: ("compiled", model))
    net = torch.nn.Linear(2, 2)
    with torch._dynamo.config.patch(optimize_ddp=True):
        assert train.compile_model(net, ddp=True) == ("compiled", net)
        assert torch._dynamo.config.optimize_ddp is not train.ddp_drops_selective_checkpoint()
    monkeypatch.setattr(ddp_backend, "propagate_metadata", old_propagate_metadata)
    with torch._dynamo.config.patch(optimize_ddp=True):
        train.compile_model(net, ddp=False)
        assert torch._dynamo.config.optimize_ddp is True
        train.compile_model(net, ddp=True)
        assert torch._dynamo.config.optimize_ddp is False


@pytest.mark.slow
def test_ddp_with_tiny_buckets_never_reruns_the_attention_kernel_in_the_backward(tmp_path):
    """torchrun, 2 gloo processes, a compiled PoPE block on the Triton path (interpreter) in DDP with 2 KB buckets (one
    per parameter, so DDPOptimizer splits the graph): the attention kernel's forward runs once in the forward and 0
    times in the backward with torch as installed (2.13: fixed, no fallback; 2.11: the fallback) and with the old code
    patched in under train.compile_model (its fallback); the old code under plain torch.compile reruns it once (the
    bug, seen). 3 compiles: about 1 to 3 minutes on 2 busy cores."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "OMP_NUM_THREADS": "1"}
    env["TRITON_INTERPRET"] = "1"  # CPU tensors (gloo) also on a GPU machine
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    p = subprocess.run(
        [*cmd, "tests/ddp_sac_probe.py", "installed", "old", "old_raw"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["mode"]: r for r in map(json.loads, filter(lambda s: s.startswith("{"), p.stdout.splitlines()))}
    assert all(r["forward"] == 1 and r["grad_finite"] for r in rows.values()), rows
    assert rows["installed"]["backward"] == 0, rows
    assert rows["installed"]["fallback"] == train.ddp_drops_selective_checkpoint(), rows  # 2.13: fixed, no fallback
    assert rows["old"]["backward"] == 0 and rows["old"]["fallback"], rows
    assert rows["old_raw"]["backward"] == 1, rows


@pytest.mark.parametrize(
    "pos_encoding, fsdp, fallback",
    [("pope", False, True), ("rope", False, False), ("alibi_half", False, False), ("learned", False, False)]
    + [("pope", True, False)],
)
def test_train_applies_the_fallback_to_popes_ddp_runs_only(
    monkeypatch, toy_stream, tmp_path, pos_encoding, fsdp, fallback
):
    """Which runs train.py turns DDPOptimizer off for, on an affected torch (the old propagate_metadata patched in):
    only PoPE under DDP, whose Triton path holds the selective checkpoint DDPOptimizer drops. The other encodings
    keep DDP's bucket overlap (nothing of theirs is lost), and FSDP is not DDP (no DDPOptimizer). A real process
    group of one gloo process: torchrun's variables set by hand for DDP, fsdp=True's own group of one; torch.compile
    spied (the model runs eagerly), --compile=True."""
    import socket

    monkeypatch.setattr(ddp_backend, "propagate_metadata", old_propagate_metadata)
    monkeypatch.setattr(torch, "compile", lambda model: model)
    if not fsdp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        for k, v in dict(RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=port).items():
            monkeypatch.setenv(k, str(v))
    args = [f"--data_root={toy_stream}", "--dataset=toy", "--n_layer=1", "--n_head=2", "--n_embd=32"]
    args += ["--block_size=16", "--batch_size=2", "--max_iters=1", "--eval_iters=1", "--eval_interval=1"]
    args += ["--attn_backend=torch", "--compile=True", f"--pos_encoding={pos_encoding}", f"--out_dir={tmp_path}"]
    args += ["--device=cpu"]  # gloo, whatever the machine
    with torch._dynamo.config.patch(optimize_ddp=True):
        metrics = train.main(args + (["--fsdp=True"] if fsdp else []))
        assert torch._dynamo.config.optimize_ddp is not fallback, (pos_encoding, fsdp)
    assert metrics["sharding"]["fsdp"] == fsdp
