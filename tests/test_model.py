"""GPT: causality, KV-cache decoding, relative-position invariance, the PoPE phase bias delta."""

import math

import pytest
import torch

from model import GPT, GPTConfig, KVCache, apply_rope


def tiny(pos_encoding, **kw):
    torch.manual_seed(0)
    cfg = GPTConfig(
        **{
            "block_size": 16,
            "vocab_size": 37,
            "n_layer": 2,
            "n_head": 2,
            "n_embd": 32,
            "pos_encoding": pos_encoding,
            "attn_backend": "torch",
            **kw,
        }
    )
    return GPT(cfg).eval()


@pytest.mark.parametrize("pos_encoding", ["pope", "rope", "none"])
def test_future_tokens_do_not_change_past_logits(pos_encoding):
    model = tiny(pos_encoding)
    idx = torch.randint(0, 37, (2, 20))  # longer than block_size: no length cap for these encodings
    changed = idx.clone()
    changed[:, 12:] = (changed[:, 12:] + 1) % 37
    a, _ = model(idx)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert (a[:, 12:] - b[:, 12:]).abs().max() > 1e-3  # the change itself is visible


@pytest.mark.parametrize("pos_encoding", ["pope", "rope"])
def test_kv_cache_decoding_equals_full_forward(pos_encoding):
    model = tiny(pos_encoding)
    idx = torch.randint(0, 37, (3, 19))
    full, _ = model(idx)
    cache, pieces, start = KVCache(2, 19), [], 0
    for stop in (7, 8, 9, 13, 19):  # a prompt, single tokens, then a chunked prefill of 4 and of 6
        logits, _ = model(idx[:, start:stop], kv_cache=cache)
        pieces.append(logits)
        start = stop
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=2e-5, rtol=1e-4)


def peaked(pos_encoding, gain=30.0):
    """tiny() with its query/key weights scaled by `gain`: peaked, position-dependent attention, so
    a cache that gets a key's position, phase bias or magnitude wrong changes the logits."""
    model = tiny(pos_encoding)
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight[: 2 * 32] *= gain  # rows of q and k (n_embd = 32)
    return model


def layer0_attention_probs(model, idx):
    """(B, H, T, T) softmax probabilities of layer 0, read out by attending over one-hot values."""
    from pope import pope_attention, sdpa_attention

    attn, T = model.transformer.h[0].attn, idx.shape[1]
    q, k, _ = attn.c_attn(model.transformer.h[0].ln_1(model.transformer.wte(idx))).split(32, dim=2)
    q, k = (t.view(*idx.shape, 2, 16).transpose(1, 2) for t in (q, k))
    eye = torch.eye(T).expand(idx.shape[0], 2, T, T)
    if model.config.pos_encoding == "pope":
        return pope_attention(q, k, eye, attn.pope_delta, backend="torch")
    pos = torch.arange(T)
    return sdpa_attention(apply_rope(q, pos), apply_rope(k, pos), eye)


@pytest.mark.parametrize("pos_encoding", ["pope", "rope"])
def test_kv_cache_equals_full_forward_with_peaked_attention(pos_encoding):
    """As above with weights where attention matters: most queries put over 40 % of their weight on
    one key (uniform attention over 10-40 keys: 2.5-10 %), so wrong cached keys show."""
    model = peaked(pos_encoding)
    idx = torch.randint(0, 37, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        probs = layer0_attention_probs(model, idx)
        assert probs[:, :, 10:].amax(-1).median() > 0.4
        full, _ = model(idx)
        cache, pieces, start = KVCache(2, 40), [], 0
        for stop in (17, 18, 19, 26, 40):  # a prompt, single tokens, chunked prefills of 7 and 14
            pieces.append(model(idx[:, start:stop], kv_cache=cache)[0])
            start = stop
        torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-4, rtol=1e-4)
        out = model.generate(idx[:, :30], 10, temperature=0)
        assert torch.equal(out[:, 30:], model(out[:, :-1])[0][:, 29:].argmax(-1))


@pytest.mark.parametrize("pos_encoding", ["pope", "rope"])
def test_generate_greedy_matches_argmax_of_full_forward(pos_encoding):
    model = tiny(pos_encoding)
    prompt = torch.randint(0, 37, (2, 5))
    out = model.generate(prompt, 6, temperature=0)
    logits, _ = model(out[:, :-1])
    assert torch.equal(out[:, 5:], logits[:, 4:].argmax(-1))


@pytest.mark.parametrize("pos_encoding", ["pope", "rope"])
def test_logits_invariant_to_a_common_position_shift(pos_encoding):
    """Relative encodings: the same tokens placed at positions P.. give the same logits."""
    model = tiny(pos_encoding)
    idx = torch.randint(0, 37, (1, 9))
    base, _ = model(idx)
    cache = KVCache(2, 600)
    cache.q_offset = 500  # nothing cached: the tokens simply start at absolute position 500
    shifted = _forward_without_prefix(model, idx, cache)
    torch.testing.assert_close(shifted, base, atol=1e-3, rtol=1e-3)


def _forward_without_prefix(model, idx, cache):
    """Forward idx at positions cache.q_offset.. attending only to itself: the empty cache slots before
    cache.q_offset are cut off, and the causal masks shifted to match; PoPE's decoding sees the cut cache with
    the rotation table's rows from cache.q_offset on, so its keys and queries keep their absolute phases."""
    import model as model_mod

    start = cache.q_offset
    original, decode = model_mod.KVCache.update, model_mod.pope_attention_decode

    def update(self, layer, k, v):
        ks, vs = original(self, layer, k, v)
        return ks[:, :, start:], vs[:, :, start:]

    def shifted_decode(q, mu, v, delta, *, rotation, q_offset, **kw):  # the cut cache's key j sits at start + j
        return decode(q, mu, v, delta, rotation=rotation[start:], q_offset=q_offset - start, **kw)

    from unittest import mock

    with (
        mock.patch.object(model_mod.KVCache, "update", update),
        mock.patch.object(model_mod, "pope_attention_decode", shifted_decode),
        mock.patch.object(model_mod, "sdpa_attention", _shifted(model_mod.sdpa_attention, start)),
    ):
        logits, _ = model(idx, kv_cache=cache)
    return logits


def _shifted(fn, start):
    def call(*args, q_offset=0, **kw):
        return fn(*args, q_offset=q_offset - start, **kw)

    return call


def test_rope_rotation_preserves_norm_and_relative_angle():
    x = torch.randn(1, 1, 5, 8, dtype=torch.float64)
    pos = torch.arange(5)
    r = apply_rope(x, pos)
    torch.testing.assert_close(r.norm(dim=-1), x.norm(dim=-1).float().double(), atol=1e-5, rtol=1e-5)
    a, b = apply_rope(x, pos + 100), apply_rope(x, pos)
    torch.testing.assert_close(a @ a.transpose(-1, -2), b @ b.transpose(-1, -2), atol=1e-4, rtol=1e-4)


def test_delta_init_ranges():
    zero = tiny("pope", pope_delta_init="zero")
    uni = tiny("pope", pope_delta_init="uniform")
    assert all(b.attn.pope_delta.abs().max() == 0 for b in zero.transformer.h)
    d = torch.cat([b.attn.pope_delta.flatten() for b in uni.transformer.h])
    assert d.min() >= -2 * math.pi and d.max() <= 0 and d.std() > 1.0  # uniform on [-2pi, 0]: std 1.81
    assert tiny("pope", pope_use_delta=False).transformer.h[0].attn.pope_delta is None


def test_delta_stays_in_box_and_keeps_receiving_gradient():
    """Large steps push delta against both walls; after each step the projection puts it back in
    [-2pi, 0], and the next backward still gives it a nonzero gradient (no dead clamp)."""
    model = tiny("pope", pope_delta_init="uniform").train()
    opt = model.configure_optimizers(0.01, 1.0, (0.9, 0.99), "cpu")  # lr 1.0: delta hits the walls
    idx = torch.randint(0, 37, (4, 12))
    at_wall = False
    for _ in range(6):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        grads = [b.attn.pope_delta.grad for b in model.transformer.h]
        assert all(g is not None and g.abs().sum() > 0 for g in grads)
        opt.step()
        opt.zero_grad()
        model.clamp_pope_delta_()
        d = torch.cat([b.attn.pope_delta.flatten() for b in model.transformer.h])
        assert d.min() >= -2 * math.pi and d.max() <= 0
        at_wall |= bool(((d == 0) | (d == -2 * math.pi)).any())
    assert at_wall


def test_no_weight_decay_on_delta_norms_biases():
    model = tiny("pope", bias=True)
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in decayed}
    assert names and all(n.endswith("weight") and "ln" not in n for n in names)
    assert not any("pope_delta" in n for n in names)


def test_targets_minus_one_are_ignored():
    model = tiny("pope")
    idx = torch.randint(0, 37, (2, 8))
    targets = torch.full((2, 8), -1)
    targets[:, -1] = idx[:, 0]
    logits, loss = model(idx, targets)
    want = torch.nn.functional.cross_entropy(logits[:, -1], idx[:, 0])
    torch.testing.assert_close(loss, want)


def test_flops_pope_adds_one_head_dim_of_qk_per_layer():
    """PoPE's Cartesian QK^T is 2d wide: 6 * n_layer * n_head * T * head_dim extra FLOPs per token,
    plus its 6 * n_layer * n_head * head_dim delta parameters. Without the embedding (vocab 64)
    the ratio at 6 layers, 384 wide, T=1024 is the paper's 1.15x."""
    kw = dict(n_layer=6, n_head=6, n_embd=384, vocab_size=64)
    a = GPT(GPTConfig(pos_encoding="rope", **kw)).flops_per_token(1024)
    b = GPT(GPTConfig(pos_encoding="pope", **kw)).flops_per_token(1024)
    assert b - a == 6 * 6 * 6 * 1024 * 64 + 6 * 6 * 6 * 64
    assert 1.14 < b / a < 1.16


@pytest.mark.parametrize(
    "settings",
    [{}, {"pope_use_delta": False}, {"pope_magnitude": "relu"}, {"pope_magnitude": "identity", "n_kv_head": 1}],
    ids=["default", "no_delta", "relu", "identity_gqa"],
)
def test_kv_cache_holds_key_magnitudes_for_both_backends(settings):
    """Both PoPE backends cache the keys' magnitudes mu_k (d wide, RoPE's width; KVCache docstring) and decode
    (a prompt, one token, a chunk of 4) to the full forward's logits, with attention that matters (Triton in its
    interpreter on CPU, compiled on CUDA), with and without delta, every magnitude, grouped heads."""
    import pope

    if pope.pope_kernel is None:
        pytest.skip("triton is not importable")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = sharp("pope", **settings).to(dev)  # attention weights scaled up: peaked attention
    n_kv = settings.get("n_kv_head", 2)
    idx = torch.randint(0, 37, (1, 12), generator=torch.Generator().manual_seed(2)).to(dev)
    attn = model.transformer.h[0].attn
    with torch.no_grad():
        full, _ = model(idx)
        assert full.std() > 0.5
        raw_k = attn.c_attn(model.transformer.h[0].ln_1(model.transformer.wte(idx))).split(
            (32, 16 * n_kv, 16 * n_kv), 2
        )[1]
        raw_k = raw_k.view(1, 12, n_kv, 16).transpose(1, 2)
        for backend in ("torch", "triton"):
            model.config.attn_backend = backend
            cache = KVCache(2, 12)
            pieces = [
                model(idx[:, :7], kv_cache=cache)[0],
                model(idx[:, 7:8], kv_cache=cache)[0],
                model(idx[:, 8:], kv_cache=cache)[0],
            ]
            assert cache.k[0].shape == (1, n_kv, 12, 16) and cache.v[0].shape[-1] == 16 and cache.q_offset == 12
            torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-4, rtol=1e-4)
            mu = pope.pope_magnitude(raw_k, settings.get("pope_magnitude", "softplus"))
            torch.testing.assert_close(cache.k[0], mu, atol=1e-6, rtol=1e-6)  # layer 0: the keys' magnitudes


# --- tests against independent references, with weights that make attention matter --------------
# A randomly initialised tiny GPT attends almost uniformly (scores ~1e-3), so a broken position
# encoding or a decode that forgets its context barely moves the logits. `sharp` scales the
# attention weights up until the scores are O(5) and attention outputs dominate the residual stream.


def sharp(pos_encoding, seed=0, **kw):
    model = tiny(pos_encoding, **kw)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("attn.c_attn.weight"):
                p.mul_(15.0)
            elif name.endswith("attn.c_proj.weight"):
                p.mul_(30.0)
        model.lm_head.weight.mul_(10.0)  # tied with wte; logits O(1), argmax gaps well above rounding
    return model


def _rmsnorm(x, w):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + torch.finfo(torch.float32).eps) * w


def _roformer(x, pos, theta):
    """RoFormer rotation (Su et al. 2021, eq. 13-15) written out in float64: channel pair
    (c, c + d/2) (GPT-NeoX pairing) is rotated by pos * theta^(-2c/d) radians, c = 0..d/2-1."""
    d = x.shape[-1]
    out = torch.empty_like(x)
    for c in range(d // 2):
        a = pos.double() * theta ** (-2.0 * c / d)
        x1, x2 = x[..., c], x[..., c + d // 2]
        out[..., c] = x1 * torch.cos(a) - x2 * torch.sin(a)
        out[..., c + d // 2] = x1 * torch.sin(a) + x2 * torch.cos(a)
    return out


def reference_logits(model, idx):
    """The GPT's logits recomputed in float64 from its state_dict, attention written out by hand:
    RoPE rotates queries AND keys (RoFormer); PoPE scores are sum_c softplus(q_c) softplus(k_c)
    cos((s - t) theta^(-c/d) + delta_c) / sqrt(d) (paper, Method); NoPE is plain softmax attention."""
    cfg = model.config
    sd = {k: v.double() for k, v in model.state_dict().items()}
    H, d, T = cfg.n_head, cfg.n_embd // cfg.n_head, idx.shape[1]
    H_kv = cfg.n_kv_head or H  # grouped-query attention: repeat each key/value head (and delta) over its group
    pos = torch.arange(T, dtype=torch.float64)
    causal = torch.ones(T, T).tril().bool()
    x = sd["transformer.wte.weight"][idx]
    for layer in range(cfg.n_layer):
        p = f"transformer.h.{layer}."
        h = _rmsnorm(x, sd[p + "ln_1.weight"])
        q, k, v = (h @ sd[p + "attn.c_attn.weight"].T).split((H * d, H_kv * d, H_kv * d), -1)
        q = q.view(*q.shape[:2], H, d).transpose(1, 2)  # (B, H, T, d)
        k, v = (t.view(*t.shape[:2], H_kv, d).transpose(1, 2).repeat_interleave(H // H_kv, 1) for t in (k, v))
        if cfg.pos_encoding == "pope":
            freqs = cfg.rope_theta ** (-torch.arange(d, dtype=torch.float64) / d)
            delta = sd[p + "attn.pope_delta"].repeat_interleave(H // H_kv, 0)  # (H_kv, d) -> (H, d)
            angle = (pos[None, :] - pos[:, None])[None, :, :, None] * freqs + delta[:, None, None, :]
            mq, mk = torch.nn.functional.softplus(q), torch.nn.functional.softplus(k)
            scores = torch.einsum("bhtc,bhsc,htsc->bhts", mq, mk, torch.cos(angle)) / math.sqrt(d)
        else:
            if cfg.pos_encoding == "rope":
                q, k = _roformer(q, pos, cfg.rope_theta), _roformer(k, pos, cfg.rope_theta)
            scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        att = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
        y = (att @ v).transpose(1, 2).reshape(*x.shape)
        x = x + y @ sd[p + "attn.c_proj.weight"].T
        h = _rmsnorm(x, sd[p + "ln_2.weight"])
        x = x + torch.nn.functional.gelu(h @ sd[p + "mlp.c_fc.weight"].T) @ sd[p + "mlp.c_proj.weight"].T
    return _rmsnorm(x, sd["transformer.ln_f.weight"]) @ sd["lm_head.weight"].T


def test_apply_rope_equals_the_roformer_rotation():
    x = torch.randn(2, 3, 40, 16, dtype=torch.float64)
    pos = torch.arange(40) * 7 + 3  # angles up to ~280 rad at the highest frequency
    for theta in (10000.0, 500.0):
        torch.testing.assert_close(apply_rope(x, pos, theta).double(), _roformer(x, pos, theta), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("pos_encoding", ["rope", "pope", "none"])
def test_logits_equal_a_float64_reference_forward(pos_encoding):
    """The whole model against a from-scratch float64 forward with attention that matters: a wrong
    rotation (keys unrotated, other frequencies, other pairing), a wrong PoPE phase or a wrong
    causal alignment moves the logits by O(1), far above the 1e-3 tolerance."""
    model = sharp(pos_encoding, rope_theta=100.0)  # a small base: low frequencies turn within T=24 too
    idx = torch.randint(0, 37, (2, 24))
    got, _ = model(idx)
    want = reference_logits(model, idx)
    assert want.std() > 0.5
    torch.testing.assert_close(got.double(), want, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("pos_encoding", ["pope", "rope"])
def test_sharp_kv_cache_decoding_equals_full_forward(pos_encoding):
    model = sharp(pos_encoding)
    idx = torch.randint(0, 37, (3, 19))
    full, _ = model(idx)
    cache, pieces, start = KVCache(2, 19), [], 0
    for stop in (7, 8, 9, 13, 19):  # a prompt, single tokens, then a chunked prefill of 4 and of 6
        logits, _ = model(idx[:, start:stop], kv_cache=cache)
        pieces.append(logits)
        start = stop
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=2e-4, rtol=1e-4)


DECODE_SETTINGS = {  # GPTConfig settings the decode step must use as the full forward does
    "pope_theta_500k": dict(pos_encoding="pope", rope_theta=500000.0),  # Llama-3's base
    "rope_theta_500k": dict(pos_encoding="rope", rope_theta=500000.0),
    "pope_relu": dict(pos_encoding="pope", pope_magnitude="relu"),
    "pope_identity": dict(pos_encoding="pope", pope_magnitude="identity"),
    "pope_no_delta": dict(pos_encoding="pope", pope_use_delta=False),
}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize("name", DECODE_SETTINGS)
def test_kv_cache_decoding_keeps_the_model_settings(name, autocast):
    """Decode parity beyond the defaults: a prompt, single tokens and a chunk through the KV cache give the
    full forward's logits at rope_theta = 500000, with PoPE's ReLU and identity magnitudes, in fp32 and
    under CPU bf16 autocast. The weights make attention peaked (sharp), so a decode step that fell back to
    the default base (10000) or to softplus moves the logits by far more than the tolerance."""
    model = sharp(
        DECODE_SETTINGS[name]["pos_encoding"], **{k: v for k, v in DECODE_SETTINGS[name].items() if k != "pos_encoding"}
    )
    idx = torch.randint(0, 37, (2, 19), generator=torch.Generator().manual_seed(9))
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    with torch.no_grad(), ctx:
        full, _ = model(idx)
        cache, pieces, start = KVCache(2, 19), [], 0
        for stop in (7, 8, 9, 13, 19):
            pieces.append(model(idx[:, start:stop], kv_cache=cache)[0])
            start = stop
    got = torch.cat(pieces, 1).float()
    assert full.float().std() > 0.5
    tol = 0.1 if autocast else 2e-4  # bf16 (8 bits) rounds differently along the two paths: seen up to 0.03
    torch.testing.assert_close(got, full.float(), atol=tol, rtol=tol / 10)


@pytest.mark.parametrize("pos_encoding", ["pope", "rope"])
def test_generate_uses_the_context(pos_encoding):
    """Greedy generate equals step-by-step argmax of full forwards over everything so far, with
    weights under which a token's prediction depends on its context (checked: the token alone, at
    position 0, predicts something else at several steps)."""
    model = sharp(pos_encoding)
    prompt = torch.randint(0, 37, (4, 6))
    out = model.generate(prompt, 10, temperature=0)
    seq = prompt
    for _ in range(10):
        logits, _ = model(seq)
        seq = torch.cat((seq, logits[:, -1:].argmax(-1)), 1)
    assert torch.equal(out, seq)
    alone = torch.stack([model(seq[:, t : t + 1])[0][:, 0].argmax(-1) for t in range(5, 15)], 1)
    assert (alone != seq[:, 6:]).float().mean() > 0.3  # the test has teeth: context changes the tokens


def test_sampling_follows_softmax_over_top_k_at_the_temperature():
    """4000 one-token samples from one prompt: frequencies match softmax(logits / T) renormalised
    over the top_k tokens (chi-square, df = top_k - 1); nothing outside the top k is drawn."""
    from test_data import chisquare_p

    model = sharp("pope")
    prompt = torch.randint(0, 37, (1, 6))
    with torch.no_grad():
        logits = model(prompt)[0][0, -1].double()
    temperature, top_k, n = 1.7, 5, 4000
    top = logits.topk(top_k).indices
    p = torch.softmax(logits[top] / temperature, -1)
    assert p.min() > 0.02 and p.max() < 0.9  # every kept token is drawn often enough to count
    torch.manual_seed(1)
    drawn = model.generate(prompt.repeat(n, 1), 1, temperature=temperature, top_k=top_k)[:, -1]
    assert set(drawn.tolist()) <= set(top.tolist())
    counts = torch.stack([(drawn == t).sum() for t in top]).double()
    assert chisquare_p(counts.numpy(), (p * n).numpy()) > 1e-3
    torch.manual_seed(1)
    one = model.generate(prompt.repeat(50, 1), 1, temperature=temperature, top_k=1)[:, -1]
    assert (one == logits.argmax()).all()


def test_clamp_pope_delta_projects_onto_the_box():
    model = tiny("pope")
    vals = torch.tensor([-10.0, -2 * math.pi - 1e-3, -5.0, -3.5, -1.0, 0.0, 1e-3, 4.0])
    with torch.no_grad():
        for b in model.transformer.h:
            b.attn.pope_delta.copy_(vals.repeat(b.attn.pope_delta.numel() // len(vals)).view_as(b.attn.pope_delta))
    model.clamp_pope_delta_()
    want = torch.tensor([-2 * math.pi, -2 * math.pi, -5.0, -3.5, -1.0, 0.0, 0.0, 0.0])
    for b in model.transformer.h:
        torch.testing.assert_close(b.attn.pope_delta.flatten()[:8], want)


def test_weight_decay_by_value_per_parameter():
    """One AdamW step with all gradients zero moves only the decayed parameters, each by exactly
    p * (1 - lr * weight_decay): the matrices (token embedding, c_attn, c_proj, c_fc) and nothing
    else (not delta, the RMSNorm gains, the biases)."""
    model = tiny("pope", bias=True)
    lr, wd = 0.01, 0.5
    opt = model.configure_optimizers(wd, lr, (0.8, 0.95), "cpu")
    params = [p for g in opt.param_groups for p in g["params"]]
    assert len(params) == len({id(p) for p in params}) == len(list(model.parameters()))
    for g in opt.param_groups:
        assert g["lr"] == lr and g["betas"] == (0.8, 0.95)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        matrix = n.split(".")[-2] in ("wte", "c_attn", "c_proj", "c_fc", "lm_head") and n.endswith("weight")
        want = before[n] * (1 - lr * wd) if matrix else before[n]
        torch.testing.assert_close(p.detach(), want, atol=0, rtol=1e-6, msg=n)


PARTS = {  # torch.cuda.get_device_name() -> dense bf16 (V100: fp16) TFLOP/s, from NVIDIA's datasheets
    "NVIDIA H100 80GB HBM3": 989,
    "NVIDIA H100 SXM5 80GB": 989,
    "NVIDIA H100 PCIe": 756,
    "NVIDIA H100 NVL": 835,
    "NVIDIA H200": 989,
    "NVIDIA H200 NVL": 835,
    "NVIDIA GH200 480GB": 989,
    "NVIDIA B200": 2250,
    "NVIDIA A100-SXM4-80GB": 312,
    "NVIDIA A100-SXM4-40GB": 312,
    "NVIDIA A100-PCIE-40GB": 312,
    "NVIDIA A100 80GB PCIe": 312,
    "NVIDIA A800-SXM4-80GB": 312,
    "NVIDIA A10G": 70,
    "NVIDIA A10": 125,
    "NVIDIA L40S": 362,
    "NVIDIA L40": 181,
    "NVIDIA L4": 121,
    "Tesla V100-SXM2-16GB": 125,
    "Tesla V100-PCIE-32GB": 112,
    "Tesla V100S-PCIE-32GB": 130,
    "NVIDIA GeForce RTX 4090": 165,
    "NVIDIA GeForce RTX 3090": 71,
    "NVIDIA RTX A6000": 155,
    # unknown parts, or names that do not say which form factor: no figure (MFU "n/a")
    "NVIDIA H100": None,
    "NVIDIA GeForce RTX 3090 Ti": None,
    "NVIDIA GeForce RTX 4090 D": None,
    "NVIDIA GeForce GTX 1080 Ti": None,
    "NVIDIA L20": None,
    "AMD Instinct MI300X": None,
    "Tesla T4": None,
}


@pytest.mark.parametrize("name", PARTS)
def test_peak_flops_per_gpu_part(name, monkeypatch):
    """device_peak_flops reads what each part's name really contains (torch's device name patched)."""
    from model import device_peak_flops

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    want = PARTS[name]
    assert device_peak_flops("cuda:0", "bfloat16") == (want and want * 1e12)
    assert device_peak_flops("cuda", "float32") == (want and want * 1e12 / 2)
    assert device_peak_flops("cpu", "bfloat16") is None


# ---- GPT.rotation: one table for every layer, grown by powers of two (issue 51) ----------------------------------


def _rotation_formula(pos_encoding, n_positions, head_dim, rope_theta=10000.0):
    """The table written out in float64: RoPE [cos | sin] of t * theta^(-2i/d) (d/2 pairs), PoPE [cos | sin] of
    t * theta_c for PoPE's d float32 frequencies theta^(-(c-1)/d)."""
    t = torch.arange(n_positions, dtype=torch.float64)[:, None]
    if pos_encoding == "rope":
        freqs = rope_theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    else:
        freqs = (rope_theta ** (-torch.arange(head_dim, dtype=torch.float64) / head_dim)).float().double()
    return torch.cat((torch.cos(t * freqs), torch.sin(t * freqs)), dim=-1)


@pytest.mark.parametrize("pos_encoding", ["pope", "rope"])
def test_the_rotation_table_grows_to_the_next_power_of_two_only_when_a_position_needs_it(pos_encoding):
    """block_size 16: the table starts at 16 rows and is left as it is (the same tensor: no rebuild, which under
    torch.compile is a graph break) for any length it covers, a forward of exactly block_size included; 17
    to 32 positions grow it to 32, 33 to 64, 65 to 128 (a sweep over lengths rebuilds it a few times, not
    once per length): exactly 32 positions make 32 rows, not 64. Its rows are the float64 formula's, rounded to
    float32."""
    model = tiny(pos_encoding)
    table = model.rotation
    assert table.shape[0] == 16
    for n in (1, 15, 16):
        model.ensure_positions(n)
        assert model.rotation is table, n
    with torch.no_grad():
        model(torch.randint(0, 37, (1, 16)))
    assert model.rotation is table
    for n, rows in ((32, 32), (20, 32), (33, 64), (64, 64), (65, 128)):
        model.ensure_positions(n)
        assert model.rotation.shape[0] == rows, (n, model.rotation.shape)
    torch.testing.assert_close(model.rotation.double(), _rotation_formula(pos_encoding, 128, 16), atol=1e-7, rtol=0)


@pytest.mark.parametrize("pos_encoding", ["pope", "rope"])
def test_kv_cache_decoding_past_block_size_on_a_fresh_model(pos_encoding):
    """A fresh model (its table has block_size = 16 rows) continues a cache past position 16: each piece's
    positions are cache.q_offset.., so the table must cover q_offset + T, not T. The pieces' logits equal the
    full forward's (run afterwards, on another copy, so nothing grew the table first)."""
    idx = torch.randint(0, 37, (2, 30), generator=torch.Generator().manual_seed(4))
    model = peaked(pos_encoding)
    cache, pieces, start = KVCache(2, 30), [], 0
    with torch.no_grad():
        for stop in (12, 13, 17, 18, 30):
            pieces.append(model(idx[:, start:stop], kv_cache=cache)[0])
            start = stop
        full, _ = peaked(pos_encoding)(idx)
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=2e-4, rtol=1e-4)


def test_the_rotation_table_is_not_in_checkpoints():
    """GPT.rotation is rebuilt from the config (and grown by use), never saved: a state_dict has no such key, so a
    model whose table grew loads into a fresh one (strict), and so do checkpoints written before the table."""
    for pos_encoding in ("pope", "rope", "rope_half"):
        model = tiny(pos_encoding)
        model.ensure_positions(100)
        sd = model.state_dict()
        assert not [k for k in sd if "rotation" in k], pos_encoding
        fresh = tiny(pos_encoding)
        fresh.load_state_dict(sd, strict=True)
        assert fresh.rotation.shape[0] == 16 and model.rotation.shape[0] == 128
