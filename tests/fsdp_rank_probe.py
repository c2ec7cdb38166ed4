"""What each of 2 real gloo ranks holds under FSDP2 (tests/test_fsdp.py launches it under torchrun):

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/fsdp_rank_probe.py OUT_DIR

Writes OUT_DIR/rank<r>.json with, per rank:
  bf16      the bf16 policy (sharding.shard(..., 'bfloat16')): after one backward under bf16 autocast on different
            data per rank, how many elements of this rank's reduced gradient shards are not exactly a bf16 value
            (a reduction in fp32 keeps the bits the sum of two bf16 gradients needs; one in bf16 rounds them off)
  gathered  sharding.full_states after an AdamW step: the number of model and optimizer entries this rank got, the
            devices and DTensor-ness of its tensors, and whether they equal the shards' full_tensor() (rank 0)
  bytes     sharding.measured_bytes of a PoPE GPT whose tensors' rows do not divide by 2 (vocab 65) or are fewer
            than the ranks (delta of one key/value head: 1 row), after one step, and memory_per_rank's estimate
"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sharding  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

dist.init_process_group("gloo")
rank = dist.get_rank()
out = {}


def gpt(**kw):
    torch.manual_seed(0)
    cfg = dict(n_layer=1, n_head=2, n_embd=32, vocab_size=64, block_size=16, attn_backend="torch", bias=False)
    return GPT(GPTConfig(**{**cfg, **kw}))


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (2, 16), generator=g)


# bf16 policy: reduced gradients
m = gpt()
sharding.shard(m, "cpu", "bfloat16")
x = batch(10 + rank)  # different data per rank: the two ranks' gradients differ
with torch.autocast("cpu", torch.bfloat16):
    loss = m(x, x)[1]
loss.backward()
grads = [p.grad.to_local().float() for p in m.parameters() if p.grad is not None]
out["bf16"] = {
    "elements": sum(g.numel() for g in grads),
    "not_bf16": sum(int((g != g.to(torch.bfloat16).float()).sum()) for g in grads),
    "grad_dtypes": sorted({str(p.grad.dtype) for p in m.parameters() if p.grad is not None}),
}

# the gathered checkpoint state
m = gpt(pos_encoding="pope", n_kv_head=1)
sharding.shard(m, "cpu", "float32")
opt = m.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")
m(batch(20 + rank), batch(20 + rank))[1].backward()
opt.step()
full = {n: v.full_tensor() for n, v in m.state_dict().items()}  # the tied lm_head.weight too
msd, osd = sharding.full_states(m, opt)
tensors = list(msd.values()) + [v for s in osd.get("state", {}).values() for v in s.values() if torch.is_tensor(v)]
out["gathered"] = {
    "model_keys": len(msd),
    "optimizer_states": len(osd.get("state", {})),
    "devices": sorted({str(t.device) for t in tensors}),
    "dtensor": any(hasattr(t, "to_local") for t in tensors),
    "equal": all(torch.equal(msd[n], full[n]) for n in msd) if msd else None,
    "keys": len(full),
}

# bytes per rank: rows that do not divide by the ranks, or fewer rows than ranks
m = gpt(pos_encoding="pope", n_kv_head=1, vocab_size=65)
with torch.device("meta"):
    shapes = gpt(pos_encoding="pope", n_kv_head=1, vocab_size=65)
sharding.shard(m, "cpu", "float32")
opt = m.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")
x = batch(30 + rank) % 65
m(x, x)[1].backward()
opt.step()
out["bytes"] = {
    "measured": sharding.measured_bytes(m, opt),
    "estimate": sharding.memory_per_rank(shapes, dist.get_world_size())["fsdp"],
    "shapes": [list(p.shape) for p in shapes.parameters()],
}

with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(out, f)
dist.barrier()
dist.destroy_process_group()
