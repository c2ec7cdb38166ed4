"""PopeGPTConfig: the configuration of a GPT trained with this repo (https://arxiv.org/abs/2509.10534's reference
codebase), under transformers' field names. Ships inside every exported model folder (hf/export.py); imports
only transformers.

Field names as Llama's where one exists (this repo's GPTConfig name in brackets):
    vocab_size, hidden_size [n_embd], num_hidden_layers [n_layer], num_attention_heads [n_head],
    num_key_value_heads [n_kv_head], intermediate_size (4 hidden_size), max_position_embeddings [block_size: the
    context trained at; the relative encodings run past it], rope_theta (the frequency base of RoPE and PoPE),
    rope_scaling (YaRN, in transformers' format {"rope_type": "yarn", "factor": s, "original_max_position_embeddings":
    L, "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 0.1 ln s + 1}), attention_bias and mlp_bias [bias],
    hidden_dropout [dropout], rms_norm_eps (None: nn.RMSNorm's default, the input dtype's machine epsilon).
PoPE's own: pos_encoding ('pope' | 'rope' | 'none' | 'rope_half' | 'alibi_half' | 'learned' | 'sinusoidal'),
pope_magnitude ('softplus' | 'relu' | 'identity'), pope_use_delta (a learned phase bias delta per key/value head and
channel), rope_yarn_ramp ('code': transformers' YaRN ramp, linear in the pair index; 'paper': the YaRN paper's,
linear in rotations per original context). The export also records pope_tokenizer, the run's tokenizer description
(this repo's checkpoint format), kept as an extra attribute for train.py --init_from=hf.
"""

from transformers import PretrainedConfig

POS_ENCODINGS = ("rope", "pope", "none", "rope_half", "alibi_half", "learned", "sinusoidal")


class PopeGPTConfig(PretrainedConfig):
    model_type = "pope_gpt"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    def __init__(
        self,
        vocab_size=50304,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=None,
        intermediate_size=None,
        max_position_embeddings=1024,
        hidden_act="gelu",
        rms_norm_eps=None,
        attention_bias=False,
        mlp_bias=False,
        hidden_dropout=0.0,
        pos_encoding="pope",
        rope_theta=10000.0,
        rope_scaling=None,
        rope_yarn_ramp="code",
        pope_magnitude="softplus",
        pope_use_delta=True,
        use_cache=True,
        tie_word_embeddings=True,
        **kwargs,
    ):
        if pos_encoding not in POS_ENCODINGS:
            raise ValueError(f"pos_encoding must be one of {POS_ENCODINGS}, got {pos_encoding!r}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.intermediate_size = intermediate_size or 4 * hidden_size
        self.max_position_embeddings = max_position_embeddings
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        self.attention_bias = attention_bias
        self.mlp_bias = mlp_bias
        self.hidden_dropout = hidden_dropout
        self.pos_encoding = pos_encoding
        self.rope_theta = rope_theta
        yarn = rope_scaling or kwargs.pop("rope_parameters", None)  # transformers 5 saves rope_scaling under this name
        if isinstance(getattr(type(self), "rope_scaling", None), property):  # transformers 5: an alias of it
            self.rope_parameters = yarn
        else:
            self.rope_scaling = yarn
        self.rope_yarn_ramp = rope_yarn_ramp
        self.pope_magnitude = pope_magnitude
        self.pope_use_delta = pope_use_delta
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
