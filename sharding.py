"""Past one GPU's memory: FSDP2 sharding, activation checkpointing, checkpoints across set-ups, bytes per rank.

train.py's settings `fsdp`, `activation_checkpointing` and `checkpoint_format` come here:

    shard(model, dev, dtype)      fully_shard every Block, then the root (torch.distributed.fsdp, FSDP2): each
                                  rank holds 1/world of every parameter (rows of dim 0), of its gradient and of
                                  AdamW's two moments. MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
                                  where train.py's autocast is bf16; fp32 throughout otherwise.
    checkpoint_blocks(model)      recompute each Block in the backward (torch.utils.checkpoint, non-reentrant,
                                  so it nests with PoPE's own selective checkpoint around the Triton kernel)
    full_states / load_*          a checkpoint's model and optimizer state, gathered to rank 0 in the layout a
                                  single process writes (optimizer state keyed by parameter index), so ckpt.pt
                                  resumes under FSDP at any world size, under DDP or in one process
    save_dcp / load_dcp           checkpoint_format='dcp': a sharded torch.distributed.checkpoint folder
                                  (out_dir/ckpt.dcp, out_dir/best.dcp) for models too large to gather
    memory_per_rank               bytes per rank of parameters, gradients and AdamW state under DDP and FSDP,
                                  from the model's shapes, at their peak inside a step (fsdp_reduce_every_micro_step:
                                  gradients sharded throughout, or whole until the last micro-step); measured_bytes
                                  and grad_bytes: the same from a rank's local tensors

Convert a dcp folder to the single-file format that sample.py and the evaluation scripts read (one process,
no process group; the folder's optimizer state comes along, so the file resumes too):

    python sharding.py out-owt-1558m-pope/best.dcp out-owt-1558m-pope/best.pt
"""

import functools
import os
import shutil
import sys

import torch
import torch.distributed as dist

from checkpoint import DCP_SUFFIX, convert_hint, current_model_args, dcp_path  # noqa: F401 (dcp_path: train.py's)
from cli import UserError, atomic_open, exit_on_user_error

ADAMW_STATES = 2  # exp_avg, exp_avg_sq (fp32, the parameter's shape), plus a 0-d fp32 step per tensor


def check_settings(cfg, dtype):
    """Refuse, in one line (UserError, exit 2), what FSDP cannot honour here: float16 (its GradScaler does not
    unscale sharded gradients), an unknown checkpoint_format, and checkpoint_format='dcp' without fsdp."""
    if cfg.checkpoint_format not in ("single", "dcp"):
        raise UserError(f"checkpoint_format must be 'single' or 'dcp', got {cfg.checkpoint_format!r}")
    if cfg.checkpoint_format == "dcp" and not cfg.fsdp:
        raise UserError(
            "checkpoint_format='dcp' writes an FSDP run's shards: set fsdp=True, or checkpoint_format='single'"
        )
    if cfg.fsdp and dtype == "float16":
        raise UserError(
            "fsdp=True trains in bfloat16 or float32, not float16 (the GradScaler does not unscale sharded "
            "gradients): set dtype=bfloat16 on a GPU of compute capability >= 8.0, or float32, or fsdp=False"
        )


def init_single_process(dev):
    """A process group of one (no torchrun): FSDP needs one. gloo on a CPU, nccl on CUDA."""
    backend = "nccl" if dev.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def checkpoint_blocks(model):
    """Recompute every Block of `model` (a GPT) in the backward instead of keeping its activations: each
    Block's forward runs under torch.utils.checkpoint(use_reentrant=False) while gradients are on (evaluation
    and decoding run it plainly). Parameter names, state dicts and the FSDP hooks around the Block stay as
    they are; dropout masks are replayed (the RNG state is kept), so losses equal the run without it."""
    for block in model.transformer.h:
        block.forward = functools.partial(_checkpointed, block.forward)


def _checkpointed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def mixed_precision(dtype):
    """{"param_dtype", "reduce_dtype"} of FSDP's MixedPrecisionPolicy for train.py's compute dtype: bf16
    parameters in compute with fp32 gradient reduce (fp32 master weights and AdamW state) for 'bfloat16';
    fp32 throughout otherwise. metrics.json records it."""
    if dtype == "bfloat16":
        return {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    return {"param_dtype": "float32", "reduce_dtype": "float32"}


def shard(model, dev, dtype, mesh=None):
    """fully_shard each Block of `model` (a GPT), then the root (the embedding tied to lm_head, ln_f), over one
    mesh of every rank (`mesh`: a 1-D DeviceMesh of them, e.g. context parallelism's dp x cp flattened,
    context_parallel.ContextParallel.fsdp_mesh; None builds one); in place (the GPT's class becomes its FSDP
    subclass, its parameters DTensors sharded on dim 0), from rank 0's weights. Buffers (GPT.rotation and the
    other non-persistent tables) are not sharded: each rank keeps its own.
    -> the mixed-precision policy as names (mixed_precision)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.no_grad():  # rank 0's initial weights on every rank (each rank seeds seed + rank), as DDP does
        for p in model.parameters():
            dist.broadcast(p, 0)
    names = mixed_precision(dtype)
    # cast_forward_inputs=False: FSDP would cast every floating argument of a Block to param_dtype, GPT.rotation
    # included (cos/sin rounded to 8 bits under bf16); x is in param_dtype already (the embedding's weights are)
    policy = MixedPrecisionPolicy(**{k: getattr(torch, v) for k, v in names.items()}, cast_forward_inputs=False)
    if mesh is None:
        mesh = init_device_mesh("cuda" if dev.startswith("cuda") else "cpu", (dist.get_world_size(),))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return names


def is_sharded(model):
    """True if `model` (a GPT) went through shard."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**kw)


def _param_names(model, optimizer):
    """The name of every parameter of `optimizer`, in its order (its state_dict's indices 0, 1, ...)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in optimizer.param_groups for p in g["params"]]


def full_states(model, optimizer):
    """(model state dict, optimizer state dict) of a sharded GPT as one process writes them: every tensor
    whole, on the CPU, on rank 0 ({} on the others); the optimizer's state keyed by parameter index, as
    torch.optim.Optimizer.state_dict. Collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    opts = _options(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=opts)
    osd = get_optimizer_state_dict(model, optimizer, options=opts)
    return msd, (by_index(osd) if osd else {})


def by_index(osd):
    """An optimizer state dict keyed by parameter name (torch.distributed.checkpoint.state_dict's) -> keyed by
    index, in the order of its param_groups' names (torch.optim.Optimizer.state_dict's layout)."""
    index, groups = {}, []
    for g in osd["param_groups"]:
        ids = []
        for name in g["params"]:
            index[name] = len(index)
            ids.append(index[name])
        groups.append({**g, "params": ids})
    return {"state": {index[n]: s for n, s in osd["state"].items()}, "param_groups": groups}


def by_name(osd, names):
    """An optimizer state dict keyed by index -> keyed by names[index] (the inverse of by_index)."""
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]]
    return {"state": {names[i]: s for i, s in osd["state"].items()}, "param_groups": groups}


def load_model_state(model, state):
    """Load a whole model state dict (a checkpoint's "model") into a GPT, sharded or not."""
    if not is_sharded(model):
        model.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_options(full_state_dict=True))


def load_optimizer_state(model, optimizer, state):
    """Load a checkpoint's "optimizer" (keyed by index, whole tensors: any set-up wrote it) into the AdamW of
    a GPT, sharded (each rank keeps its rows) or not. Collective under FSDP."""
    if not is_sharded(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    named = by_name(state, _param_names(model, optimizer))
    set_optimizer_state_dict(model, optimizer, named, options=_options(full_state_dict=True))


def lockstep(batches, dev):
    """Yield each (x, y) of this rank's `batches`, then None until every rank has run out: a sharded model's
    forward is collective, so ranks with fewer evaluation batches (full_split_batches deals them round-robin)
    run a stand-in forward (None) while the others finish. One all-reduce per batch."""
    it = iter(batches)
    while True:
        batch = next(it, None)
        left = torch.tensor([0.0 if batch is None else 1.0], device=dev)
        dist.all_reduce(left)
        if left.item() == 0:
            return
        yield batch


# --- checkpoint_format='dcp': sharded folders --------------------------------------------------------------


EXTRA = "extra.pt"  # in a dcp folder: the checkpoint's keys but model and optimizer (rank 0, torch.save)


def save_dcp(path, model, optimizer, extra):
    """Write `path` (a folder) with torch.distributed.checkpoint: this rank's shards of the model (and of
    the optimizer, unless None), and `extra` (the checkpoint's other keys: checkpoint.CKPT_KEYS's small ones) in
    path/extra.pt. Collective. Atomic as a folder: written to path.tmp, then renamed over the old one by rank 0."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    tmp = path + ".tmp"
    if dist.get_rank() == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)
    dist.barrier()
    dcp.save(state, checkpoint_id=tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        torch.save(extra, os.path.join(tmp, EXTRA))
        old = path + ".old"
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def load_dcp(path, model, optimizer=None):
    """Load a save_dcp folder into a sharded GPT (and its AdamW): each rank reads its own rows. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def load_dcp_extra(path):
    """The small keys of a save_dcp folder (all but model and optimizer), model_args under today's names as
    checkpoint.load_checkpoint gives them. Raises UserError if it has none."""
    file = os.path.join(path, EXTRA)
    if not os.path.isfile(file):
        raise UserError(f"{path} is not a dcp checkpoint of this repo (no {EXTRA}); train with checkpoint_format='dcp'")
    extra = torch.load(file, map_location="cpu", weights_only=True)
    if "model_args" in extra:
        extra["model_args"] = current_model_args(extra["model_args"])
    return extra


def dcp_to_single(folder, out_path):
    """Write the single-file checkpoint (checkpoint.py's format, atomically) of a save_dcp folder: every
    tensor whole (torch.distributed.checkpoint.format_utils.dcp_to_torch_save), the optimizer keyed by index.
    One process, no process group. Raises UserError if `folder` is not a dcp checkpoint."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if not os.path.isfile(os.path.join(folder, ".metadata")):
        raise UserError(f"{folder} is not a torch.distributed.checkpoint folder (no .metadata)")
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(out_path))) as tmp:
        flat = os.path.join(tmp, "flat.pt")
        dcp_to_torch_save(folder, flat)
        state = {**torch.load(flat, weights_only=True), **load_dcp_extra(folder)}
    if "optimizer" in state:
        state["optimizer"] = by_index(state["optimizer"])
    with atomic_open(out_path) as f:
        torch.save(state, f)
    return out_path


# --- memory per rank ----------------------------------------------------------------------------------------


def _shard_rows(rows, world, rank=0):
    """Rows of a dim-0 shard that `rank` holds of a tensor with `rows` rows (FSDP2: ceil(rows / world) each,
    the last ranks fewer or none)."""
    per = -(-rows // world)
    return max(0, min(per, rows - rank * per))


def memory_per_rank(model, world, grad_accum=1, reduce_every_micro_step=True):
    """Bytes per rank (rank 0, which holds the most) of fp32 parameters, gradients and AdamW state (two moments
    and a 0-d step per tensor) of `model` (any GPT, a meta-device one is enough: shapes only), at their peak
    inside an optimizer step of grad_accum micro-steps per rank -> {"ddp": {...}, "fsdp": {...}}, each {"params",
    "grads", "optimizer", "total"}. DDP: every rank holds all of it. FSDP: each parameter's dim-0 shard
    (_shard_rows), and its gradient's, where gradients are reduce-scattered after every micro-step
    (reduce_every_micro_step, train.py's fsdp_reduce_every_micro_step) or there is one micro-step; reduced on the
    last of several only, every rank holds whole fp32 gradients until then (FSDP2 accumulates them unsharded), as
    DDP does. The bf16 copy of one Block that FSDP all-gathers for compute (and one Block's unsharded gradients
    while they are reduce-scattered), and activations (activation_bytes), come on top."""
    out = {}
    whole = sum(p.numel() for p in model.parameters())
    for kind, w in (("ddp", 1), ("fsdp", world)):
        n = sum(_shard_rows(p.shape[0], w) * (p.numel() // max(p.shape[0], 1)) for p in model.parameters())
        steps = sum(1 for _ in model.parameters())
        grads = n if reduce_every_micro_step or grad_accum == 1 else whole
        b = {"params": 4 * n, "grads": 4 * grads, "optimizer": 4 * ADAMW_STATES * n + 4 * steps}
        out[kind] = {**b, "total": sum(b.values())}
    return out


def activation_bytes(config, batch_size, block_size, dtype, checkpointing):
    """An estimate of one micro-batch's activations kept for the backward, in bytes per rank (Korthikanti et al.
    2022, "Reducing Activation Recomputation in Large Transformer Models", Eq. 1: 34 s b h bytes per layer at
    16-bit, without the 5 a s^2 b term of a materialised attention matrix, which fused attention never
    stores; fp32 doubles it). With activation checkpointing, each layer keeps only its input (s b h values)
    and one layer at a time is recomputed in full. Plus the logits: the compute-dtype ones and their fp32 copy
    for the loss (s b V each)."""
    e = 4 if dtype == "float32" else 2
    sbh = batch_size * block_size * config.n_embd
    layer = 17 * sbh * e
    kept = config.n_layer * (sbh * e if checkpointing else layer) + (layer if checkpointing else 0)
    return kept + batch_size * block_size * config.vocab_size * (e + 4)


def grad_bytes(model):
    """Bytes of gradients this rank holds now: every parameter's local .grad (a DTensor's shard under FSDP), plus
    the whole (unsharded) gradients FSDP2 keeps between micro-steps that do not reduce-scatter
    (set_requires_gradient_sync(False)). Those live in FSDP's private FSDPParam fields (unsharded_accumulated_grad,
    _unsharded_param.grad; torch 2.6 to 2.15), read where present; a torch that moved them counts 0 for them. Each
    tensor counts once: torch 2.15's unsharded_accumulated_grad is a property returning _unsharded_param.grad."""

    def size(t):
        if t is None:
            return 0
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()  # not its storage's: FSDP's shards are views of one flat buffer

    total = sum(size(p.grad) for p in model.parameters())
    seen = set()
    for module in model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        group = getattr(state, "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()):
            for t in (
                getattr(fsdp_param, "unsharded_accumulated_grad", None),
                getattr(getattr(fsdp_param, "_unsharded_param", None), "grad", None),
            ):
                key = None if t is None else (t.data_ptr(), t.numel(), t.dtype)
                if key is not None and key not in seen:  # the same whole gradient under two names counts once
                    seen.add(key)
                    total += size(t)
    return total


def measured_bytes(model, optimizer):
    """Bytes this rank holds of parameters, gradients and optimizer state, from the local tensors (a DTensor's
    to_local(): its shard) -> {"params", "grads", "optimizer", "total"}. Call it between backward and
    zero_grad for the gradients to count."""

    def local(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = list(model.parameters())
    b = {
        "params": sum(local(p) for p in params),
        "grads": sum(local(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)),
    }
    return {**b, "total": sum(b.values())}


def memory_report(config, world, batch_size, block_size, dtype, checkpointing, grad_accum=1, reduce_every=True):
    """The lines train.py prints at start: bytes per rank of parameters, gradients and AdamW state under DDP
    and under FSDP at this world size (memory_per_rank, grad_accum micro-steps per rank, FSDP's gradients reduced
    after every micro-step or on the last only as reduce_every says), what the other choice would cost where there
    are several micro-steps, and the activation estimate (activation_bytes)."""
    from model import GPT

    with torch.device("meta"):
        model = GPT(config)
    m = memory_per_rank(model, world, grad_accum, reduce_every)
    lines = [f"memory per rank at world {world} (fp32 master weights, AdamW):"]
    for kind in ("ddp", "fsdp"):
        b = m[kind]
        lines.append(
            f"  {kind.upper():4s} params {gib(b['params'])}, grads {gib(b['grads'])}, optimizer "
            f"{gib(b['optimizer'])}: {gib(b['total'])}"
        )
    if grad_accum > 1:
        lines.append(fsdp_reduce_choices(model, world, grad_accum, reduce_every))
    act = activation_bytes(config, batch_size, block_size, dtype, checkpointing)
    lines.append(
        f"  activations of one micro-batch ({batch_size} x {block_size}, {dtype}, activation checkpointing "
        f"{'on' if checkpointing else 'off'}): ~{gib(act)} (estimate)"
    )
    return "\n".join(lines)


def fsdp_reduce_choices(model, world, grad_accum, reduce_every):
    """Three lines: what FSDP's two gradient-reduction choices cost per rank and step at grad_accum micro-steps per
    rank: gradient bytes at their peak (memory_per_rank) and reduce-scatters (one per FSDP group, n_layer Blocks
    and the root, per reduction), for fsdp_reduce_every_micro_step=True and False; the run's choice marked."""
    groups = len(model.transformer.h) + 1
    cost = {
        every: (
            memory_per_rank(model, world, grad_accum, every)["fsdp"]["grads"],
            groups * (grad_accum if every else 1),
        )
        for every in (True, False)
    }
    text = {True: "reduce-scatter after every micro-step", False: "on the last micro-step only (whole fp32 grads)"}
    lines = [f"  FSDP with {grad_accum} micro-steps per rank (fsdp_reduce_every_micro_step), per step:"]
    for e in (True, False):
        mark = ", this run" if e == reduce_every else ""
        lines.append(f"    {e}{mark}: {text[e]}: grads {gib(cost[e][0])}, {cost[e][1]} reduce-scatters")
    return "\n".join(lines)


def gib(n):
    return f"{n / 2**30:.2f} GiB" if n >= 2**27 else f"{n / 2**20:.2f} MiB"


@exit_on_user_error
def main(argv):
    if len(argv) != 2:
        raise UserError("usage: python sharding.py FOLDER.dcp OUT.pt (a dcp checkpoint folder -> one file)")
    print(f"wrote {dcp_to_single(*argv)}")


if __name__ == "__main__":
    main(sys.argv[1:])
