"""Context parallelism (CP): one sequence split across the ranks of a cp group, for contexts past one GPU's memory.

train.py's `context_parallel_degree` (cp, default 1) comes here. The world is dp x cp ranks, a 2-D DeviceMesh named
("dp", "cp") (rank = dp_rank * cp + cp_rank: a cp group is cp consecutive ranks, one node's GPUs where cp divides
them). FSDP2 shards parameters over both dimensions flattened ("dp_cp", torchtitan's dp_shard_cp); DDP averages
gradients over every rank. Every rank of a cp group reads the same batch rows (the data is dealt by dp rank) and
keeps its own slice of the sequence:

    ContextParallel.shard   head-tail load balancing (PyTorch's _HeadTailLoadBalancer and _context_parallel_shard,
                            as torchtitan uses them): the sequence of T tokens is cut into 2 cp chunks of T / (2 cp)
                            and cp rank i keeps chunks i and 2 cp - 1 - i, so under a causal mask every rank does the
                            same attention work. Inputs, targets and positions are sharded alike; positions stay
                            global (a token keeps its position in the whole sequence).
    CPBatch.attention       each rank forms its own tokens' queries and keys (RoPE rotated at their global
                            positions; PoPE raw: pope_attention forms q~, k~ from the positions),
                            all-gathers k and v over the cp group with PyTorch's autograd-aware collective
                            (cplib::flex_cp_allgather, the one FlexAttention's CP uses: an all-gather whose backward
                            reduce-scatters the gradients), puts the gathered keys back in global order, and runs
                            each of its two query chunks against the keys 0..(chunk end) with the chunk's own
                            q_offset, through the layer's own attention (CausalSelfAttention.attend: the Triton
                            kernel, SDPA with a boolean mask, flex). Causal tiles past a chunk's end are never
                            computed, so the attention work per rank is 1/cp.
    CPBatch.loss            the mean over the whole sequence's non-ignored targets: each rank's sum and count are
                            reduced over the cp group, so ignored targets falling unevenly cannot bias it.

Why PoPE gathers raw keys (d wide) rather than k~ (2d wide): pope_attention (either backend) takes raw keys and
forms k~ itself from each key's position and delta, so raw keys are what it needs, at half the bytes; each chunk's
call forms k~ of its key range from the gathered raw keys (O(T d) pointwise work per rank, small next to the
O(T^2 d / cp) attention). delta's gradient is then each rank's share, summed by FSDP's / DDP's gradient reduction
like every other parameter's.

Communication per layer and step (B rows, T tokens, n_kv_head heads of width d, b bytes per element): the forward
all-gather of k and v brings (cp - 1) / cp * B T n_kv_head 2 d b bytes to each rank; the backward reduce-scatters
their gradients, the same bytes; under activation checkpointing the backward's recompute gathers once more.
communication() counts them against the attention FLOPs; docs/usage.md ("Past one GPU's context") puts numbers on it.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cli import UserError

CP_BACKENDS = ("gloo", "nccl")  # process-group backends whose all-gather / reduce-scatter CP's collectives use


def check_settings(cp, world_size, in_group, block_size=None, backend=None, compile=False):
    """Refuse, in one line (UserError, exit 2), a context_parallel_degree this run cannot honour: not a positive
    integer; cp > 1 in a single process (no torchrun) or with a world size it does not divide; a block_size not
    divisible by 2 cp (head-tail load balancing cuts the sequence into 2 cp equal chunks); a process-group backend
    other than gloo or nccl; torch.compile (the CP step runs eagerly here: its collectives and per-chunk Python are
    untested under Dynamo). block_size None and backend None skip their checks."""
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise UserError(f"context_parallel_degree must be a positive integer, got {cp!r}")
    if cp == 1:
        return
    if not in_group:
        raise UserError(
            f"context_parallel_degree={cp} splits each sequence across {cp} processes: launch with "
            f"torchrun --nproc_per_node=<a multiple of {cp}>, or set context_parallel_degree=1"
        )
    if world_size % cp:
        raise UserError(
            f"context_parallel_degree={cp} must divide the {world_size} processes (world = dp x cp): use "
            f"a divisor of {world_size}, or launch a multiple of {cp} processes"
        )
    if block_size is not None and block_size % (2 * cp):
        raise UserError(
            f"block_size={block_size} must be divisible by 2 x context_parallel_degree = {2 * cp} (head-tail load "
            f"balancing cuts each sequence into {2 * cp} equal chunks): use e.g. block_size="
            f"{max(2 * cp, block_size // (2 * cp) * 2 * cp)}"
        )
    if backend is not None and backend not in CP_BACKENDS:
        raise UserError(
            f"context_parallel_degree={cp} needs all-gather and reduce-scatter of the process group: backend "
            f"{backend!r} is not one of {CP_BACKENDS}"
        )
    if compile:
        raise UserError(
            f"context_parallel_degree={cp} runs eagerly: set compile=False (CP under torch.compile is not tested yet)"
        )


class ContextParallel:
    """The run's dp x cp layout: `mesh` (2-D DeviceMesh ("dp", "cp")), `cp_mesh` (this rank's cp group),
    `fsdp_mesh` (both flattened: FSDP2 shards parameters over every rank), the degrees dp, cp and this rank's
    dp_rank, cp_rank. Needs an initialised process group of dp x cp ranks (check_settings first)."""

    def __init__(self, cp, device_type):
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        self.cp, self.dp = cp, world // cp
        self.mesh = init_device_mesh(device_type, (self.dp, cp), mesh_dim_names=("dp", "cp"))
        self.cp_mesh = self.mesh["cp"]
        self.fsdp_mesh = self.mesh["dp", "cp"]._flatten("dp_cp")
        self.dp_rank, self.cp_rank = self.mesh.get_local_rank("dp"), self.mesh.get_local_rank("cp")
        self._balancers = {}  # (T, device) -> (the head-tail load balancer, its restore index)

    def can_shard(self, T):
        """True if a sequence of T tokens splits into 2 cp equal chunks (an evaluation's shorter tail window may
        not: its cp group then runs it whole, each rank alike)."""
        return T % (2 * self.cp) == 0

    def shard(self, x, y=None, document_ids=None, position_ids=None):
        """This rank's slice of a batch the whole cp group read: x, y (B, T) int64 -> (x_local, y_local or None,
        {"cp": CPBatch}), x_local (B, T / cp) holding chunks cp_rank and 2 cp - 1 - cp_rank of 2 cp (head-tail);
        the dict is the model's keyword arguments (the batch's document_ids (B, T) int32 and position_ids (B, T) int64,
        or None, ride inside the CPBatch, whole: every rank needs the keys' ids and positions). Raises ValueError if
        T is not divisible by 2 cp."""
        from torch.distributed.tensor.experimental._context_parallel import (
            _context_parallel_shard,
            _HeadTailLoadBalancer,
        )

        B, T = x.shape
        if not self.can_shard(T):
            raise ValueError(f"context parallelism cuts T into 2 x cp = {2 * self.cp} chunks; T = {T} does not divide")
        positions = position_ids if position_ids is not None else torch.arange(T, device=x.device).expand(B, T)
        buffers = [x, positions] + ([y] if y is not None else [])
        if (T, x.device) not in self._balancers:  # built once per length: a step's micro-batches share them
            balancer = _HeadTailLoadBalancer(T, self.cp, x.device)
            restore = balancer._generate_indices(restore=True)[0].long()  # gathered (rank order) -> global order
            self._balancers[(T, x.device)] = balancer, restore
        balancer, restore = self._balancers[(T, x.device)]
        # (it also sets _context_parallel's module options, read only by its own SDPA dispatcher, which stays off)
        local = _context_parallel_shard(self.cp_mesh, buffers, [1] * len(buffers), load_balancer=balancer)
        plan = CPBatch(self, T, local[1].contiguous(), document_ids, position_ids, restore)
        return local[0], (local[2] if y is not None else None), {"cp": plan}


class CPBatch:
    """One batch under context parallelism: what every layer's attention and the loss need (GPT.forward's cp).

    T: the whole sequence's tokens; chunk = T / (2 cp); starts: the global positions of this rank's two chunks
    (q_offsets); positions (B, T / cp) int64: this rank's tokens' global positions; document_ids (B, T) int32 /
    position_ids (B, T) int64: the whole batch's, or None; restore (T,) int64: the gathered keys' order -> global.
    The chunks' masks (and ALiBi's bias) are built on first use and shared by every layer of this forward (and by a
    recompute)."""

    def __init__(self, layout, T, positions, document_ids, position_ids, restore):
        self.cp, self.cp_rank, self.group = layout.cp, layout.cp_rank, layout.cp_mesh.get_group()
        self.T, self.chunk = T, T // (2 * layout.cp)
        self.starts = (self.cp_rank * self.chunk, (2 * layout.cp - 1 - self.cp_rank) * self.chunk)
        self.positions, self.document_ids, self.position_ids, self.restore = (
            positions,
            document_ids,
            position_ids,
            restore,
        )
        self._masks = {}
        self._kernel_masks = False

    def local_index(self):
        """(T / cp,) int64: the global index of each of this rank's tokens (its two chunks, in order)."""
        dev = self.positions.device
        return torch.cat([torch.arange(s, s + self.chunk, device=dev) for s in self.starts])

    def documents(self, model, idx, kv_cache, document_ids, position_ids):
        """The Documents every layer of `model` (a GPT) gets for this rank's tokens idx (B, T / cp): their global
        positions, this CPBatch. Checks the whole batch's ids once, grows the rotation table to the largest global
        position (a key on another rank may have it). Raises ValueError for a kv_cache, for ids passed besides cp,
        and for bad ids (pope.check_document_ids)."""
        from model import Documents
        from pope import check_document_ids, check_positions

        if kv_cache is not None or document_ids is not None or position_ids is not None:
            raise ValueError("under context parallelism the ids travel in cp (ContextParallel.shard); no kv_cache")
        B = idx.shape[0]
        if idx.shape[1] * self.cp != self.T:
            raise ValueError(f"idx has {idx.shape[1]} tokens; this rank's slice of T = {self.T} is {self.T // self.cp}")
        check_document_ids(self.document_ids, self.position_ids, B, self.T, idx.device)
        n_positions = self.T
        if self.position_ids is not None:
            check_positions(self.position_ids, 2**62)  # >= 0
            n_positions = max(n_positions, int(self.position_ids.max()) + 1)
        model.ensure_positions(n_positions)
        self._kernel_masks = model._pope_kernel(idx.device)  # the Triton kernel masks from the ids itself
        return Documents(None, self.positions, None, self)

    def _chunk_documents(self, attn, j, end, dtype):
        """Documents for query chunk j (queries at starts[j].., keys 0..end-1) or None, its mask built on the first
        layer's call and shared by the others (autograd then saves one copy for every layer): the documents' mask,
        or for ALiBi its float bias in the queries' dtype, (1, n_head, chunk, end) causal (without CP attend builds
        the causal bias itself, in every layer) or (B, n_head, chunk, end) under the documents' mask."""
        from model import Documents, alibi_bias, alibi_document_bias
        from pope import document_mask

        ids = None if self.document_ids is None else self.document_ids[:, :end]
        pos = None if self.position_ids is None else self.position_ids[:, :end]
        alibi = attn.config.pos_encoding == "alibi_half"
        if ids is None and pos is None and not alibi:
            return None
        mask = None
        if alibi or (ids is not None and not self._kernel_masks):
            key = (j, alibi, dtype if alibi else None)
            if key not in self._masks:
                if ids is None:  # ALiBi, causal
                    mask = alibi_bias(attn.alibi_slopes, self.chunk, end, q_offset=self.starts[j]).unsqueeze(0)
                else:
                    mask = document_mask(ids, self.chunk, self.starts[j])
                    if alibi and isinstance(mask, torch.Tensor):
                        mask = alibi_document_bias(attn.alibi_slopes, mask, self.starts[j])
                self._masks[key] = mask.to(dtype) if alibi and isinstance(mask, torch.Tensor) else mask
            mask = self._masks[key]
        return Documents(ids, pos, mask)

    def gather(self, k, v):
        """k, v (B, H_kv, T / cp, d) of this rank's tokens -> the cp group's, (B, H_kv, T, d) in global token order.
        PyTorch's cplib::flex_cp_allgather: an all-gather over the cp group whose backward reduce-scatters (sums)
        the gathered keys' and values' gradients back to the ranks that own them. (In torch 2.13
        _functional_collectives.all_gather_tensor is deprecated for all_gather_single; flex_cp_allgather calls
        all_gather_single on k and v inside one custom op, with a fake kernel for torch.compile and its backward,
        a reduce-scatter, registered: the op FlexAttention's CP uses. Checked: gradients equal the whole sequence's,
        tests/test_context_parallel.py.)"""
        from torch.distributed.tensor.experimental._context_parallel import flex_cp_allgather

        k_all, v_all = flex_cp_allgather(k.contiguous(), v.contiguous(), 2, self.group.group_name)
        return k_all.index_select(2, self.restore), v_all.index_select(2, self.restore)

    def attention(self, attn, q, k, v, rotation):
        """A layer's attention under CP. attn: its CausalSelfAttention; q (B, n_head, T / cp, d), k, v (B, n_kv_head,
        T / cp, d) for this rank's tokens (RoPE's rotated at their global positions, PoPE's raw); rotation: the
        model's table. -> (B, n_head, T / cp, d): each query chunk at its q_offset over the gathered keys up to its
        end (later keys are all masked, so never read), through attn.attend."""
        k_all, v_all = self.gather(k, v)
        out = []
        for j, start in enumerate(self.starts):
            end = start + self.chunk
            qj = q[:, :, j * self.chunk : (j + 1) * self.chunk]
            docs = self._chunk_documents(attn, j, end, q.dtype)
            out.append(attn.attend(qj, k_all[:, :, :end], v_all[:, :, :end], start, rotation, docs))
        return torch.cat(out, dim=2)

    def loss(self, logits, targets):
        """Mean cross-entropy (nats) over the whole sequence's targets != -1, from this rank's logits (B, T / cp, V)
        and targets (B, T / cp): the cp group's sums and counts all-reduced (one collective). The value is the
        global mean on every rank; its gradient is cp x this rank's share (sum / global count), which the mean over
        ranks of FSDP's / DDP's gradient reduction turns into the global mean's gradient (the all-gather's backward
        carries every rank's share to the keys and values it owns). No target at all gives nan, as F.cross_entropy."""
        flat = targets.reshape(-1)
        total = F.cross_entropy(logits.float().view(-1, logits.size(-1)), flat, ignore_index=-1, reduction="sum")
        sums = torch.stack([total.detach().double(), (flat != -1).sum().double()])  # float64: counts past 2^24
        dist.all_reduce(sums, group=self.group)
        share = total / sums[1].to(total.dtype)
        return self.cp * share + ((sums[0] / sums[1]).to(total.dtype) - self.cp * share).detach()


def gathered_kv_bytes(config, batch_size, block_size, bytes_per_element):
    """Bytes of one layer's gathered keys and values on every rank: (B, n_kv_head, T, d) each, the whole sequence's,
    whatever cp is (raw keys for PoPE, rotated for RoPE; d = head_dim)."""
    d = config.n_embd // config.n_head
    return 2 * batch_size * (config.n_kv_head or config.n_head) * block_size * d * bytes_per_element


def activation_bytes(config, batch_size, block_size, cp, bytes_per_element, gathered=True):
    """Bytes one rank keeps for the backward of one micro-batch (B rows of T tokens, this rank's T / cp of each) on
    the torch attention path (SDPA; the Triton kernel saves less), counted from what this implementation saves
    (storages of torch.autograd.graph.saved_tensors_hooks, parameters and the model's tables left out; the test
    measures it). Per layer and local token, in elements: 15 n_embd + 2 (block input, RMSNorm outputs and their
    rstd, c_attn and c_proj inputs, the MLP's 4 n_embd twice) + the qkv projection (n_head + 2 n_kv_head) d; the
    attention's own, with H = n_head, K = n_kv_head:
        cp = 1  PoPE: q~, k~ (2d wide), v padded to 2d, its output (2d) and logsumexp: 4 H d + 4 K d + H
                RoPE: rotated q, k, output, logsumexp: 2 H d + K d + H
        cp > 1  local: PoPE 4 H d + H (q~, output, logsumexp), RoPE 2 H d + H (and, once for every layer, the
                positions' rotation rows: d columns for RoPE, d / 2 for rope_half, float32 whatever
                bytes_per_element, as the model's table is);
                gathered, per row of the batch: k and v of the whole sequence (2 K d T), and PoPE's k~ and padded v
                of each chunk's key range, 4 K d (end_0 + end_1) with end_0 + end_1 = T (2 cp + 1) / (2 cp); plus the
                chunks' boolean causal masks (chunk x end bytes each, the CPU SDPA path's)
    Then the head: ln_f and the logits' log-softmax, T (e (3 n_embd + vocab + 1) + 8) per row. Encodings other than
    PoPE and RoPE are counted as RoPE (their attention saves about as much, ALiBi's float bias aside). gathered=False
    leaves out (cp > 1) what is the whole sequence's on every rank: the gathered k, v, k~, padded v and the masks.
    With activation checkpointing (sharding.checkpoint_blocks) a rank keeps each layer's input instead (n_embd per
    local token and layer) and, at the backward's peak, one layer's bytes of this estimate (its recompute, whose
    all-gather runs again)."""
    e, B, T = bytes_per_element, batch_size, block_size
    C, H, V, L = config.n_embd, config.n_head, config.vocab_size, config.n_layer
    K, d = config.n_kv_head or H, C // H
    n = B * T // cp  # this rank's tokens
    pope = config.pos_encoding == "pope"
    layer = n * (15 * C + 2 + (H + 2 * K) * d) * e
    if cp == 1:
        layer += n * ((4 * H * d + 4 * K * d + H) if pope else (2 * H * d + K * d + H)) * e
        layer += 2 * K * d * e if pope else 0  # cos, sin of delta
    elif not gathered:
        layer += n * ((4 * H * d + H) if pope else (2 * H * d + H)) * e
    else:
        chunk = T // (2 * cp)
        ends = chunk * (2 * cp + 1)  # end_0 + end_1 (the same on every rank)
        layer += n * ((4 * H * d + H) if pope else (2 * H * d + H)) * e
        layer += 2 * B * K * d * T * e  # the gathered k, v
        layer += (4 * B * K * d * ends * e + 2 * 2 * K * d * e) if pope else 0  # k~, padded v per chunk; delta
        layer += chunk * ends  # causal masks (bool)
    head = n * (e * (3 * C + V + 1) + 8) + e
    n_rot = {"rope": d, "rope_half": d // 2}.get(config.pos_encoding, 0)
    rows = n * n_rot * 4 if cp > 1 else 0  # RoPE's rotation rows at the rank's global positions (the fp32 table's)
    return L * layer + head + rows + (8 * T if cp > 1 and gathered else 0)  # + the restore index


def memory_report(config, batch_size, block_size, cp, dtype, checkpointing=False):
    """The lines train.py prints on rank 0 under CP: the tokens each rank keeps, one layer's gathered keys and values,
    the per-rank activation estimate (activation_bytes) at this cp next to cp = 1, and with activation checkpointing
    what a rank keeps then (each layer's input) and its peak in the backward (plus one layer's recompute)."""
    from dataclasses import replace

    from sharding import gib

    e = 4 if dtype == "float32" else 2
    kv = gathered_kv_bytes(config, batch_size, block_size, e)
    act, one = (activation_bytes(config, batch_size, block_size, c, e) for c in (cp, 1))
    lines = [
        f"context parallel: cp {cp}, each rank keeps {block_size // cp} of {block_size} tokens per row (chunks of "
        f"{block_size // (2 * cp)}, head-tail); one layer's gathered keys and values {gib(kv)} ({batch_size} x "
        f"{block_size} x {config.n_kv_head or config.n_head} kv heads x {config.n_embd // config.n_head} x 2, "
        f"{dtype})",
        f"  activations per rank (estimate, torch attention path): ~{gib(act)} at cp {cp}, ~{gib(one)} at cp 1",
    ]
    if checkpointing:
        head = activation_bytes(replace(config, n_layer=0), batch_size, block_size, cp, e)
        layer = activation_bytes(replace(config, n_layer=1), batch_size, block_size, cp, e) - head
        kept = config.n_layer * batch_size * block_size // cp * config.n_embd * e + head
        lines.append(
            f"  with activation checkpointing: ~{gib(kept)} kept (each layer's input), ~{gib(kept + layer)} at the "
            "backward's peak (one layer recomputed, its all-gather included)"
        )
    return "\n".join(lines)


def communication(config, batch_size, block_size, cp, bytes_per_element, checkpointing=False):
    """One layer's cost per rank and step under CP -> dict: bytes each rank receives in the forward all-gather of
    k and v ("allgather": (cp - 1) / cp of B T n_kv_head 2 d b; PoPE gathers raw keys, d wide, not k~), in the
    backward reduce-scatter of their gradients ("reduce_scatter", the same), in the recompute's all-gather under
    activation checkpointing ("recompute", the same or 0), their sum ("total"); and the rank's causal attention FLOPs
    ("flops_fwd": B n_head T^2 / 2 (d_qk + d_v) 2 / cp, d_qk = 2d for PoPE's Cartesian scores; "flops_step": forward,
    backward at 2.5 x forward as FlashAttention-2 counts it, and the recompute's forward under checkpointing)."""
    H, K, d = config.n_head, config.n_kv_head or config.n_head, config.n_embd // config.n_head
    moved = (cp - 1) * batch_size * block_size * K * 2 * d * bytes_per_element // cp
    d_qk = 2 * d if config.pos_encoding == "pope" else d
    fwd = 2 * batch_size * H * block_size**2 / 2 * (d_qk + d) / cp
    out = {"allgather": moved, "reduce_scatter": moved, "recompute": moved if checkpointing else 0}
    out["total"] = sum(out.values())
    out.update(flops_fwd=fwd, flops_step=fwd * (3.5 + (1 if checkpointing else 0)))
    return out
