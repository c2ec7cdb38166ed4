"""GPT: causality, KV-cache decoding, relative-position invariance, the PoPE phase bias delta."""

import math

import pytest
import torch

from model import GPT, GPTConfig, KVCache, apply_rope


def tiny(pos_encoding, **kw):
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=16, vocab_size=37, n_layer=2, n_head=2, n_embd=32, pos_encoding=pos_encoding,
                    attn_backend="torch", **kw)
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


def sharp(pos_encoding, gain=30.0):
    """tiny() with its query/key weights scaled by `gain`: peaked, position-dependent attention, so
    a cache that gets a key's position, phase bias or magnitude wrong changes the logits."""
    model = tiny(pos_encoding)
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight[:2 * 32] *= gain  # rows of q and k (n_embd = 32)
    return model


def layer0_attention_probs(model, idx):
    """(B, H, T, T) softmax probabilities of layer 0, read out by attending over one-hot values."""
    from pope_kernel import pope_attention, sdpa_attention
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
    model = sharp(pos_encoding)
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
    cache.pos = 500  # nothing cached: the tokens simply start at absolute position 500
    shifted = _forward_without_prefix(model, idx, cache)
    torch.testing.assert_close(shifted, base, atol=1e-3, rtol=1e-3)


def _forward_without_prefix(model, idx, cache):
    """Forward idx at positions cache.pos.. attending only to itself (keys before cache.pos masked)."""
    import model as model_mod
    start = cache.pos
    original = model_mod.KVCache.update

    def update(self, layer, k, v):
        ks, vs = original(self, layer, k, v)
        return ks[:, :, start:], vs[:, :, start:]
    from unittest import mock
    with mock.patch.object(model_mod.KVCache, "update", update), \
            mock.patch.object(model_mod, "pope_attention", _shifted(model_mod.pope_attention, start)), \
            mock.patch.object(model_mod, "sdpa_attention", _shifted(model_mod.sdpa_attention, start)):
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
    assert tiny("pope", pope_delta=False).transformer.h[0].attn.pope_delta is None


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


def test_kv_cache_form_per_backend_and_triton_decoding_matches(monkeypatch):
    """The torch path caches 2d-wide Cartesian keys, the Triton kernel raw d-wide keys (KVCache
    docstring); both decode to the full forward's logits (Triton in its interpreter on CPU)."""
    import pope_kernel
    if pope_kernel.triton is None:
        pytest.skip("triton is not importable")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = sharp("pope")
    idx = torch.randint(0, 37, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full, _ = model(idx)
        for backend, width in (("torch", 32), ("triton", 16)):
            model.config.attn_backend = backend
            cache = KVCache(2, 12)
            pieces = [model(idx[:, :7], kv_cache=cache)[0], model(idx[:, 7:8], kv_cache=cache)[0],
                      model(idx[:, 8:], kv_cache=cache)[0]]
            assert cache.k[0].shape[-1] == width and cache.v[0].shape[-1] == 16
            torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-4, rtol=1e-4)
