"""Run under torchrun (gloo, CPU, the Triton interpreter) by tests/test_ddp_compile.py: a compiled PoPE block on the
Triton path wrapped in DDP with tiny buckets (bucket_cap_mb, so Dynamo's DDPOptimizer splits the graph), one training
step per mode; prints one JSON line per mode on rank 0: {"mode", "forward": attention kernel calls in the forward,
"backward": calls in the backward (reruns), "fallback": train.compile_model turned DDPOptimizer off}.

Modes (argv): 'installed' (torch as installed, compiled with train.compile_model); 'old' (pytorch issue 178765
modelled: DDPOptimizer's propagate_metadata as before PR 179496, which overwrites the checkpoint body's metadata and
drops the policy) compiled with train.compile_model (its fallback); 'old_raw': the old code compiled with plain
torch.compile (the bug shows)."""

import json
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._dynamo.backends import distributed as ddp_backend
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pope  # noqa: E402
import pope_kernel  # noqa: E402
import train  # noqa: E402

FIXED = ddp_backend.propagate_metadata


def old_propagate_metadata(orig_gm, split_gm):
    """DDPOptimizer's propagate_metadata before PR 179496: every top-level child of the split graph gets the original
    graph's metadata, the checkpoint bodies (wrap_body_*) included, whose _checkpoint_context_fn is then lost."""
    for name, module in split_gm.named_modules():
        if "." not in name and len(name):
            module.meta = orig_gm.meta
            module._param_name_to_source = orig_gm._param_name_to_source


class Block(nn.Module):
    """Two linear layers around PoPE attention (Triton backend): their parameters fill separate DDP buckets."""

    def __init__(self, d=16, H=2):
        super().__init__()
        self.H, self.d = H, d
        self.qkv = nn.Linear(H * d, 3 * H * d)
        self.out = nn.Linear(H * d, H * d)
        self.delta = nn.Parameter(-2 * math.pi * torch.rand(H, d))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.H, self.d).permute(2, 0, 3, 1, 4)
        y = pope.pope_attention(q, k, v, self.delta, backend="triton")
        return self.out(y.transpose(1, 2).reshape(B, T, C)).pow(2).mean()


def main(modes):
    dist.init_process_group("gloo")
    calls = [0]
    real = pope_kernel.launch_forward

    def counting(*args):
        calls[0] += 1
        return real(*args)

    pope_kernel.launch_forward = counting  # attention_forward's implementation, looked up at each call
    for mode in modes:
        torch._dynamo.reset()
        torch._dynamo.config.optimize_ddp = True
        ddp_backend.propagate_metadata = FIXED if mode == "installed" else old_propagate_metadata
        torch.manual_seed(0)
        net = Block()
        compiled = torch.compile(net) if mode == "old_raw" else train.compile_model(net, ddp=True)
        dist._DEFAULT_FIRST_BUCKET_BYTES = 1024  # DDPOptimizer asserts the first bucket is no larger than the others
        model = DDP(compiled, bucket_cap_mb=2 / 1024, broadcast_buffers=False)  # 2 KB buckets: one per parameter
        x = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(1))
        calls[0] = 0
        loss = model(x)
        fwd = calls[0]
        loss.backward()
        row = {"mode": mode, "forward": fwd, "backward": calls[0] - fwd}
        row["fallback"] = not torch._dynamo.config.optimize_ddp
        row["grad_finite"] = all(torch.isfinite(p.grad).all().item() for p in net.parameters())
        if dist.get_rank() == 0:
            print(json.dumps(row), flush=True)
    ddp_backend.propagate_metadata = FIXED
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
