"""PoPE-GPT for Hugging Face transformers: a GPT trained with this repo (model.py), loadable with
AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True). Ships inside every exported model folder
(hf/export.py); imports only torch and transformers.

The network is model.py's GPT: pre-norm blocks with RMSNorm (no bias, nn.RMSNorm's default eps), attention from
one fused c_attn projection (queries of num_attention_heads heads, then keys and values of num_key_value_heads
heads: grouped-query attention), an exact-GELU MLP 4x wide, a final RMSNorm and an lm_head tied to the token
embedding. Attention logits are scaled by 1/sqrt(head_dim) for every encoding. The weights keep model.py's
names (transformer.wte, transformer.h.N.attn.c_attn, ...).

Positions (config.pos_encoding):
    'pope'  Polar Coordinate Position Embedding (Gopalakrishnan, Csordas, Schmidhuber, Mozer, ICML 2026, Method):
            d = head_dim frequencies theta_c = rope_theta^(-c/d) (c = 0..d-1, float32), magnitudes mu =
            softplus(x) (or the ablations relu(x), x: pope_magnitude), score of query t and key s
            sum_c mu_q mu_k cos((s - t) theta_c + delta_c) / sqrt(d), delta (n_kv_head, d) radians learned per key
            head (pope_use_delta; else 0). Computed as a 2d-wide dot product of the query's
            mu_q [cos(t theta - delta), sin(t theta - delta)] and the key's mu_k [cos(s theta), sin(s theta)].
            The KV cache keeps each key's magnitude mu_k (d wide: RoPE's bytes) and its value; the keys are rotated
            at attention time, each at the position it was given (kept beside the cache: KEY_POSITIONS).
    'rope'  RoPE on channel pairs (c, c + d/2), theta_i = rope_theta^(-2i/d); with rope_scaling's YaRN (factor s,
            original context L, beta_fast/beta_slow, the ramp of rope_yarn_ramp) the frequencies
            (1 - gamma_i) theta_i / s + gamma_i theta_i and q, k times attention_factor (0.1 ln s + 1).
    'rope_half'  RoPE (frequencies of head_dim/2 channels) on each head's first half; 'none' no positions;
    'alibi_half' ALiBi on the first num_attention_heads/2 heads; 'learned', 'sinusoidal' absolute embeddings
            (positions < max_position_embeddings only).
Every phase is formed in float64 and rounded to float32 after cos/sin, as model.py's tables, so logits equal
model.py's GPT.forward to float32 rounding.

Padding: attention_mask (batch, past + new tokens), 1 for a real token and 0 for padding (left padding, as
batched generate and lm-eval pad). Positions come from it as in transformers' Llama (cumsum - 1), so each row
of a left-padded batch is computed at the positions it has alone. attn_implementation: "sdpa" (default) or "eager".
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_pope_gpt import PopeGPTConfig

_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
KEY_POSITIONS = "pope_gpt_key_positions"  # the attribute of a Cache that holds its keys' positions (B, past) int64


# --- frequencies and rotations (model.py's rope_frequencies, yarn_gamma; pope.py's pope_frequencies) ---


def yarn_params(config):
    """(factor, original_max_position_embeddings, beta_fast, beta_slow, attention_factor) of config's YaRN, or None
    for plain RoPE. Reads rope_scaling (transformers 4) or rope_parameters (transformers 5), both
    {"rope_type": "yarn", ...}."""
    for name in ("rope_parameters", "rope_scaling"):
        p = getattr(config, name, None)
        if isinstance(p, dict) and p.get("rope_type", p.get("type")) == "yarn":
            s = float(p["factor"])
            m = p.get("attention_factor") or 0.1 * math.log(s) + 1.0
            return s, int(p["original_max_position_embeddings"]), p.get("beta_fast", 32.0), p.get("beta_slow", 1.0), m
    return None


def rope_frequencies(head_dim, rope_theta, yarn=None, ramp="code"):
    """RoPE's (head_dim/2,) float64 radians per token, YaRN-scaled when yarn = yarn_params(...) is given."""
    freqs = rope_theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if yarn is None:
        return freqs
    s, L, beta, alpha, _ = yarn
    if ramp == "paper":  # linear in r = L / wavelength
        gamma = ((L * freqs / (2 * math.pi) - alpha) / (beta - alpha)).clamp(0.0, 1.0)
    else:  # the released YaRN code's and transformers' ramp: linear in the pair index

        def index(rotations):
            return head_dim * math.log(L / (2 * math.pi * rotations)) / (2 * math.log(rope_theta))

        low, high = max(math.floor(index(beta)), 0), min(math.ceil(index(alpha)), head_dim - 1)
        high = high + 0.001 if high == low else high
        i = torch.arange(len(freqs), dtype=freqs.dtype)
        gamma = 1 - ((i - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - gamma) * freqs / s + gamma * freqs


def pope_frequencies(head_dim, rope_theta):
    """PoPE's (head_dim,) frequencies rope_theta^(-c/d), rounded to float32 (as pope.py), returned as float64."""
    c = torch.arange(head_dim, dtype=torch.float64)
    return (rope_theta ** (-c / head_dim)).to(torch.float32).double()


def rotations(freqs, positions):
    """(B, 1, T, 2n) float32 [cos | sin] of positions (B, T) int64 times freqs (n,) float64 radians per token: the
    phase in float64, rounded after cos/sin (model.py's rope_table, pope.py's pope_rotation_table rows)."""
    angle = positions.to(freqs.device).double()[..., None] * freqs
    return torch.cat((torch.cos(angle), torch.sin(angle)), dim=-1).float().unsqueeze(1)


def rope_rotate(x, rows):
    """Rotate pairs (c, c + d/2) of x (B, H, T, d) by rows (B, 1, T, d) [cos | sin]; in float32, x's dtype out."""
    h = x.shape[-1] // 2
    cos, sin = rows[..., :h], rows[..., h:]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


def pope_magnitude(x, magnitude):
    if magnitude == "softplus":
        return F.softplus(x)
    if magnitude == "relu":
        return F.relu(x)
    if magnitude == "identity":
        return x
    raise ValueError(f"pope_magnitude must be softplus, relu or identity, got {magnitude!r}")


def alibi_slopes(n_head):
    """ALiBi's head slopes (Press et al. 2022), (n_head,) float64 (model.py's alibi_slopes)."""

    def geometric(n):
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    p = 2 ** int(math.floor(math.log2(n_head)))
    return torch.tensor(geometric(p) + geometric(2 * p)[0::2][: n_head - p], dtype=torch.float64)


def sinusoidal_rows(positions, n_embd):
    """Vaswani et al.'s embedding of positions (B, T): (B, T, n_embd) float32 (model.py's sinusoidal_embedding)."""
    angle = positions.double()[..., None] * 10000.0 ** (-torch.arange(0, n_embd, 2, dtype=torch.float64) / n_embd)
    return torch.stack((torch.sin(angle), torch.cos(angle)), dim=-1).flatten(-2).float()


# --- the network ---


class PopeGPTAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.n_head, self.n_kv_head = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // self.n_head
        width = (self.n_head + 2 * self.n_kv_head) * self.head_dim
        self.c_attn = nn.Linear(config.hidden_size, width, bias=config.attention_bias)
        self.c_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=config.attention_bias)
        self.resid_dropout = nn.Dropout(config.hidden_dropout)
        if config.pos_encoding == "pope" and config.pope_use_delta:
            self.pope_delta = nn.Parameter(torch.zeros(self.n_kv_head, self.head_dim))  # radians
        else:
            self.pope_delta = None

    def forward(self, x, pos, cache=None):
        """x (B, T, C) -> (B, T, C). pos: the PopeGPTModel's per-forward dict (rotation rows, mask, positions)."""
        B, T, C = x.shape
        cfg, hd = self.config, self.head_dim
        q, k, v = self.c_attn(x).split((self.n_head * hd, self.n_kv_head * hd, self.n_kv_head * hd), dim=2)
        q = q.view(B, T, self.n_head, hd).transpose(1, 2)
        k, v = (t.view(B, T, self.n_kv_head, hd).transpose(1, 2) for t in (k, v))
        if cfg.pos_encoding in ("rope", "rope_half"):
            rows, n = pos["rows"], pos["rows"].shape[-1]
            q, k = (torch.cat((rope_rotate(t[..., :n], rows), t[..., n:]), dim=-1) for t in (q, k))
            if pos["yarn_factor"] != 1.0:  # YaRN's temperature: logits times attention_factor^2
                q, k = q * pos["yarn_factor"], k * pos["yarn_factor"]
        if cfg.pos_encoding == "pope":  # the cache keeps magnitudes; keys are rotated below, at attention time
            k = pope_magnitude(k.float(), cfg.pope_magnitude).to(v.dtype)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        scale = 1.0 / math.sqrt(hd)
        if cfg.pos_encoding == "pope":
            q, k = self._pope_forms(q, k, pos)
        G = self.n_head // self.n_kv_head
        if G > 1:
            k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
        y = self._attend(q, k, v, pos, scale)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def _pope_forms(self, q, mu_k, pos):
        """Raw queries (B, H, T, d) and key magnitudes (B, H_kv, Tk, d) -> their 2d-wide Cartesian forms
        mu_q [cos(t theta - delta), sin(t theta - delta)] and mu_k [cos(s theta), sin(s theta)], in float32."""
        d = q.shape[-1]
        rq, rk = pos["rows"], pos["key_rows"]  # (B, 1, T, 2d), (B, 1, Tk, 2d)
        cos, sin = rq[..., :d], rq[..., d:]
        if self.pope_delta is not None:  # phase t theta - delta by angle addition; delta of the query's key head
            neg = -self.pope_delta.float().repeat_interleave(self.n_head // self.n_kv_head, dim=0)
            cd, sd = torch.cos(neg).unsqueeze(-2), torch.sin(neg).unsqueeze(-2)  # (H, 1, d)
            cos, sin = cos * cd - sin * sd, sin * cd + cos * sd
        mu_q = pope_magnitude(q.float(), self.config.pope_magnitude)
        mu = mu_k.float()
        return torch.cat((mu_q * cos, mu_q * sin), dim=-1), torch.cat((mu * rk[..., :d], mu * rk[..., d:]), dim=-1)

    def _attend(self, q, k, v, pos, scale):
        """Softmax attention of q (B, H, T, dk) over k (B, H, Tk, dk), v (B, H, Tk, dv) under pos's mask (None:
        causal with the queries last) and ALiBi's bias -> (B, H, T, dv) in v's dtype."""
        allowed, bias = pos["allowed"], None
        if self.config.pos_encoding == "alibi_half":
            slopes = torch.zeros(self.n_head, dtype=torch.float32, device=q.device)
            slopes[: self.n_head // 2] = alibi_slopes(self.n_head // 2).float().to(q.device)
            dist = (pos["q_positions"][:, None, :, None] - pos["k_positions"][:, None, None, :]).float()
            bias = -slopes.view(1, -1, 1, 1) * dist  # (B, H, T, Tk)
        if self.config._attn_implementation == "eager":
            scores = (q.float() @ k.float().transpose(-1, -2)) * scale
            if bias is not None:
                scores = scores + bias
            scores = scores.masked_fill(~allowed, float("-inf"))
            return (torch.softmax(scores, dim=-1) @ v.float()).to(v.dtype)
        dv, dk = v.shape[-1], q.shape[-1]
        v = F.pad(v, (0, dk - dv)) if dv < dk else v  # PoPE: one width for q/k and v (SDPA's fused kernels)
        q, k, v = q.to(v.dtype), k.to(v.dtype), v
        if bias is not None:
            mask = bias.masked_fill(~allowed, float("-inf")).to(q.dtype)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        elif pos["is_causal"]:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale)
        return y[..., :dv]


class PopeGPTMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.c_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class PopeGPTBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.ln_1 = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn = PopeGPTAttention(config, layer_idx)
        self.ln_2 = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = PopeGPTMLP(config)

    def forward(self, x, pos, cache=None):
        x = x + self.attn(self.ln_1(x), pos, cache)
        return x + self.mlp(self.ln_2(x))


class PopeGPTPreTrainedModel(PreTrainedModel):
    config_class = PopeGPTConfig
    base_model_prefix = "transformer"
    _no_split_modules = ["PopeGPTBlock"]
    _supports_sdpa = True
    _supports_cache_class = True
    supports_gradient_checkpointing = False

    def _init_weights(self, module):
        """model.py's init (normal 0.02, zero biases, RMSNorm gains 1); loaded weights replace it."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, PopeGPTAttention) and module.pope_delta is not None:
            nn.init.zeros_(module.pope_delta)


class PopeGPTModel(PopeGPTPreTrainedModel):
    """The GPT without its lm_head: token ids -> final hidden states (after ln_f)."""

    def __init__(self, config):
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.pos_encoding == "learned":
            self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.drop = nn.Dropout(config.hidden_dropout)
        self.h = nn.ModuleList([PopeGPTBlock(config, i) for i in range(config.num_hidden_layers)])
        self.ln_f = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.wte

    def set_input_embeddings(self, value):
        self.wte = value

    def positions(self, B, T, past, attention_mask, position_ids, device, kept=None):
        """The per-forward dict every layer reads: q_positions (B, T) and k_positions (B, past + T) int64 token
        positions, allowed (B, 1, T, past + T) bool (causal, padding masked), is_causal (SDPA's is_causal applies),
        rows / key_rows (the encoding's rotations of queries and keys), yarn_factor.

        The new tokens' positions: position_ids (B or 1, T) when given, else the attention_mask's cumsum - 1
        (transformers' convention), else past.. past + T - 1. The cached keys' positions: kept (B, >= past) int64,
        the k_positions the cache's earlier forwards recorded (so a key keeps the position it was given, as RoPE's
        rotated keys do), else as the new tokens' (a cache filled by other code).
        Raises ValueError for a mask that is not (B, past + T)."""
        Tk = past + T
        if attention_mask is not None:
            if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (B, Tk):
                raise ValueError(
                    f"attention_mask must be 2-D (batch, past + new tokens) = {(B, Tk)}, got "
                    f"{tuple(attention_mask.shape)}: 1 for tokens, 0 for padding"
                )
            valid = attention_mask.to(device).bool()
            k_pos = (attention_mask.to(device).long().cumsum(-1) - 1).clamp(min=0)
        else:
            valid = None
            k_pos = torch.arange(Tk, device=device).expand(B, Tk)
        if position_ids is not None:
            k_pos = torch.cat((k_pos[:, :past], position_ids.to(device).long().expand(B, T)), dim=1)
        if past and kept is not None and kept.shape[0] == B and kept.shape[1] >= past:
            k_pos = torch.cat((kept[:, :past].to(device), k_pos[:, past:]), dim=1)
        q_pos = k_pos[:, past:]
        cfg = self.config
        # causal by index: key j is visible to query i (at index past + i) if j <= past + i and j is not padding
        idx_q = torch.arange(past, Tk, device=device)[:, None]
        allowed = (torch.arange(Tk, device=device)[None, :] <= idx_q)[None, None].expand(B, 1, T, Tk)
        if valid is not None:
            allowed = allowed & valid[:, None, None, :]
            allowed = allowed | ~allowed.any(-1, keepdim=True)  # a padding query with no key: any (its output unused)
        padded = valid is not None and not bool(valid.all())
        pos = {
            "q_positions": q_pos,
            "k_positions": k_pos,
            "allowed": allowed,
            "is_causal": not padded and past == 0,
            "yarn_factor": 1.0,
        }
        hd = cfg.hidden_size // cfg.num_attention_heads
        if cfg.pos_encoding in ("rope", "rope_half"):
            yarn = yarn_params(cfg) if cfg.pos_encoding == "rope" else None
            n_rot = hd if cfg.pos_encoding == "rope" else hd // 2
            pos["rows"] = rotations(rope_frequencies(n_rot, cfg.rope_theta, yarn, cfg.rope_yarn_ramp), q_pos)
            pos["yarn_factor"] = yarn[4] if yarn else 1.0
        elif cfg.pos_encoding == "pope":
            freqs = pope_frequencies(hd, cfg.rope_theta)
            pos["rows"], pos["key_rows"] = rotations(freqs, q_pos), rotations(freqs, k_pos)
        return pos

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None):
        """input_ids (B, T) -> (hidden states (B, T, hidden_size), cache). cache: a transformers Cache (the tokens
        before these), or None."""
        x = self.wte(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = x.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        kept = getattr(cache, KEY_POSITIONS, None)
        pos = self.positions(B, T, past, attention_mask, position_ids, x.device, kept)
        if cache is not None:  # each cached key's own position, for PoPE's and ALiBi's next forward over the cache
            setattr(cache, KEY_POSITIONS, pos["k_positions"])
        cfg = self.config
        if cfg.pos_encoding in ("learned", "sinusoidal"):
            if int(pos["q_positions"].max()) >= cfg.max_position_embeddings:
                raise ValueError(
                    f"pos_encoding={cfg.pos_encoding!r} is absolute: it has positions 0.."
                    f"{cfg.max_position_embeddings - 1} only, asked for up to {int(pos['q_positions'].max())}"
                )
            if cfg.pos_encoding == "learned":
                x = x + self.wpe(pos["q_positions"])
            else:
                x = x + sinusoidal_rows(pos["q_positions"], cfg.hidden_size).to(x.device, x.dtype)
        x = self.drop(x)
        for block in self.h:
            x = block(x, pos, cache)
        return self.ln_f(x), cache


class PopeGPTForCausalLM(PopeGPTPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.transformer = PopeGPTModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.transformer.wte

    def set_input_embeddings(self, value):
        self.transformer.wte = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        inputs_embeds=None,
        labels=None,
        use_cache=None,
        logits_to_keep=0,
        past_key_values=None,
        return_dict=None,
        **kwargs,
    ):
        """Logits (B, T, vocab_size) of the next token after each of input_ids (B, T); with labels (B, T) (-100
        ignored), the mean cross-entropy in nats of labels[:, 1:] (transformers' shift). cache (past_key_values
        in transformers 4): a Cache of the earlier tokens; use_cache (default config.use_cache) returns one."""
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        if cache is not None and not isinstance(cache, Cache):
            raise ValueError(f"cache must be a transformers Cache (DynamicCache), got {type(cache).__name__}")
        hidden, cache = self.transformer(input_ids, attention_mask, position_ids, cache, inputs_embeds)
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        else:
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            shift = logits[:, :-1].float().reshape(-1, logits.shape[-1])
            loss = F.cross_entropy(shift, labels[:, 1:].reshape(-1).to(shift.device), ignore_index=-100)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache if use_cache else None})
        return out if return_dict is not False else out.to_tuple()
