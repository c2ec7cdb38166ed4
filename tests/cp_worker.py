"""Context parallelism's checks on real gloo ranks (tests/test_context_parallel.py runs it, one torchrun launch per
world size; cases share the launch because starting processes costs seconds on a loaded CPU):

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/cp_worker.py CASES.json OUT.json

CASES.json: a list of cases, each {"kind": "train" | "layer" | "loss" | "memory" | "shared", "dp": int, "cp": int,
...}; rank 0 writes OUT.json, one result per case. Every rank builds the same model (one seed) and the same batches;
rank 0 also runs the one-process reference (the plain GPT on the whole batch) in its own process, so no second launch
is needed.

    train   3 AdamW steps (weight decay, delta's projection) of a tiny GPT under CP (FSDP2 over dp x cp, or DDP)
            -> per-step losses of both, and the largest relative difference of the parameters after step 3
            (max |a - b| / max |b| per tensor), against the reference (dp groups: gradient accumulation over dp)
    layer   one layer's attention (CausalSelfAttention.attend) under CP against the whole sequence's: this rank's
            output rows and the gradients of q, k, v at its positions, documents crossing chunk boundaries
    loss    CPBatch.loss with ignored targets falling unevenly across ranks against F.cross_entropy's mean
    memory  bytes saved for the backward (torch.autograd.graph.saved_tensors_hooks) by one forward per rank
    shared  what one forward and backward of a 3-layer GPT builds per batch, not per layer: the calls of
            model.alibi_bias and the distinct rotation-row tensors model.rope_rotate gets
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import context_parallel  # noqa: E402
import sharding  # noqa: E402
from model import GPT, GPTConfig, rotation_table  # noqa: E402
from pope import document_mask  # noqa: E402


def config(case, **kw):
    args = dict(
        n_layer=2,
        n_head=4,
        n_kv_head=case.get("n_kv_head"),
        n_embd=32,
        vocab_size=64,
        block_size=case.get("T", 32),
        attn_backend=case.get("backend", "torch"),
        pos_encoding=case["pos_encoding"],
        pope_delta_init="uniform",
    )
    args.update(case.get("model", {}))
    args.update(kw)
    return GPTConfig(**args)


def batches(case, n):
    """n global batches (dp * B rows of T tokens): x, y (ignored targets in the first quarter of every row: all in
    cp rank 0's chunk), document_ids (block_causal: documents of random lengths crossing chunk boundaries) and
    position_ids restarting in each document (reset)."""
    g = torch.Generator().manual_seed(1234)
    rows, T = case["dp"] * case.get("B", 2), case.get("T", 32)
    out = []
    for _ in range(n):
        x = torch.randint(0, 64, (rows, T), generator=g)
        y = torch.randint(0, 64, (rows, T), generator=g)
        y[:, : T // 4][torch.rand(rows, T // 4, generator=g) < 0.7] = -1
        docs, pos = None, None
        if case.get("mask") == "block_causal":
            cuts = torch.rand(rows, T, generator=g) < 0.15
            cuts[:, 0] = False
            docs = cuts.cumsum(1).to(torch.int32)
            starts = torch.cat([torch.ones(rows, 1, dtype=torch.bool), docs[:, 1:] != docs[:, :-1]], 1)
            idx = torch.arange(T).expand(rows, T)
            first = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), 1).values
            pos = (idx - first) if case.get("reset", True) else None
        out.append((x, y, docs, pos))
    return out


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def train_case(case, layout):
    torch.manual_seed(0)
    cfg = config(case)
    dtype = getattr(torch, case.get("dtype", "float32"))
    ref, model = GPT(cfg).to(dtype), GPT(cfg).to(dtype)
    model.load_state_dict(ref.state_dict())
    grads = {}
    data, B = batches(case, 3), case.get("B", 2)
    ref_losses, losses = [], []
    rank0 = dist.get_rank() == 0
    if rank0:  # the one-process reference: dp groups' rows as gradient accumulation micro-batches
        opt = ref.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")
        for x, y, docs, pos in data:
            total = 0.0
            for k in range(case["dp"]):
                rows = slice(k * B, (k + 1) * B)
                kw = (
                    {}
                    if docs is None
                    else {"document_ids": docs[rows], "position_ids": None if pos is None else pos[rows]}
                )
                loss = ref(x[rows], y[rows], **kw)[1] / case["dp"]
                loss.backward()
                total += loss.item()
            grads = grads or {n: p.grad.clone() for n, p in ref.named_parameters()}  # step 1's
            opt.step()
            opt.zero_grad(set_to_none=True)
            ref.clamp_pope_delta_()
            ref_losses.append(total)
    if case.get("wrap", "fsdp") == "fsdp":
        sharding.shard(model, "cpu", "float32", mesh=layout.fsdp_mesh)
        step_model = model
    else:
        step_model = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    if case.get("checkpoint"):
        sharding.checkpoint_blocks(model)
    opt = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), "cpu")
    rows = slice(layout.dp_rank * B, (layout.dp_rank + 1) * B)
    for x, y, docs, pos in data:
        xl, yl, kw = layout.shard(
            x[rows], y[rows], None if docs is None else docs[rows], None if pos is None else pos[rows]
        )
        loss = step_model(xl, yl, **kw)[1]
        loss.backward()
        if len(losses) == 0:  # step 1's gradients, whole
            got = {
                n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                for n, p in model.named_parameters()
            }
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.clamp_pope_delta_()
        value = loss.detach().clone()
        dist.all_reduce(value)
        losses.append(value.item() / dist.get_world_size())
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()}
    if not rank0:
        return None
    want = dict(ref.named_parameters())
    params = max(rel(full[n], want[n].detach()) for n in full)
    params_l2 = max(float((full[n] - want[n].detach()).norm() / want[n].detach().norm()) for n in full)
    loss_rel = max(abs(a / b - 1) for a, b in zip(losses, ref_losses))
    grad_rel = max(rel(got[n], grads[n]) for n in grads)
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "loss_rel": loss_rel,
        "grad_rel": grad_rel,
        "param_rel": params,
        "param_rel_l2": params_l2,
    }


def layer_case(case, layout):
    """One layer: random q, k, v of the whole sequence (equal on every rank), the layer's attention on all of it
    against this rank's chunks under CP, forward rows and q, k, v gradients at this rank's positions."""
    torch.manual_seed(0)
    cfg = config(case)
    dtype = getattr(torch, case.get("dtype", "float32"))
    model = GPT(cfg).to(dtype)
    attn = model.transformer.h[0].attn
    B, T, H, Hkv, d = 2, cfg.block_size, cfg.n_head, cfg.n_kv_head or cfg.n_head, cfg.n_embd // cfg.n_head
    g = torch.Generator().manual_seed(7)
    q, k, v, w = (torch.randn(B, h, T, d, generator=g, dtype=dtype) for h in (H, Hkv, Hkv, H))
    _, _, docs, pos = batches(case, 1)[0]
    docs, pos = (None, None) if docs is None else (docs[:B], None if pos is None else pos[:B])
    rotation = rotation_table(cfg, T)  # None for encodings without one
    from model import Documents, alibi_document_bias

    full_docs = None
    if docs is not None:
        mask = None if case.get("backend") == "triton" else document_mask(docs)
        if cfg.pos_encoding == "alibi_half" and mask is not None:
            mask = alibi_document_bias(attn.alibi_slopes, mask)
        full_docs = Documents(docs, pos, mask)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    y = attn.attend(*leaves, 0, rotation, full_docs)
    (y * w).sum().backward()
    x = torch.zeros(B, T, dtype=torch.long)
    _, _, kw = layout.shard(x, None, docs, pos)
    plan = kw["cp"]
    plan.documents(model, x[:, : T // layout.cp], None, None, None)
    index = plan.local_index()
    local = [t.index_select(2, index).clone().requires_grad_() for t in (q, k, v)]
    y_cp = plan.attention(attn, *local, rotation)
    (y_cp * w.index_select(2, index)).sum().backward()
    diffs = {"y": rel(y_cp.detach(), y.detach().index_select(2, index))}
    for name, a, b in zip("qkv", local, leaves):
        diffs["d" + name] = rel(a.grad, b.grad.index_select(2, index))
    worst = torch.tensor(list(diffs.values()))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return dict(zip(diffs, worst.tolist()))


def loss_case(case, layout):
    """CPBatch.loss against F.cross_entropy's mean with ignored targets only in cp rank 0's chunk of the row."""
    g = torch.Generator().manual_seed(3)
    B, T, V = 2, case.get("T", 32), 16
    logits = torch.randn(B, T, V, generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    y[:, : T // (2 * layout.cp)] = -1  # every target of cp rank 0's first chunk ignored
    want = F.cross_entropy(logits.view(-1, V), y.view(-1), ignore_index=-1)
    x = torch.zeros(B, T, dtype=torch.long)
    _, yl, kw = layout.shard(x, y)
    plan = kw["cp"]
    got = plan.loss(logits[:, plan.local_index()], yl)
    naive = torch.tensor(
        F.cross_entropy(logits[:, plan.local_index()].reshape(-1, V), yl.reshape(-1), ignore_index=-1).item()
    )
    dist.all_reduce(naive)
    return {"got": got.item(), "want": want.item(), "mean_of_rank_means": naive.item() / layout.cp}


def memory_case(case, layout):
    """Bytes saved for the backward by one forward of a GPT (B x T tokens, this rank's slice under CP), measured with
    saved_tensors_hooks; the gathered keys and values of one layer, and rank 0's estimate (context_parallel)."""
    torch.manual_seed(0)
    cfg = config(case, **({} if "n_embd" in case.get("model", {}) else {"n_embd": 64}))
    model = GPT(cfg)
    B, T = case.get("B", 1), cfg.block_size
    x = torch.randint(0, 64, (B, T))
    saved = {}
    fixed = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}

    def pack(t):  # storages, each once (views of one tensor share it); parameters and the model's tables left out
        storage = t.untyped_storage()
        if storage.data_ptr() not in fixed:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    if layout.cp > 1:
        xl, yl, kw = layout.shard(x, x)
    else:
        xl, yl, kw = x, x, {}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits, loss = model(xl, yl, **kw)
    loss.backward()
    measured = torch.tensor(float(sum(saved.values())))
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    est = context_parallel.activation_bytes(cfg, B, T, layout.cp, bytes_per_element=4)
    shapes = {"logits": list(logits.shape), "loss": loss.item()}
    return {"cp": layout.cp, "measured": measured.item(), "estimate": est, **shapes}


def shared_case(case, layout):
    """ALiBi's causal bias and RoPE's rotation rows under CP: built once per forward (per query chunk for the bias)
    and shared by the 3 layers, counted by wrapping model.alibi_bias and model.rope_rotate on this rank."""
    import model as model_module

    calls, rows = [], []
    real_bias, real_rotate = model_module.alibi_bias, model_module.rope_rotate
    model_module.alibi_bias = lambda *a, **kw: calls.append(1) or real_bias(*a, **kw)
    model_module.rope_rotate = lambda x, r: rows.append(r.data_ptr()) or real_rotate(x, r)
    try:
        torch.manual_seed(0)
        model = GPT(config(case, n_layer=3))
        x, y, docs, pos = batches(case, 1)[0]
        docs = docs if case.get("docs", True) else None  # position_ids alone: causal attention
        xl, yl, kw = layout.shard(x, y, docs, pos)
        model(xl, yl, **kw)[1].backward()
    finally:
        model_module.alibi_bias, model_module.rope_rotate = real_bias, real_rotate
    return {"alibi_bias_calls": len(calls), "rotate_calls": len(rows), "distinct_rows": len(set(rows))}


KINDS = {"train": train_case, "layer": layer_case, "loss": loss_case, "memory": memory_case, "shared": shared_case}


def main(cases_path, out_path):
    dist.init_process_group("gloo")
    with open(cases_path) as f:
        cases = json.load(f)
    results = []
    for case in cases:
        t0 = time.time()
        layout = context_parallel.ContextParallel(case["cp"], "cpu")
        results.append({"case": case, "result": KINDS[case["kind"]](case, layout), "seconds": time.time() - t0})
        dist.barrier()
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
