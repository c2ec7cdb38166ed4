"""A GPT with a switch between RoPE, PoPE and no positional encoding.

GPT-2 (pre-norm blocks, GELU MLP, tied token embedding / lm_head) with the paper's one change:
RMSNorm instead of LayerNorm. `pos_encoding` picks how attention sees positions:

    'rope'  RoFormer rotary embedding on d/2 channel pairs, frequencies rope_theta^(-2(c-1)/d)
    'pope'  Polar Coordinate Position Embedding (paper, Method section): d frequencies
            rope_theta^(-(c-1)/d), magnitudes softplus(q), softplus(k), a learnable per-head phase
            bias delta (n_head, head_dim) in radians kept in [-2*pi, 0]; see pope.py
    'none'  no positional encoding (NoPE): causal masking is the only source of order

Baselines of the paper's appendix (indirect indexing, Table "additional baselines"):

    'rope_half'   RoPE on the first half of each head's channels (pairs (c, c + d/4), frequencies
                  rope_theta^(-4c/d)); the other half is not rotated
    'alibi_half'  ALiBi (Press et al. 2022) on the first n_head/2 heads, with the standard geometric
                  slopes for n_head/2 heads (alibi_slopes); the other heads get no positional signal
    'learned'     absolute position embeddings (block_size rows) added to the token embeddings
    'sinusoidal'  the fixed absolute embedding of Vaswani et al. 2017 added to the token embeddings
                  (amplitude 1, token embeddings unscaled: at init position outweighs content)

RoPE models can run with YaRN frequencies (Peng et al. 2024, "YaRN: Efficient Context Window
Extension"): rope_scaling = s = L'/L > 1 and rope_original_block_size = L; see rope_frequencies. Two ramps
(rope_yarn_ramp): 'code', the released YaRN code's and Hugging Face's (linear in the pair index), and
'paper', the paper's equation (linear in r = L / lambda); yarn_gamma.

Attention logits are scaled by 1/sqrt(head_dim) for every encoding (for PoPE, head_dim is d, not
the 2d of its Cartesian form). Relative encodings have no maximum length: sequences longer than
block_size are accepted, because evaluating beyond the training length is part of the point.
Absolute encodings ('learned', 'sinusoidal') have no row for a position >= block_size and raise
ValueError there.
"""

import inspect
import math
import re
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from pope import (
    check_document_ids,
    decode_step_backend,
    document_mask,
    masked_attention,
    pope_attention,
    pope_attention_decode,
    pope_backend,
    pope_decode_step,
    pope_key_magnitude,
    pope_rotation_table,
    sdpa_attention,
    sdpa_gqa,
)

POS_ENCODINGS = ("rope", "pope", "none", "rope_half", "alibi_half", "learned", "sinusoidal")
ABSOLUTE_ENCODINGS = ("learned", "sinusoidal")  # positions < block_size only


@dataclass
class GPTConfig:
    block_size: int = 1024  # training context in tokens
    vocab_size: int = 50304  # GPT-2's 50257 rounded up to a multiple of 64
    n_layer: int = 12
    n_head: int = 12  # query heads
    n_kv_head: int | None = None  # key/value heads (grouped-query attention; 1 = MQA); None = n_head
    n_embd: int = 768
    dropout: float = 0.0  # on embeddings and residual branches (not on attention probabilities)
    bias: bool = False  # biases in Linear layers
    pos_encoding: str = "pope"  # 'rope' | 'pope' | 'none' | 'rope_half' | 'alibi_half' | 'learned' | 'sinusoidal'
    rope_theta: float = 10000.0  # frequency base for both RoPE and PoPE
    pope_delta_init: str = "uniform"  # 'zero' | 'uniform' (on [-2*pi, 0])
    pope_magnitude: str = "softplus"  # 'softplus' (paper) | 'relu' | 'identity' (ablations, Table "PoPE ablations")
    pope_use_delta: bool = True  # learnable phase bias delta on; False is the "no delta" ablation
    attn_backend: str = "auto"  # pope_attention backend: 'auto' | 'triton' | 'torch'
    rope_scaling: float = 1.0  # YaRN scale s = L'/L for 'rope'; 1.0 = plain RoPE
    rope_original_block_size: int = 0  # YaRN's L: the context (tokens) the RoPE model was trained at
    rope_yarn_ramp: str = "code"  # YaRN's ramp: 'code' (released code, HF) | 'paper' (checkpoints without it)

    def __post_init__(self):
        if self.pos_encoding not in POS_ENCODINGS:
            raise ValueError(f"pos_encoding must be one of {POS_ENCODINGS}, got {self.pos_encoding!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        kv = self.n_kv_head
        if kv is not None and not (type(kv) is int and 0 < kv <= self.n_head and self.n_head % kv == 0):
            raise ValueError(
                f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head}: each key/value head "
                "serves n_head // n_kv_head query heads (None means n_head, no grouping)"
            )
        if self.pos_encoding == "rope" and (self.n_embd // self.n_head) % 2:
            raise ValueError("RoPE needs an even head_dim (n_embd // n_head)")
        if self.pos_encoding == "rope_half" and (self.n_embd // self.n_head) % 4:
            raise ValueError("rope_half rotates half of each head: head_dim (n_embd // n_head) must be a multiple of 4")
        if self.pos_encoding == "alibi_half" and self.n_head < 2:
            raise ValueError("alibi_half puts ALiBi on half of the heads: n_head must be >= 2")
        if self.pos_encoding == "sinusoidal" and self.n_embd % 2:
            raise ValueError("the sinusoidal embedding pairs sin and cos channels: n_embd must be even")
        if self.pope_delta_init not in ("zero", "uniform"):
            raise ValueError(f"pope_delta_init must be 'zero' or 'uniform', got {self.pope_delta_init!r}")
        if self.pope_magnitude not in ("softplus", "relu", "identity"):
            raise ValueError(f"pope_magnitude must be softplus, relu or identity, got {self.pope_magnitude!r}")
        if self.rope_yarn_ramp not in YARN_RAMPS:
            raise ValueError(f"rope_yarn_ramp must be 'code' or 'paper', got {self.rope_yarn_ramp!r}")
        if not self.rope_scaling >= 1.0:
            raise ValueError(f"rope_scaling (YaRN's s = L'/L) must be >= 1, got {self.rope_scaling}")
        if self.rope_scaling != 1.0:
            if self.pos_encoding != "rope":
                raise ValueError(f"rope_scaling (YaRN) applies to pos_encoding='rope' only, not {self.pos_encoding!r}")
            if self.rope_original_block_size <= 0:
                raise ValueError(
                    "rope_scaling > 1 needs rope_original_block_size > 0: the context the RoPE "
                    "model was trained at (YaRN's L)"
                )


# Old GPTConfig field -> its name now. Config files, --key=value and checkpoints' model_args written
# with the old name still load (configurator.configure, checkpoint.load_checkpoint).
RENAMED_FIELDS = {"pope_delta": "pope_use_delta"}  # the bool; pope_delta is the attention's parameter


DECODE_RECOMPILE_LIMIT = 64  # compiles of GPT.decode_step allowed per process (compiled_decode_step)
YARN_ALPHA, YARN_BETA = 1.0, 32.0  # YaRN ramp bounds in rotations per original context (paper's LLaMA values)
YARN_RAMPS = ("code", "paper")  # rope_yarn_ramp: see yarn_gamma


def yarn_ramp(r, alpha=YARN_ALPHA, beta=YARN_BETA):
    """YaRN's ramp gamma(r): 0 for r < alpha, 1 for r > beta, linear in between (Peng et al. 2024,
    "NTK-by-parts" interpolation, used by YaRN).

    r: tensor of r_i = L / lambda_i, the number of full rotations of pair i within the original
    context L. Returns a tensor of r's shape and dtype in [0, 1].
    """
    return ((r - alpha) / (beta - alpha)).clamp(0.0, 1.0)


def yarn_correction_range(head_dim, rope_theta, original_block_size, alpha=YARN_ALPHA, beta=YARN_BETA):
    """(low, high): the integer pair indices between which the released YaRN code's ramp runs (its
    find_correction_range; Hugging Face's _compute_yarn_parameters). Pair i turns r_i = L theta_i / (2 pi)
    times within L, theta_i = rope_theta^(-2i/head_dim); r_i = n at the fractional index
    i(n) = head_dim ln(L / (2 pi n)) / (2 ln rope_theta). low = floor(i(beta)) (>= 0), high = ceil(i(alpha))
    (<= head_dim - 1, the code's bound, in channels, not pairs). Head_dim 32, L 256, theta 10^4: (0, 7)."""

    def index(rotations):
        return head_dim * math.log(original_block_size / (2 * math.pi * rotations)) / (2 * math.log(rope_theta))

    return max(math.floor(index(beta)), 0), min(math.ceil(index(alpha)), head_dim - 1)


def yarn_gamma(freqs, rope_theta, original_block_size, ramp="code"):
    """YaRN's gamma_i in [0, 1] per pair (1: keep theta_i, 0: interpolate to theta_i / s), (head_dim/2,)
    like freqs (rope_theta^(-2i/head_dim), radians per token).

    ramp 'paper': yarn_ramp(r_i), linear in r_i = L / lambda_i (Peng et al. 2024, the paper's NTK-by-parts gamma(r)).
    ramp 'code': linear in the pair index i, 1 - clamp((i - low) / (high - low), 0, 1) with (low, high) =
    yarn_correction_range and high = low + 0.001 when equal (the released code's linear_ramp_mask, which
    Hugging Face copies). Head_dim 32, L 256: pair 3 has gamma 0.2015 ('paper') and 4/7 ('code').
    Raises ValueError for another ramp.
    """
    if ramp == "paper":
        return yarn_ramp(original_block_size * freqs / (2 * math.pi))
    if ramp != "code":
        raise ValueError(f"YaRN's ramp is 'code' or 'paper', got {ramp!r}")
    low, high = yarn_correction_range(2 * len(freqs), rope_theta, original_block_size)
    high = high + 0.001 if high == low else high
    i = torch.arange(len(freqs), device=freqs.device, dtype=freqs.dtype)
    return 1 - ((i - low) / (high - low)).clamp(0.0, 1.0)


def yarn_attention_factor(scaling):
    """sqrt(1/t) = 0.1 ln s + 1: YaRN multiplies q and k by it, so the logits by its square
    (Peng et al. 2024, the YaRN attention temperature). 1.0 at s = 1."""
    return 0.1 * math.log(scaling) + 1.0


def rope_frequencies(head_dim, rope_theta=10000.0, scaling=1.0, original_block_size=0, device=None, ramp="code"):
    """RoPE's rotation frequencies, YaRN-scaled when scaling > 1: (head_dim/2,) float64, radians per token.

    Pair i (i = 0 .. head_dim/2 - 1) turns at theta_i = rope_theta^(-2i/head_dim) (RoFormer; rope_theta is
    the base). With YaRN
    (scaling s = L'/L > 1, original_block_size L): wavelength lambda_i = 2 pi / theta_i tokens,
    r_i = L / lambda_i, gamma_i = yarn_gamma(ramp) (ramp 'code' or 'paper'), and
    theta'_i = (1 - gamma_i) theta_i / s + gamma_i theta_i: pairs that turn fewer than alpha = 1 times within L
    are interpolated (theta/s), pairs that turn more than beta = 32 times are kept; between them the ramp
    runs linear in r ('paper') or in i ('code'). At s = 1 this returns theta_i exactly (bit for bit RoPE).
    Raises ValueError for an odd head_dim, s < 1, or s > 1 without L > 0.
    """
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    freqs = rope_theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)
    if scaling == 1.0:
        return freqs
    if scaling < 1.0 or original_block_size <= 0:
        raise ValueError(f"YaRN needs scaling >= 1 and original_block_size > 0, got {scaling}, {original_block_size}")
    gamma = yarn_gamma(freqs, rope_theta, original_block_size, ramp)
    return (1 - gamma) * freqs / scaling + gamma * freqs


def rope_table(n_positions, head_dim, rope_theta=10000.0, scaling=1.0, original_block_size=0, device=None, ramp="code"):
    """RoPE's rotations for positions 0..n_positions-1: (n_positions, head_dim) float32 [cos | sin] of
    s * theta_i radians, theta_i = rope_frequencies(head_dim, rope_theta, scaling, original_block_size, ramp=ramp)
    (YaRN with that ramp when scaling > 1). The phases are formed in float64 and rounded only after cos/sin, so
    the table is exact to float32 at any position (a float32 angle is off by up to ~5e-4 rad at 10k tokens). GPT
    keeps one as a buffer (GPT.rotation): the compiled step reads rows of it and computes no cos/sin."""
    freqs = rope_frequencies(head_dim, rope_theta, scaling, original_block_size, device=device, ramp=ramp)
    angle = torch.arange(n_positions, device=device, dtype=torch.float64)[:, None] * freqs
    return torch.cat((torch.cos(angle), torch.sin(angle)), dim=-1).float()


def rope_rotate(x, table):
    """Rotate channel pairs (c, c + d/2) of x (B, H, T, d) by the rows of `table` (T, d) float32 [cos | sin]
    (rope_table's rows for x's positions), or per-token rows (B, 1, T, d) (position_ids). Computed in float32
    even under bf16 autocast; x's dtype out."""
    h = x.shape[-1] // 2
    with torch.autocast(device_type=x.device.type, enabled=False):
        cos, sin = table[..., :h], table[..., h:]
        x1, x2 = x.float().chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.to(x.dtype)


def apply_rope(x, positions, rope_theta=10000.0, freqs=None):
    """Rotate channel pairs (c, c + d/2) of x (B, H, T, d) by positions * freqs[c] radians.

    positions: (T,) absolute token positions. freqs: (d/2,) radians per token (rope_frequencies);
    default rope_theta^(-2c/d). The angle is formed in float64 and its cos/sin rounded to float32 (at 10k
    tokens the angle reaches 1e4 rad); the rotation runs in float32 even under bf16 autocast (rope_rotate);
    the result has x's dtype. The model reads the same rotations from its table instead (rope_table).
    """
    d = x.shape[-1]
    freqs = rope_frequencies(d, rope_theta, device=x.device) if freqs is None else freqs.double()
    angle = positions.double()[:, None] * freqs  # (T, d/2) radians
    return rope_rotate(x, torch.cat((torch.cos(angle), torch.sin(angle)), dim=-1).float())


def alibi_slopes(n_head):
    """ALiBi's head slopes (Press et al. 2022, section 3): (n_head,) float64, logits per token of distance.

    For n a power of 2: m_h = 2^(-8h/n), h = 1..n (n = 8: 1/2, 1/4, ..., 1/256). Otherwise the
    paper's recipe: the slopes of the largest power of 2 below n, then every other slope of twice that.
    """

    def geometric(n):
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    p = 2 ** int(math.floor(math.log2(n_head)))
    return torch.tensor(geometric(p) + geometric(2 * p)[0::2][: n_head - p], dtype=torch.float64)


def alibi_bias(slopes, Tq, Tk, q_offset=0):
    """Additive causal ALiBi bias (H, Tq, Tk) float32: -slopes[h] * (q_offset + i - j) for keys
    j <= q_offset + i, -inf for later keys. slopes (H,) (0 for a head without ALiBi). Query i sits
    at absolute position q_offset + i, key j at j (the KV-cache convention of sdpa_attention)."""
    dist = (
        torch.arange(q_offset, q_offset + Tq, device=slopes.device, dtype=torch.float32)[:, None]
        - torch.arange(Tk, device=slopes.device, dtype=torch.float32)[None, :]
    )  # (Tq, Tk) tokens
    return (-slopes.float()[:, None, None] * dist).masked_fill(dist < 0, float("-inf"))


def sinusoidal_embedding(n_positions, n_embd):
    """Vaswani et al. 2017, section 3.5: (n_positions, n_embd) float32 with
    PE[p, 2i] = sin(p / 10000^(2i/n_embd)) and PE[p, 2i+1] = cos(p / 10000^(2i/n_embd))."""
    pos = torch.arange(n_positions, dtype=torch.float64)[:, None]
    angle = pos * 10000.0 ** (-torch.arange(0, n_embd, 2, dtype=torch.float64) / n_embd)  # radians
    return torch.stack((torch.sin(angle), torch.cos(angle)), dim=-1).reshape(n_positions, n_embd).float()


def alibi_document_bias(slopes, mask, q_offset=0):
    """ALiBi's bias under a boolean document mask: slopes (n_head,), mask (B, 1, Tq, Tk) bool (document_mask, its
    queries at positions q_offset..) -> (B, n_head, Tq, Tk) float32, -slopes[h] * (q_offset + i - j) where the mask
    allows key j for query i, -inf elsewhere. Built once per forward and shared by every layer (their slopes are
    equal); q_offset > 0 for a context-parallel rank's query chunk (context_parallel.py)."""
    Tq, Tk = mask.shape[-2:]
    return alibi_bias(slopes, Tq, Tk, q_offset).unsqueeze(0).masked_fill(~mask, float("-inf"))


class Documents(NamedTuple):
    """Packed documents of a batch, shared by every layer (GPT.hidden_states builds it once per forward).

    ids: (B, T) int32 non-decreasing document ids (block_causal), or None (position_ids alone: one document per
    row, causal attention). positions: (B, T) int64 position of each token, or None for 0..T-1. mask:
    document_mask(ids): a boolean (B, 1, T, T) tensor (SDPA) or, on CUDA, a FlexAttention BlockMask (tiles
    without a visible pair skipped), for every encoding's attention; for ALiBi instead of the boolean tensor
    its float bias (B, n_head, T, T), -inf where the mask forbids (alibi_document_bias, built once for every
    layer); None without ids (except ALiBi under context parallelism, whose query chunk carries its causal bias,
    (1, n_head, chunk, keys)), and for PoPE with attn_backend='triton' (the kernel masks from the ids).
    cp: under context parallelism (train.py's context_parallel_degree > 1) the batch's context_parallel.CPBatch,
    which every layer's attention goes through (positions are then this rank's tokens' global positions); else None.
    rows: RoPE's (and rope_half's) rotation rows at positions, (B, 1, T, n_rot) (rotation_table's columns), gathered
    once per forward by GPT.hidden_states so that every layer rotates with (and saves for backward) the same tensor;
    None for the other encodings, without positions, or for a Documents built outside GPT.hidden_states."""

    ids: torch.Tensor | None
    positions: torch.Tensor | None
    mask: object
    cp: object = None
    rows: torch.Tensor | None = None


class KVCache:
    """Per-layer key/value cache for incremental decoding, preallocated for max_len tokens.

    Each layer caches n_kv_head key/value heads (GPTConfig.n_kv_head; grouped-query attention shares them
    among n_head // n_kv_head query heads). What it caches per token and key/value head (d = head_dim,
    values always raw and d wide):
      RoPE   rotated keys, d wide: 2d numbers per token with the values.
      NoPE   raw keys, d wide: 2d.
      PoPE   the keys' magnitudes mu = softplus(k) (pope.pope_key_magnitude), d wide: 2d, RoPE's bytes,
             for both backends. PoPE's score mu_q mu_k cos((s - t) theta_c + delta_c) is the real part of
             conj(mu_q e^{i(t theta - delta)}) mu_k e^{i s theta}: delta rides on the query and a key's
             rotation e^{i s theta} is the same for every head and layer, so it is rotated in at attention
             time from the model's one float32 table (GPT.rotation, (>= max_len, 2d), shared by all layers;
             not counted in cache_bytes: 8d bytes per position for the whole model).
    Size of a full cache: n_layer * B * n_kv_head * max_len * 2d elements, for every encoding, in the dtype
    of the keys (the model's activations, or the autocast dtype); cache_bytes gives it.
    `q_offset` is the number of tokens already in the cache = the absolute position of the next token.
    """

    def __init__(self, n_layer, max_len):
        self.n_layer, self.max_len, self.q_offset = n_layer, max_len, 0
        self.k = [None] * n_layer
        self.v = [None] * n_layer

    def cache_bytes(self):
        """Bytes held by the allocated key and value buffers, all layers."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v) if t is not None)

    def write(self, layer, k, v, at):
        """Store k, v (B, H_kv, 1, d) of one token at position `at` (a (1,) int64 tensor) of `layer`'s buffers, which
        a prefill allocated (update); return the whole buffers (B, H_kv, max_len, d): the static-shape decoding
        step (GPT.decode_step) attends over them with the keys after `at` masked. No host sync, no shape change."""
        self.k[layer].index_copy_(2, at, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(2, at, v.to(self.v[layer].dtype))
        return self.k[layer], self.v[layer]

    def update(self, layer, k, v):
        """Append k, v (B, H_kv, T, d) at self.q_offset for `layer`; return all cached (B, H_kv, q_offset + T, d)."""
        B, H, T, d = k.shape
        start, end = self.q_offset, self.q_offset + T
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} tokens; cannot add {T} at position {start}")
        if self.k[layer] is None:  # zeros, not empty: the static step (write) multiplies the unwritten rows by 0
            self.k[layer] = k.new_zeros(B, H, self.max_len, d)
            self.v[layer] = v.new_zeros(B, H, self.max_len, v.shape[-1])
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


def rotation_table(config, n_positions, device=None):
    """The (n_positions, width) float32 table of rotations for positions 0..n_positions-1 that config's encoding
    reads, or None: RoPE rope_table (width head_dim; head_dim/2 for rope_half; YaRN frequencies when
    rope_scaling > 1), PoPE pope_rotation_table (width 2 * head_dim), None for the other encodings."""
    hd = config.n_embd // config.n_head
    if config.pos_encoding in ("rope", "rope_half"):
        n_rot = hd if config.pos_encoding == "rope" else hd // 2
        return rope_table(
            n_positions,
            n_rot,
            config.rope_theta,
            config.rope_scaling,
            config.rope_original_block_size,
            device,
            ramp=config.rope_yarn_ramp,
        )
    if config.pos_encoding == "pope":
        return pope_rotation_table(n_positions, hd, config.rope_theta, device=device)
    return None


def split_heads(qkv, n_head, n_kv_head):
    """The c_attn projection (B, T, (n_head + 2 n_kv_head) head_dim): queries, then keys, then values ->
    q (B, n_head, T, head_dim), k and v (B, n_kv_head, T, head_dim).

    Views of qkv, no copy: their memory order stays (B, T, head, head_dim), so q, k, v are neither
    contiguous nor dense. These are the layouts attention (and its custom ops) receive in training.
    """
    B, T, width = qkv.shape
    hd = width // (n_head + 2 * n_kv_head)
    q, k, v = qkv.split((n_head * hd, n_kv_head * hd, n_kv_head * hd), dim=2)
    q = q.view(B, T, n_head, hd).transpose(1, 2)
    k, v = (t.view(B, T, n_kv_head, hd).transpose(1, 2) for t in (k, v))
    return q, k, v


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.head_dim = config.n_head, config.n_embd // config.n_head
        self.n_kv_head = config.n_kv_head or config.n_head
        # queries (n_head heads), then keys and values (n_kv_head heads each)
        self.c_attn = nn.Linear(config.n_embd, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.config = config
        if config.pos_encoding == "pope" and config.pope_use_delta:
            # one phase per key/value head and channel: delta belongs to the keys, so a group of query
            # heads shares its key head's delta (# assumed: the paper has no grouped-query attention)
            delta = torch.zeros(self.n_kv_head, self.head_dim)
            if config.pope_delta_init == "uniform":
                delta.uniform_(-2 * math.pi, 0.0)
            self.pope_delta = nn.Parameter(delta)  # radians, kept in [-2*pi, 0] by GPT.clamp_pope_delta_
        else:
            self.pope_delta = None
        if config.pos_encoding == "alibi_half":  # slopes on the first n_head // 2 heads, 0 on the rest
            slopes = torch.zeros(config.n_head)
            slopes[: config.n_head // 2] = alibi_slopes(config.n_head // 2).float()
            self.register_buffer("alibi_slopes", slopes, persistent=False)

    def forward(self, x, rotation=None, kv_cache=None, documents=None):
        """x (B, T, n_embd) -> (B, T, n_embd). rotation: the encoding's rotation_table with at least q_offset + T
        rows (GPT passes its buffer GPT.rotation); None builds one for this call. documents: a Documents (packed
        documents: a token attends only to earlier tokens of its own document, at documents.positions), or None
        (causal); not with kv_cache."""
        B, T, C = x.shape
        q, k, v = split_heads(self.c_attn(x), self.n_head, self.n_kv_head)
        q_offset = kv_cache.q_offset if kv_cache is not None else 0
        cfg = self.config
        if rotation is None:
            rotation = rotation_table(cfg, q_offset + T, x.device)
        if cfg.pos_encoding in ("rope", "rope_half"):
            rows = rotation[q_offset : q_offset + T]
            if documents is not None and documents.rows is not None:
                rows = documents.rows  # (B, 1, T, n_rot): each token's own position, gathered once per forward
            elif documents is not None and documents.positions is not None:
                rows = rotation[documents.positions].unsqueeze(1)
            elif rows.shape[0] != T:
                raise ValueError(
                    f"the rotation table has {rotation.shape[0]} rows; positions up to {q_offset + T - 1} "
                    "need more (GPT.ensure_positions)"
                )
            n_rot = rows.shape[-1]
            q, k = (
                torch.cat((rope_rotate(t[..., :n_rot], rows), t[..., n_rot:]), dim=-1)
                if n_rot < self.head_dim
                else rope_rotate(t, rows)
                for t in (q, k)
            )
            if cfg.rope_scaling != 1.0:  # YaRN temperature: logits times (0.1 ln s + 1)^2
                m = yarn_attention_factor(cfg.rope_scaling)
                q, k = q * m, k * m
        if kv_cache is not None and cfg.pos_encoding != "pope":
            k, v = kv_cache.update(self.layer_idx, k, v)
        if documents is not None and documents.cp is not None:  # context parallel: keys gathered from the cp group
            y = documents.cp.attention(self, q, k, v, rotation)
        else:
            y = self.attend(q, k, v, q_offset, rotation, documents, kv_cache)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def attend(self, q, k, v, q_offset, rotation, documents=None, kv_cache=None):
        """Attention of this layer's encoding: q (B, n_head, Tq, d) at positions q_offset.. over k, v (B, n_kv_head,
        Tk, d) at positions 0..Tk-1 (RoPE's already rotated, PoPE's raw) -> (B, n_head, Tq, d). documents: a
        Documents whose mask (if any) was built for these queries and keys. Tq = Tk - q_offset in training; a context
        parallel rank calls it once per query chunk with the gathered keys (context_parallel.CPBatch.attention)."""
        cfg = self.config
        if cfg.pos_encoding == "pope":
            return self._pope(q, k, v, kv_cache, q_offset, rotation, documents)
        if cfg.pos_encoding == "alibi_half" and documents is not None and documents.mask is not None:
            return self._alibi_documents(q, k, v, documents.mask, q_offset)
        if cfg.pos_encoding == "alibi_half":  # raw keys cached; float bias as SDPA's attn_mask (fused kernels)
            # (n_head, Tq, Tk): per query head
            bias = alibi_bias(self.alibi_slopes, q.shape[-2], k.shape[-2], q_offset=q_offset)
            # 4-D (1, n_head, T, Tk): SDPA's fused CPU kernel takes it (and grouped heads); a 3-D mask sends it
            # to the math path, which also copies k and v over each group
            k, v, gqa = sdpa_gqa(q, k, v, masked=True)  # on CUDA: k, v expanded (no O(T^2) math kernel)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype).unsqueeze(0), **gqa)
        # grouped heads: sdpa_gqa; packed documents: their mask (SDPA, or flex on CUDA)
        mask = None if documents is None else documents.mask
        return sdpa_attention(q, k, v, causal=True, q_offset=q_offset, mask=mask)

    def _alibi_documents(self, q, k, v, mask, q_offset=0):
        """ALiBi under a document mask: the bias -slope_h (q_offset + i - j) on the pairs the mask allows. Distances
        are token indices, equal to position differences inside a document whether positions restart or not.
        mask: Documents.mask built for queries at positions q_offset..: a float bias added as is, (B, n_head, T, T_k)
        under the documents' mask (alibi_document_bias) or (1, n_head, T, T_k) causal (a context-parallel query
        chunk's, context_parallel.CPBatch), or a BlockMask (flex), whose score_mod adds the bias."""
        if isinstance(mask, torch.Tensor):  # (B, n_head, T, T) float bias, -inf where the mask forbids
            bias = mask
            k, v, gqa = sdpa_gqa(q, k, v, masked=True)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), **gqa)
        slopes = self.alibi_slopes

        def score_mod(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx + q_offset - kv_idx)

        return masked_attention(q, k, v, mask, score_mod=score_mod)

    def decode(self, x, rotation, kv_cache, pos):
        """One new token per row, x (B, 1, n_embd) at position `pos` (0-d int64 tensor: the tokens already cached),
        over the whole preallocated cache with the keys after pos masked -> (B, 1, n_embd). Static shapes and the
        position as a tensor: GPT.decode_step compiles to one graph for every step. The same encodings and cached
        forms as forward with a KV cache (RoPE: rotated keys; PoPE: magnitudes, delta on the query; ALiBi: raw
        keys and a bias); the query heads of a key/value head attend as one group, without copies of the cache."""
        B, _, C = x.shape
        q, k, v = split_heads(self.c_attn(x), self.n_head, self.n_kv_head)  # (B, H, 1, d)
        cfg, at = self.config, pos.view(1)
        H_kv, G = self.n_kv_head, self.n_head // self.n_kv_head
        if cfg.pos_encoding in ("rope", "rope_half"):
            rows = rotation.index_select(0, at)
            n_rot = rows.shape[-1]
            q, k = (
                torch.cat((rope_rotate(t[..., :n_rot], rows), t[..., n_rot:]), dim=-1)
                if n_rot < self.head_dim
                else rope_rotate(t, rows)
                for t in (q, k)
            )
            if cfg.rope_scaling != 1.0:
                m = yarn_attention_factor(cfg.rope_scaling)
                q, k = q * m, k * m
        if cfg.pos_encoding == "pope":
            k = pope_key_magnitude(k, cfg.pope_magnitude)
        k_all, v_all = kv_cache.write(self.layer_idx, k, v, at)
        seen = torch.arange(k_all.shape[2], device=x.device) <= pos  # (max_len,) keys at positions <= pos
        if cfg.pos_encoding == "pope":  # the backend is a Python decision: a compiled step takes it once, tracing
            backend = decode_step_backend(q, k_all, v_all, cfg.attn_backend)
            y = pope_decode_step(
                q, k_all, v_all, self.pope_delta, rotation, at, seen, magnitude=cfg.pope_magnitude, backend=backend
            )
        else:
            qg = q.reshape(B, H_kv, G, self.head_dim).to(k_all.dtype)
            if cfg.pos_encoding == "alibi_half":
                dist = (pos - torch.arange(k_all.shape[2], device=x.device)).float()  # tokens back from the query
                mask = (-self.alibi_slopes.view(1, H_kv, G, 1) * dist).masked_fill(~seen, float("-inf")).to(qg.dtype)
            else:
                mask = seen.view(1, 1, 1, -1)
            y = F.scaled_dot_product_attention(qg, k_all, v_all, attn_mask=mask)
        y = y.reshape(B, self.n_head, 1, -1).transpose(1, 2).reshape(B, 1, C)
        return self.resid_dropout(self.c_proj(y))

    def _pope(self, q, k, v, kv_cache, q_offset, rotation, documents=None):
        """PoPE attention of queries at positions q_offset..; with a KV cache, the new keys' magnitudes are
        appended (pope_key_magnitude) and the queries attend over the cache (pope_attention_decode, delta in
        the queries). A prompt into an empty cache attends over its own raw keys, as the full forward."""
        cfg = self.config
        kw = dict(
            causal=True,
            rope_theta=cfg.rope_theta,
            q_offset=q_offset,
            magnitude=cfg.pope_magnitude,
            backend=cfg.attn_backend,
            rotation=rotation,
        )
        if documents is not None:
            kw.update(
                document_ids=documents.ids, position_ids=documents.positions, mask=documents.mask, ids_checked=True
            )
        if kv_cache is None:
            return pope_attention(q, k, v, self.pope_delta, **kw)
        mu = pope_key_magnitude(k, cfg.pope_magnitude)
        mu_all, v_all = kv_cache.update(self.layer_idx, mu, v.to(mu.dtype))
        if q_offset == 0:
            return pope_attention(q, k, v, self.pope_delta, **kw)
        return pope_attention_decode(q, mu_all, v_all, self.pope_delta, **kw)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.ln_1 = nn.RMSNorm(config.n_embd)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.RMSNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x, rotation, kv_cache=None, documents=None):
        x = x + self.attn(self.ln_1(x), rotation, kv_cache, documents)
        return x + self.mlp(self.ln_2(x))

    def decode(self, x, rotation, kv_cache, pos):
        x = x + self.attn.decode(self.ln_1(x), rotation, kv_cache, pos)
        return x + self.mlp(self.ln_2(x))


def _decode_recompile_budget(step):
    """`step` (a compiled GPT.decode_step) run with Dynamo's recompile_limit raised to DECODE_RECOMPILE_LIMIT for its
    own calls only: Dynamo counts recompiles per code object, so every GPT's decode_step shares one budget (8 by
    default) and fullgraph=True fails past it (a batch size, cache size or model is one compile each: bench.py's
    tables); the process's limit, which training's compiled forward obeys, stays as it was."""

    def run(*args):
        limit = max(torch._dynamo.config.recompile_limit, DECODE_RECOMPILE_LIMIT)
        with torch._dynamo.config.patch(recompile_limit=limit):
            return step(*args)

    return run


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
                ln_f=nn.RMSNorm(config.n_embd),
            )
        )
        if config.pos_encoding == "learned":
            self.transformer.wpe = nn.Embedding(config.block_size, config.n_embd)
        if config.pos_encoding == "sinusoidal":  # fixed: not a parameter, not saved in checkpoints
            self.register_buffer(
                "wpe_sinusoidal", sinusoidal_embedding(config.block_size, config.n_embd), persistent=False
            )
        # the encoding's rotations, one table for every layer (not saved in checkpoints): rows grow by powers of two
        # when a longer context comes (ensure_positions), so no step computes cos/sin (issue 51)
        self.register_buffer("rotation", rotation_table(config, config.block_size), persistent=False)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scaled init of the residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def _apply(self, fn, recurse=True):
        """nn.Module's _apply (to, cuda, half, bfloat16, ...), with GPT.rotation kept float32: a model cast with
        .to(torch.bfloat16) would round the table's cos/sin to 8 bits (and the Triton decode kernel takes float32
        only), so a cast table is rebuilt in float32 on its new device."""
        super()._apply(fn, recurse)
        if self.rotation is not None and self.rotation.dtype != torch.float32:
            self.rotation = rotation_table(self.config, self.rotation.shape[0]).to(self.rotation.device)
        return self

    @torch.compiler.disable  # runs eagerly: a compiled forward breaks its graph here only when the table grows
    def _grow_rotation(self, n_positions):
        rows = 1 << (n_positions - 1).bit_length()  # a power of two: a sweep over lengths grows it a few times
        # built on the CPU (float64 phases; MPS has no float64), then moved
        self.rotation = rotation_table(self.config, rows).to(self.rotation.device)

    def ensure_positions(self, n_positions):
        """Make GPT.rotation hold at least n_positions rows (positions 0..n_positions-1), growing it to the next
        power of two; a no-op for encodings without a table. Called by hidden_states for every forward.
        A compiled graph that reads the table guards on its shape: a growth after torch.compile (an evaluation of
        the raw model past its rows, mid-run) recompiles every such graph once, the whole training step included.
        Grow it ahead, before compiling, to the longest length the run will ask (train.py needs block_size rows,
        which GPT builds: its evaluations never pass block_size; tests/test_rotation_tables.py)."""
        if self.rotation is not None and n_positions > self.rotation.shape[0]:
            self._grow_rotation(n_positions)

    def get_num_params(self):
        """Number of parameters (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def hidden_states(self, idx, kv_cache=None, document_ids=None, position_ids=None, cp=None):
        """idx (B, T) token ids -> (B, T, n_embd) final hidden states (after ln_f, before lm_head).
        kv_cache: a KVCache; idx continues its tokens, at positions kv_cache.q_offset.., and is appended.
        document_ids, position_ids: packed documents, as forward. cp: a context_parallel.CPBatch, as forward."""
        if cp is not None:
            documents = cp.documents(self, idx, kv_cache, document_ids, position_ids)
        else:
            documents = self._documents(idx, kv_cache, document_ids, position_ids)
        n_positions = self._positions_needed(idx, kv_cache, documents)  # first: a negative position is refused here
        x = self.transformer.wte(idx)
        if documents is not None and documents.positions is not None and self.config.pos_encoding in ABSOLUTE_ENCODINGS:
            x = x + self._absolute_rows(documents.positions)
        elif self.config.pos_encoding in ABSOLUTE_ENCODINGS:
            q_offset, T = (kv_cache.q_offset if kv_cache is not None else 0), idx.shape[1]
            if q_offset + T > self.config.block_size:
                raise ValueError(
                    f"pos_encoding={self.config.pos_encoding!r} is absolute: it has positions 0.."
                    f"{self.config.block_size - 1} (block_size) only, asked for up to {q_offset + T - 1}"
                )
            if self.config.pos_encoding == "learned":
                x = x + self.transformer.wpe(torch.arange(q_offset, q_offset + T, device=idx.device))
            else:
                x = x + self.wpe_sinusoidal[q_offset : q_offset + T]
        x = self.transformer.drop(x)
        self.ensure_positions(n_positions)
        rotary = self.config.pos_encoding in ("rope", "rope_half")
        if rotary and documents is not None and documents.positions is not None:  # one gather for every layer
            documents = documents._replace(rows=self.rotation[documents.positions].unsqueeze(1))
        for block in self.transformer.h:
            x = block(x, self.rotation, kv_cache, documents)
        if kv_cache is not None:
            kv_cache.q_offset += idx.shape[1]
        return self.transformer.ln_f(x)

    def _documents(self, idx, kv_cache, document_ids, position_ids):
        """The Documents every layer shares (its mask built once per forward), or None for plain causal attention.
        position_ids without document_ids: one document per row at those positions, so causal attention (no mask:
        the unmasked kernels, as a rows dataset's batches under block_causal take)."""
        if document_ids is None and position_ids is None:
            return None
        if kv_cache is not None:
            raise ValueError("document_ids / position_ids are for training and evaluation; decoding takes one document")
        B, T = idx.shape
        check_document_ids(document_ids, position_ids, B, T, idx.device)
        if document_ids is None or self._pope_kernel(idx.device):
            return Documents(document_ids, position_ids, None)
        mask = document_mask(document_ids)
        if self.config.pos_encoding == "alibi_half" and isinstance(mask, torch.Tensor):
            mask = alibi_document_bias(self.transformer.h[0].attn.alibi_slopes, mask)
        return Documents(document_ids, position_ids, mask)

    def _positions_needed(self, idx, kv_cache, documents):
        """The rows of GPT.rotation a forward reads: q_offset + T, or with position_ids their largest + 1 (read in
        eager mode only, a host sync; under torch.compile they must lie below the table's rows, which train.py's
        block_size rows cover). Raises ValueError for a negative position."""
        n = (kv_cache.q_offset if kv_cache is not None else 0) + idx.shape[1]
        positions = documents.positions if documents is not None else None
        if positions is None or torch.compiler.is_compiling() or positions.device.type == "meta" or not n:
            return n
        lo, hi = (int(v) for v in positions.aminmax())
        if lo < 0:
            raise ValueError(f"position_ids must be >= 0 (token positions), got {lo}")
        return max(n, hi + 1)

    def _pope_kernel(self, device):
        """True where PoPE's attention resolves to the Triton kernel (pope_backend: 'triton', or 'auto' on a GPU in
        fp16/bf16), which masks from the document ids itself: no mask to build (on CUDA a BlockMask per step)."""
        cfg = self.config
        if cfg.pos_encoding != "pope":
            return False
        probe = torch.empty(1, 1, 1, cfg.n_embd // cfg.n_head, device=device)  # float32: autocast's dtype rules
        return pope_backend(probe, probe, probe, cfg.attn_backend) == "triton"

    def _absolute_rows(self, positions):
        """The absolute encoding's rows (B, T, n_embd) for positions (B, T) int64 (< block_size: not checked
        under torch.compile; eager raises ValueError past the table)."""
        if not torch.compiler.is_compiling() and int(positions.max()) >= self.config.block_size:
            raise ValueError(
                f"pos_encoding={self.config.pos_encoding!r} is absolute: it has positions 0.."
                f"{self.config.block_size - 1} (block_size) only, asked for up to {int(positions.max())}"
            )
        if self.config.pos_encoding == "learned":
            return self.transformer.wpe(positions)
        return self.wpe_sinusoidal[positions]

    def decode_step(self, idx, kv_cache, pos):
        """Logits (B, vocab_size) float32 of one new token per row, idx (B, 1), at position `pos` (a 0-d int64
        tensor on idx's device: the tokens already in kv_cache, whose buffers a prefill allocated and whose rows
        GPT.rotation covers). Writes the token's keys and values into the cache at pos; the caller advances pos
        and kv_cache.q_offset. Shapes never change and the position is data, so torch.compile(fullgraph=True)
        makes one graph for every step (generate(compile=True)); its tokens equal forward's with the same cache
        (greedy, fp32). Encodings as forward; absolute ones read their row pos (< block_size, unchecked here)."""
        x = self.transformer.wte(idx)
        if self.config.pos_encoding == "learned":
            x = x + self.transformer.wpe(pos.view(1))
        elif self.config.pos_encoding == "sinusoidal":
            x = x + self.wpe_sinusoidal.index_select(0, pos.view(1))
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            x = block.decode(x, self.rotation, kv_cache, pos)
        return self.lm_head(self.transformer.ln_f(x))[:, -1].float()

    def forward(self, idx, targets=None, kv_cache=None, document_ids=None, position_ids=None, cp=None):
        """idx (B, T) int64 token ids -> (logits (B, T, vocab_size), loss or None).

        targets (B, T) int64; positions whose target is -1 are ignored, so a dataset can put the loss
        on the final token only. loss is the mean cross-entropy in nats over the other positions.
        kv_cache: a KVCache; idx then continues the cached tokens (positions start at kv_cache.q_offset).
        document_ids: (B, T) int32, non-decreasing: packed documents (train.py's attn_mask_type='block_causal'):
            a token attends only to earlier tokens of its own document, for every encoding (ALiBi's bias on the
            allowed pairs). position_ids: (B, T) int64 token positions (None: 0..T-1), e.g. restarting at 0 in
            each document (reset_position_ids): absolute encodings read those rows, RoPE/PoPE rotate by them.
            Both are for training and evaluation (no kv_cache); ValueError for bad shapes, dtypes, devices or ids.
        cp: context parallelism (train.py's context_parallel_degree > 1): a context_parallel.CPBatch from
            ContextParallel.shard; idx and targets are then this rank's slice of the sequence (B, T / cp), the batch's
            document_ids / position_ids travel inside cp (not here), logits are this rank's rows, and loss is the
            mean over the whole sequence's non-ignored targets, reduced over the cp group (CPBatch.loss).
        """
        logits = self.lm_head(self.hidden_states(idx, kv_cache, document_ids, position_ids, cp))
        loss = None
        if targets is not None and cp is not None:
            loss = cp.loss(logits, targets)
        elif targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def clamp_pope_delta_(self):
        """Project every PoPE phase bias delta back into [-2*pi, 0] radians, in place.

        Called by train.py after each optimizer step (projected gradient descent). The forward pass
        uses delta unclamped, so its gradient is never zeroed by a clamp: a delta that an update
        pushes out of the box is put back on its edge and keeps learning from there.
        """
        for block in self.transformer.h:
            if block.attn.pope_delta is not None:
                block.attn.pope_delta.clamp_(-2 * math.pi, 0.0)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, compile=False):
        """Continue idx (B, T) by max_new_tokens tokens with a KV cache; returns (B, T + max_new_tokens).

        temperature 0 picks the argmax; top_k keeps the k most likely tokens. The prompt is run once (forward's
        kernels), then one token per step at absolute position kv_cache.q_offset: compile=False through
        hidden_states (eager); compile=True through decode_step under torch.compile(fullgraph=True) (CUDA:
        mode='reduce-overhead', CUDA graphs): a static cache and the position as a tensor, so one compile
        serves every step, and every prompt and length whose sum rounds to the same power of two (the cache's
        size; compiled_decode_step). Greedy tokens are the same either way in fp32. Raises ValueError for a
        negative temperature, or an absolute encoding past block_size.
        """
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if self.config.pos_encoding in ABSOLUTE_ENCODINGS and idx.shape[1] + max_new_tokens > self.config.block_size:
            raise ValueError(
                f"pos_encoding={self.config.pos_encoding!r} is absolute: prompt + max_new_tokens = "
                f"{idx.shape[1] + max_new_tokens} exceeds block_size {self.config.block_size}"
            )
        max_len = idx.shape[1] + max_new_tokens
        if compile:  # a power of two: prompts and lengths that round alike share one compiled step
            max_len = 1 << (max_len - 1).bit_length()
        cache = KVCache(self.config.n_layer, max_len)
        self.ensure_positions(cache.max_len)  # the table grows once, before the first step
        logits = self.lm_head(self.hidden_states(idx, cache)[:, -1, :]).float()
        if compile:
            step, pos = self.compiled_decode_step(cache), torch.tensor(cache.q_offset, device=idx.device)
        for i in range(max_new_tokens):
            if temperature == 0:
                idx_next = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float("inf")
                idx_next = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
            if i + 1 < max_new_tokens:
                if compile:
                    logits = step(idx_next, cache, pos).clone()  # clone: a CUDA graph's output is overwritten
                    pos += 1
                    cache.q_offset += 1
                else:
                    logits = self.lm_head(self.hidden_states(idx_next, cache)[:, -1, :]).float()
        return idx

    def compiled_decode_step(self, kv_cache):
        """decode_step under torch.compile(fullgraph=True, dynamic=False), built once per model and kept; on CUDA
        with mode='reduce-overhead' (CUDA graphs; the cache's buffers marked as static addresses, so a step
        replays one graph). kv_cache: a prefilled KVCache (its buffers exist); GPT.rotation grows to its max_len here.
        Raises ValueError for a cache no prompt has filled yet."""
        if kv_cache.k[0] is None:
            raise ValueError("compiled decoding needs a prefilled KVCache: run the prompt through hidden_states first")
        self.ensure_positions(kv_cache.max_len)  # every row a step may read, before it is traced
        cuda = kv_cache.k[0].is_cuda
        if cuda:
            for buf in (*kv_cache.k, *kv_cache.v):
                torch._dynamo.mark_static_address(buf)
        steps = self.__dict__.setdefault("_decode_compiled", {})  # per device type: CUDA graphs on CUDA only
        if kv_cache.k[0].device.type not in steps:
            steps[kv_cache.k[0].device.type] = _decode_recompile_budget(
                torch.compile(self.decode_step, fullgraph=True, dynamic=False, mode="reduce-overhead" if cuda else None)
            )
        return steps[kv_cache.k[0].device.type]

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        """AdamW with weight decay on matrices only: no decay on the PoPE phase biases delta (which
        are 2-D but angles), the RMSNorm gains and biases. Fused AdamW on CUDA."""
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            (decay if p.dim() >= 2 and not name.endswith("pope_delta") else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **({"fused": True} if fused else {}))

    def flops_per_token(self, seq_len):
        """Training FLOPs per token (forward + backward) at context seq_len: 6N + attention.

        Attention costs 6 * n_layer * n_head * seq_len * (d_qk + d_v) per token, PaLM-style (no
        causal halving): d_qk = d_v = head_dim for RoPE/NoPE, d_qk = 2 * head_dim for PoPE's
        Cartesian scores. At 6 layers, 384 wide, T=1024 (GPT-2 vocabulary) this gives PoPE/RoPE = 1.068;
        bench.py's torch path, which pads v to 2 * head_dim too, costs 1.136 (torch_path_flops_per_token).
        """
        cfg = self.config
        hd = cfg.n_embd // cfg.n_head
        d_qk = 2 * hd if cfg.pos_encoding == "pope" else hd
        return 6 * self.get_num_params() + 6 * cfg.n_layer * cfg.n_head * seq_len * (d_qk + hd)

    def estimate_mfu(self, tokens_per_iter, seq_len, dt, peak_flops):
        """Model FLOPs utilisation: achieved FLOP/s over peak_flops (FLOP/s of the device for the
        training dtype, see device_peak_flops). dt is seconds per iteration. None if peak unknown."""
        if not peak_flops:
            return None
        return self.flops_per_token(seq_len) * tokens_per_iter / dt / peak_flops


# Dense (no sparsity) tensor-core peak FLOP/s per GPU for bf16 (fp16 where the part has no bf16), FP32
# accumulation, from NVIDIA's datasheets and architecture whitepapers (their "with sparsity" figures are 2x
# these). Keys are regular expressions searched, in this order, in torch.cuda.get_device_name(); the name
# strings checked are the ones these GPUs report (nvidia-smi, torch), listed per part:
PEAK_FLOPS = {
    r"\bH100\b.*\bNVL\b": 835e12,  # H100 NVL (94 GB HBM3): "NVIDIA H100 NVL"
    r"\bH100\b.*\bPCIe\b": 756e12,  # H100 PCIe (80 GB HBM2e): "NVIDIA H100 PCIe"
    r"\bH100\b.*\b(HBM3|SXM)": 989e12,  # H100 SXM5: "NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM5 80GB"
    r"\bH200\b.*\bNVL\b": 835e12,  # H200 NVL: "NVIDIA H200 NVL"
    r"\bH200\b": 989e12,  # H200 SXM: "NVIDIA H200" (not GH200: no word boundary inside "GH200")
    r"\bGH200\b": 989e12,  # Grace Hopper: "NVIDIA GH200 480GB", "NVIDIA GH200 144G HBM3e"
    r"\bB200\b": 2250e12,  # HGX B200, per GPU: "NVIDIA B200"
    r"\bA100\b": 312e12,  # SXM4 and PCIe alike: "NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB",
    # "NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe"
    r"\bA800\b": 312e12,  # "NVIDIA A800-SXM4-80GB", "NVIDIA A800 80GB PCIe"
    r"\bA10G\b": 70e12,  # AWS's part, no NVIDIA datasheet: the figure in common use. "NVIDIA A10G"
    r"\bA10\b": 125e12,  # "NVIDIA A10" (not A100, A10G)
    r"\bL40S\b": 362e12,  # "NVIDIA L40S"
    r"\bL40\b": 181e12,  # "NVIDIA L40"
    r"\bL4\b": 121e12,  # "NVIDIA L4"
    r"\bV100S\b": 130e12,  # fp16 (no bf16): "Tesla V100S-PCIE-32GB"
    r"\bV100-SXM": 125e12,  # fp16: "Tesla V100-SXM2-16GB", "Tesla V100-SXM2-32GB", "Tesla V100-SXM3-32GB"
    r"\bV100-PCIE": 112e12,  # fp16: "Tesla V100-PCIE-16GB", "Tesla V100-PCIE-32GB"
    r"\bRTX 4090$": 165e12,  # FP32 accumulate (330 with fp16 accumulate): "NVIDIA GeForce RTX 4090" (not 4090 D)
    r"\bRTX 3090$": 71e12,  # FP32 accumulate: "NVIDIA GeForce RTX 3090" (not the 3090 Ti)
    r"\bRTX A6000\b": 155e12,  # "NVIDIA RTX A6000"
}


def device_peak_flops(device, dtype):
    """Peak FLOP/s of one `device` ('cuda', 'cuda:1', 'cpu', ...) for training in `dtype`, or None.

    Searches the CUDA device name for the patterns of PEAK_FLOPS, in order, and returns the first match's
    dense bf16/fp16 figure (fp32 training: half of it, a TF32 estimate). The patterns match what each
    name really contains: "H100 80GB HBM3" is the SXM part (989 TFLOP/s), not the PCIe card (756); "L40"
    is neither "L40S" nor "L4"; "A10" is neither "A100" nor "A10G". CPUs, unknown GPUs and H100 / V100
    names that do not say which form factor they are return None, so MFU is reported as unknown rather
    than against a wrong figure; set train.py's peak_flops to override. train.py reports MFU per device.
    """
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(torch.device(device))
    for pattern, flops in PEAK_FLOPS.items():
        if re.search(pattern, name):
            return flops / 2 if dtype == "float32" else flops
    return None
