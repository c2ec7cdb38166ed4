"""Grouped-query attention (GPTConfig.n_kv_head): every encoding against a model with one key/value
head per query head whose key/value weights (and PoPE's delta) are copies over each group, the float64
reference forward, KV-cache decoding, the cache's size, and a train / resume / sample / evaluate round trip.

The attention-level check of both PoPE backends (the Triton kernel under the interpreter, and the
torch path) against float64 with k, v, delta repeated over each group is
tests/test_pope_triton.py::test_grouped_query_attention_matches_reference_with_repeated_kv."""

import collections
import math
import os

import pytest
import torch
from test_model import reference_logits, sharp
from test_train import TINY, run
from torch.utils._python_dispatch import TorchDispatchMode

import eval_extrapolate
import sample
from model import GPT, GPTConfig, KVCache
from pope import pope_attention, pope_attention_decode, pope_key_magnitude

H, D = 4, 8  # 4 query heads of width 8 (n_embd 32)
ENCODINGS = ["pope", "rope", "yarn", "none", "rope_half", "alibi_half", "learned", "sinusoidal"]


def gqa_sharp(pos_encoding, n_kv_head, seed=0):
    """sharp() with 4 query heads sharing n_kv_head key/value heads (YaRN: RoPE with s = 2, L = 16)."""
    kw = dict(rope_scaling=2.0, rope_original_block_size=16) if pos_encoding == "yarn" else {}
    enc = "rope" if pos_encoding == "yarn" else pos_encoding
    return sharp(enc, seed=seed, n_head=H, n_kv_head=n_kv_head, block_size=32, **kw)


def expanded(model):
    """The same model with n_kv_head = n_head: each key/value head's projection rows and delta copied to
    every query head of its group (query head h reads key/value head h // (n_head / n_kv_head))."""
    cfg = model.config
    G = cfg.n_head // cfg.n_kv_head
    twin = GPT(GPTConfig(**{**cfg.__dict__, "n_kv_head": None})).eval()
    sd = {}
    for name, t in model.state_dict().items():
        if name.endswith("attn.c_attn.weight"):
            C = cfg.n_embd
            q, k, v = t.split((C, cfg.n_kv_head * D, cfg.n_kv_head * D))
            k, v = (x.view(cfg.n_kv_head, D, C).repeat_interleave(G, 0).reshape(C, C) for x in (k, v))
            t = torch.cat((q, k, v))
        elif name.endswith("attn.pope_delta"):
            t = t.repeat_interleave(G, 0)
        sd[name] = t
    twin.load_state_dict(sd)
    return twin


def summed_over_groups(grad_full, n_kv_head, rows_per_head):
    """(n_head * rows_per_head, ...) gradient of the expanded model -> (n_kv_head * rows_per_head, ...)."""
    G = H // n_kv_head
    return grad_full.view(n_kv_head, G, rows_per_head, *grad_full.shape[1:]).sum(1).reshape(-1, *grad_full.shape[1:])


def test_config_checks_and_shapes():
    for bad in (3, 0, 5, -2, "2", 2.0, True):
        with pytest.raises(ValueError, match="n_kv_head"):
            GPTConfig(n_head=4, n_embd=32, n_kv_head=bad)
    attn = (
        GPT(GPTConfig(block_size=8, vocab_size=11, n_layer=1, n_head=4, n_kv_head=2, n_embd=32)).transformer.h[0].attn
    )
    assert attn.c_attn.weight.shape == ((4 + 2 * 2) * 8, 32) and attn.pope_delta.shape == (2, 8)
    assert GPT(GPTConfig(block_size=8, vocab_size=11, n_layer=1, n_head=4, n_embd=32)).transformer.h[
        0
    ].attn.c_attn.weight.shape == (96, 32)  # None: one key/value head per query head, the checkpoint layout of before


@pytest.mark.parametrize("pos_encoding", ENCODINGS)
@pytest.mark.parametrize("n_kv_head", [1, 2])
def test_gqa_equals_the_model_with_keys_and_values_copied_over_each_group(pos_encoding, n_kv_head):
    """Logits equal, and every gradient of the grouped model is the expanded model's summed over each
    group: the query rows as they are, the key/value rows and delta over the query heads that share them."""
    model = gqa_sharp(pos_encoding, n_kv_head)
    twin = expanded(model)
    idx = torch.randint(0, 37, (2, 24), generator=torch.Generator().manual_seed(3))
    tgt = torch.randint(0, 37, (2, 24), generator=torch.Generator().manual_seed(4))
    logits, loss = model(idx, tgt)
    logits_twin, loss_twin = twin(idx, tgt)
    assert logits.std() > 0.5  # attention that matters: see sharp()
    torch.testing.assert_close(logits, logits_twin, atol=2e-4, rtol=1e-4)
    loss.backward()
    loss_twin.backward()
    C = 32
    for (name, p), p_twin in zip(model.named_parameters(), twin.parameters()):
        g, g_twin = p.grad, p_twin.grad
        if name.endswith("attn.c_attn.weight"):
            q, k, v = g.split((C, n_kv_head * D, n_kv_head * D))
            q_t, k_t, v_t = g_twin.split(C)
            g, g_twin = (
                torch.cat((q, k, v)),
                torch.cat((q_t, summed_over_groups(k_t, n_kv_head, D), summed_over_groups(v_t, n_kv_head, D))),
            )
        elif name.endswith("attn.pope_delta"):
            g_twin = summed_over_groups(g_twin, n_kv_head, 1)
        torch.testing.assert_close(g, g_twin, atol=2e-4, rtol=1e-3, msg=name)


@pytest.mark.parametrize("pos_encoding", ["pope", "rope", "none"])
def test_gqa_logits_equal_the_float64_reference_forward(pos_encoding):
    """The from-scratch float64 forward of tests/test_model.py, which repeats k, v and delta over each group."""
    model = gqa_sharp(pos_encoding, 2)
    idx = torch.randint(0, 37, (2, 24), generator=torch.Generator().manual_seed(5))
    want = reference_logits(model, idx)
    assert want.std() > 0.5
    torch.testing.assert_close(model(idx)[0].double(), want, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("pos_encoding", ["pope", "rope", "alibi_half"])
@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
def test_gqa_kv_cache_decoding_equals_full_forward(pos_encoding, n_kv_head):
    """Prompt, single tokens and chunked prefills through the cache give the full forward's logits, with
    attention peaked enough that a key read from the wrong head or position changes them."""
    model = gqa_sharp(pos_encoding, n_kv_head)
    idx = torch.randint(0, 37, (3, 19), generator=torch.Generator().manual_seed(6))
    full, _ = model(idx)
    cache, pieces, start = KVCache(2, 19), [], 0
    for stop in (7, 8, 9, 13, 19):
        pieces.append(model(idx[:, start:stop], kv_cache=cache)[0])
        start = stop
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=2e-4, rtol=1e-4)
    assert all(k.shape[1] == n_kv_head for k in cache.k)


def test_cached_pope_decode_step_reads_its_groups_key_head():
    """pope_attention_decode's single-token matmul path (grouped queries as (B, H_kv, G, 2d)) equals
    pope_attention on the raw keys, with keys so different per head that a wrong head shows."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (
        torch.randn(2, 6, 1, 16, generator=g) * 3,
        torch.randn(2, 2, 30, 16, generator=g) * 3,
        torch.randn(2, 2, 30, 16, generator=g),
    )
    delta = -2 * math.pi * torch.rand(2, 16, generator=g)
    want = pope_attention(q, k, v, delta, q_offset=29, backend="torch")
    got = pope_attention_decode(q, pope_key_magnitude(k), v, delta, q_offset=29, backend="torch")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    swapped = pope_attention(q, k.flip(1), v.flip(1), delta.flip(0), q_offset=29, backend="torch")
    assert (swapped - want).abs().max() > 0.1


class _AtenOps(TorchDispatchMode):
    """Counts the aten ops that run below autograd (SDPA's decomposition included) and keeps the shapes of
    their 4-D outputs."""

    def __enter__(self):
        self.counts, self.shapes = collections.Counter(), []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.counts[str(func.overloadpacket)] += 1
        self.shapes += [
            tuple(t.shape)
            for t in (out if isinstance(out, (tuple, list)) else (out,))
            if isinstance(t, torch.Tensor) and t.dim() == 4
        ]
        return out


@pytest.mark.parametrize("pos_encoding", ["pope", "rope", "alibi_half"])
def test_gqa_forward_and_decoding_make_no_copies_of_keys_and_values(pos_encoding):
    """The torch path hands SDPA n_kv_head heads (enable_gqa) and decodes one token with grouped queries:
    a model with 1 key/value head runs exactly the aten ops of the n_head model, op for op (training
    forward, a prefill, a chunk at q_offset 7, one token), and while decoding over 11 and 12 cached keys
    no op makes a (B, n_head, Tk, width) tensor, the shape of keys or values repeated over a group."""
    idx = torch.zeros(1, 12, dtype=torch.long)
    counts = []
    for n_kv_head in (1, None):
        model = gqa_sharp(pos_encoding, n_kv_head)
        cache = KVCache(model.config.n_layer, 12)
        with torch.no_grad(), _AtenOps() as ops:
            model(idx)
            model(idx[:, :7], kv_cache=cache)
        counts.append(ops.counts)
        with torch.no_grad(), _AtenOps() as decode_ops:
            for a, b in ((7, 11), (11, 12)):
                model(idx[:, a:b], kv_cache=cache)
        counts[-1] += decode_ops.counts
        if n_kv_head == 1:
            repeated = [s for s in decode_ops.shapes if s[1] == H and s[2] in (11, 12)]
            assert not repeated, f"keys or values repeated over the group while decoding: {repeated}"
    differ = {op: counts[0][op] - counts[1][op] for op in counts[0] | counts[1] if counts[0][op] != counts[1][op]}
    assert not differ, f"ops that run only with (or without) grouped heads: {differ}"


@pytest.mark.parametrize("pos_encoding", ["rope", "pope", "none"])
@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
def test_cache_size_is_layers_batch_kv_heads_tokens_and_width(pos_encoding, n_kv_head):
    """n_layer * B * n_kv_head * max_len * 2d for every encoding (PoPE caches d-wide key magnitudes)."""
    model = gqa_sharp(pos_encoding, n_kv_head)
    cache = KVCache(2, 20)
    model(torch.zeros(3, 5, dtype=torch.long), kv_cache=cache)
    assert cache.cache_bytes() == 2 * 3 * n_kv_head * 20 * 2 * D * 4


def test_train_resume_sample_and_evaluate_with_n_kv_head_2(toy_stream, tmp_path, capsys):
    """--n_kv_head=2 from the command line: the checkpoint keeps it; resume continues the run; sample.py and
    eval_extrapolate.py load the run; a fine-tune refuses another n_kv_head and accepts None = n_head."""
    out = str(tmp_path / "run")
    common = TINY + [
        f"--data_root={toy_stream}",
        "--dataset=toy",
        "--n_head=4",
        "--batch_size=8",
        "--block_size=32",
        f"--out_dir={out}",
    ]
    first = run(common + ["--n_kv_head=2", "--max_iters=4", "--eval_interval=4"])
    state = torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)
    assert state["model_args"]["n_kv_head"] == 2 and first["iter_num"] == 4
    assert state["model"]["transformer.h.0.attn.pope_delta"].shape == (2, state["model_args"]["n_embd"] // 4)
    second = run(common + ["--init_from=resume", "--max_iters=6", "--eval_interval=2"])
    assert second["iter_num"] == 6
    capsys.readouterr()
    text = sample.main([f"--out_dir={out}", "--start=[1, 2, 3]", "--max_new_tokens=5", "--device=cpu"])[0]
    assert isinstance(text, str)
    rows = eval_extrapolate.run(
        [
            out,
            f"--data_root={toy_stream}",
            "--dataset=toy",
            "--lengths=16,32",
            "--last_k=8",
            "--max_tokens=64",
            "--device=cpu",
            f"--out_dir={tmp_path / 'ee'}",
        ]
    )
    assert len(rows) == 2 and all(math.isfinite(r["ppl"]) for r in rows)
    ft = TINY + [
        f"--data_root={toy_stream}",
        "--dataset=toy",
        "--n_head=4",
        "--batch_size=8",
        "--block_size=32",
        "--init_from=finetune",
        f"--init_ckpt={out}/best.pt",
        "--max_iters=1",
        "--eval_interval=1",
    ]
    with pytest.raises(SystemExit) as e:
        run(ft + ["--n_kv_head=4", f"--out_dir={tmp_path / 'ft4'}"])
    assert e.value.code == 2 and "n_kv_head=2" in capsys.readouterr().err
    assert run(ft + ["--n_kv_head=2", f"--out_dir={tmp_path / 'ft2'}"])["iter_num"] == 1
    plain = str(tmp_path / "plain")  # n_kv_head None: one key/value head per query head, the same as 4
    run(common[:-1] + ["--max_iters=2", "--eval_interval=2", f"--out_dir={plain}"])
    ft[ft.index(f"--init_ckpt={out}/best.pt")] = f"--init_ckpt={plain}/best.pt"
    assert run(ft + ["--n_kv_head=4", f"--out_dir={tmp_path / 'ft_plain'}"])["iter_num"] == 1


def _mock_cuda(monkeypatch, capability, device=None):
    """Tensors claim to be CUDA tensors (and, with `device`, to live on that device) on a GPU of compute
    capability `capability`; returns the list of the devices the capability was asked about."""
    asked = []
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    if device is not None:
        monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device(device)))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (asked.append(d), capability)[1])
    return asked


def test_sdpa_gqa_expands_keys_and_values_where_cuda_sdpa_would_take_its_math_kernel(monkeypatch):
    """On CUDA, SDPA's enable_gqa runs only in its flash kernel and its O(T^2) math kernel, and flash takes
    neither fp32 nor an attn_mask: pope.sdpa_gqa repeats k and v to the query heads there (the memory-efficient
    kernel then runs), keeps enable_gqa for CUDA fp16 / bf16 without a mask on an sm_90 GPU and for CPU
    tensors, and does nothing without grouping. CUDA is mocked (Tensor.is_cuda, the capability)."""
    import pope

    q = torch.randn(1, 4, 5, 8)
    k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    for masked in (False, True):  # CPU: SDPA's fused CPU kernel takes grouped heads in fp32 and with a mask
        assert pope.sdpa_gqa(q, k, v, masked)[2] == {"enable_gqa": True}
    assert pope.sdpa_gqa(q, q, q, True) == (q, q, {})
    _mock_cuda(monkeypatch, (9, 0))
    for dtype, masked, expand in (
        (torch.float32, False, True),
        (torch.float32, True, True),
        (torch.bfloat16, True, True),
        (torch.float16, True, True),
        (torch.bfloat16, False, False),
        (torch.float16, False, False),
    ):
        kk, vv, kw = pope.sdpa_gqa(q.to(dtype), k.to(dtype), v.to(dtype), masked)
        if expand:
            assert kw == {} and torch.equal(kk, k.to(dtype).repeat_interleave(2, 1)), (dtype, masked)
            assert torch.equal(vv, v.to(dtype).repeat_interleave(2, 1))
        else:
            assert kw == {"enable_gqa": True} and kk.shape[1] == 2, (dtype, masked)


@pytest.mark.parametrize(
    "capability, flash",
    [
        ((6, 1), False),
        ((7, 0), False),
        ((7, 5), False),
        ((8, 0), True),
        ((8, 6), True),
        ((9, 0), True),
        ((10, 0), True),
        ((12, 0), True),
        ((12, 1), True),
        ((13, 0), False),
    ],
)
def test_sdpa_gqa_follows_sdpas_flash_rules_per_gpu(monkeypatch, capability, flash):
    """PyTorch's SDPA runs flash from sm_80 to sm_121 only (sdp_utils.cpp, check_flash_attention_hardware_support).
    Below (P100 sm_61, V100 sm_70, T4 sm_75) unmasked fp16 with enable_gqa would take the O(T^2) math kernel:
    sdpa_gqa expands k and v there, and keeps enable_gqa where flash runs. The capability is asked of the
    tensors' own device (cuda:1 here), not the current one. Through sdpa_attention (training, the causal
    prefill, one decoded token), SDPA gets the expanded or grouped heads so decided, and its output equals
    the float64 softmax attention with k, v repeated over each group."""
    import torch.nn.functional as F

    import pope

    g = torch.Generator().manual_seed(0)
    q = (2 * torch.randn(1, 4, 6, 16, generator=g)).half()
    k, v = ((2 * torch.randn(1, 2, 6, 16, generator=g)).half() for _ in range(2))
    asked = _mock_cuda(monkeypatch, capability, device="cuda:1")
    calls, real = [], F.scaled_dot_product_attention

    def sdpa(q, k, v, *args, **kw):
        calls.append((k.shape[1], v.shape[1], kw.get("enable_gqa", False)))
        return real(q, k, v, *args, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    got = [pope.sdpa_attention(q, k, v, causal=True), pope.sdpa_attention(q[:, :, -1:], k, v, q_offset=5)]
    assert calls == [(2, 2, True) if flash else (4, 4, False)] * 2, calls
    assert asked and all(d == torch.device("cuda:1") for d in asked), asked
    monkeypatch.undo()
    kr, vr = (t.double().repeat_interleave(2, 1) for t in (k, v))
    scores = q.double() @ kr.transpose(-1, -2) / 4
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.softmax(scores, -1) @ vr
    torch.testing.assert_close(got[0].double(), want, rtol=0, atol=4e-3)
    torch.testing.assert_close(got[1].double(), want[:, :, -1:], rtol=0, atol=4e-3)


def test_flash_sdpa_rules_beyond_the_gpu(monkeypatch):
    """The other rules of SDPA's can_use_flash_attention that sdpa_gqa's calls can meet: fp16 / bf16 only (also as
    the autocast dtype), no mask, one head dim for q, k, v of at most 256, flash not disabled, and on sm_86..89 and
    sm_120/121 no training at head dims in (192, 224]."""
    import pope

    asked = _mock_cuda(monkeypatch, (9, 0))
    h = lambda d, *s: torch.randn(*(s or (1, 2, 3)), d, dtype=torch.float16)  # noqa: E731
    assert pope.flash_sdpa_accepts(h(64), h(64), h(64), masked=False)
    assert not pope.flash_sdpa_accepts(h(64), h(64), h(64), masked=True)
    assert not pope.flash_sdpa_accepts(h(64).float(), h(64).float(), h(64).float(), masked=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the mocked tensors are CPU tensors underneath
        assert pope.flash_sdpa_accepts(h(64).float(), h(64).float(), h(64).float(), masked=False)
    assert pope.flash_sdpa_accepts(h(256), h(256), h(256), masked=False)
    assert not pope.flash_sdpa_accepts(h(264), h(264), h(264), masked=False)
    assert not pope.flash_sdpa_accepts(h(64), h(64), h(32), masked=False)
    prev = torch.backends.cuda.flash_sdp_enabled()
    torch.backends.cuda.enable_flash_sdp(False)
    try:
        assert not pope.flash_sdpa_accepts(h(64), h(64), h(64), masked=False)
    finally:
        torch.backends.cuda.enable_flash_sdp(prev)
    q200 = h(200).requires_grad_()
    for capability, training_ok in (
        ((8, 6), False),
        ((8, 9), False),
        ((12, 0), False),
        ((9, 0), True),
        ((8, 0), True),
        ((10, 0), True),
    ):
        _mock_cuda(monkeypatch, capability)
        assert pope.flash_sdpa_accepts(q200, h(200), h(200), masked=False) == training_ok, capability
        with torch.no_grad():
            assert pope.flash_sdpa_accepts(q200, h(200), h(200), masked=False), capability
        q232 = h(232).requires_grad_()
        assert pope.flash_sdpa_accepts(q232, h(232), h(232), masked=False), capability
    assert asked


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pos_encoding", ["rope", "alibi_half", "pope"])
def test_cuda_gqa_calls_sdpa_without_enable_gqa_where_flash_cannot_run(monkeypatch, pos_encoding, dtype):
    """A model with 2 key/value heads for 4 query heads, on (mocked) CUDA: every SDPA call of a training forward,
    a masked chunk at q_offset 7 and a decoding step that is float32 or has an attn_mask gets n_head key/value
    heads and no enable_gqa (which would send it to the O(T^2) math kernel); bf16 calls without a mask keep
    n_kv_head heads and enable_gqa (flash). The logits equal the unmocked CPU run's."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import CausalBias

    idx = torch.randint(0, 16, (1, 12), generator=torch.Generator().manual_seed(0))
    model = gqa_sharp(pos_encoding, 2).to(dtype)
    model.config.attn_backend = "torch"

    def outputs():
        cache = KVCache(model.config.n_layer, 12)
        with torch.no_grad():
            return [
                model(idx)[0],
                model(idx[:, :7], kv_cache=cache)[0],
                model(idx[:, 7:11], kv_cache=cache)[0],
                model(idx[:, 11:], kv_cache=cache)[0],
            ]

    want = outputs()
    calls, real = [], F.scaled_dot_product_attention

    def sdpa(q, k, v, *args, **kw):
        masked = kw.get("attn_mask") is not None
        expand = masked or q.dtype == torch.float32
        calls.append(
            (
                (q.shape[1], k.shape[1], v.shape[1], kw.get("enable_gqa", False)),
                (H, H, H, False) if expand else (H, 2, 2, True),
            )
        )
        if isinstance(kw.get("attn_mask"), CausalBias):  # pope.lower_right_attention (CUDA, q_offset = Tk - Tq):
            kw["attn_mask"] = kw["attn_mask"]._materialize(q.device)  # its fused-kernel dispatch needs a real GPU
        return real(q, k, v, *args, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    _mock_cuda(monkeypatch, (8, 0))
    got = outputs()
    assert calls and all(c == w for c, w in calls), calls
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_boolean_document_mask_with_grouped_heads_reaches_sdpa_with_expanded_keys_on_cuda(monkeypatch, dtype):
    """A boolean document mask (document_mask(flex=False): what a CPU batch builds, and a CUDA one where flex is not
    used) with grouped heads: on CUDA, SDPA's flash kernel takes no attn_mask and its memory-efficient kernel no
    enable_gqa, so enable_gqa there would run the O(T^2) math kernel. masked_attention and sdpa_attention(mask=)
    must hand SDPA k and v repeated to the query heads, even in fp16 / bf16 on an sm_90 GPU (where an unmasked call
    keeps enable_gqa). CUDA is mocked; the output equals each document attended alone (float64, k and v repeated)."""
    import torch.nn.functional as F

    import pope

    g = torch.Generator().manual_seed(1)
    lens = [3, 5, 4]
    ids = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lens)])[None]
    q = (2 * torch.randn(1, 4, 12, 16, generator=g)).to(dtype)
    k, v = ((2 * torch.randn(1, 2, 12, 16, generator=g)).to(dtype) for _ in range(2))
    mask = pope.document_mask(ids, flex=False)
    _mock_cuda(monkeypatch, (9, 0))
    calls, real = [], F.scaled_dot_product_attention

    def sdpa(q, k, v, *args, **kw):
        calls.append((k.shape[1], v.shape[1], kw.get("enable_gqa", False), kw.get("attn_mask") is not None))
        return real(q, k, v, *args, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    got = [pope.masked_attention(q, k, v, mask), pope.sdpa_attention(q, k, v, mask=mask)]
    pope.sdpa_attention(q, k, v, causal=True)  # the unmasked causal call keeps the grouped heads (flash)
    assert calls == [(4, 4, False, True)] * 2 + [(2, 2, True, False)], calls
    monkeypatch.undo()
    kr, vr = (t.double().repeat_interleave(2, 1) for t in (k, v))
    parts, start = [], 0
    for n in lens:  # each document alone, causal
        s = q.double()[:, :, start : start + n] @ kr[:, :, start : start + n].transpose(-1, -2) / 4
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        parts.append(torch.softmax(s, -1) @ vr[:, :, start : start + n])
        start += n
    want = torch.cat(parts, dim=2)
    for out in got:
        torch.testing.assert_close(out.double(), want, rtol=0, atol=3e-2)


@pytest.mark.parametrize("pos_encoding", ["rope", "alibi_half", "pope"])
def test_gpt_with_packed_documents_and_grouped_heads_hands_cuda_sdpa_expanded_keys(monkeypatch, pos_encoding):
    """GPT.forward with document_ids, grouped heads (4 query heads, 2 key/value heads) and the boolean mask (the CPU
    batch's; flex turned off), in bf16 on a GPU (mocked: CUDA tensors, sm_90): every layer's SDPA call gets k and v
    repeated to the query heads with the mask, never enable_gqa (ALiBi's float bias from the mask included), and
    the logits equal the same forward on this CPU, where SDPA takes enable_gqa (to bf16's rounding)."""
    import functools

    import torch.nn.functional as F

    import model as model_module
    import pope

    torch.manual_seed(0)
    cfg = GPTConfig(
        block_size=16, vocab_size=40, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, attn_backend="torch",
        pos_encoding=pos_encoding,
    )  # fmt: skip
    m = GPT(cfg).eval()
    idx = torch.randint(0, 40, (2, 16))
    ids = torch.tensor([[0] * 5 + [1] * 11, [0] * 9 + [1] * 2 + [2] * 5], dtype=torch.int32)
    monkeypatch.setattr(model_module, "document_mask", functools.partial(pope.document_mask, flex=False))
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        want = m(idx, document_ids=ids)[0]
        _mock_cuda(monkeypatch, (9, 0))
        calls, real = [], F.scaled_dot_product_attention

        def sdpa(q, k, v, *args, **kw):
            calls.append((k.shape[1], v.shape[1], kw.get("enable_gqa", False), kw.get("attn_mask") is not None))
            return real(q, k, v, *args, **kw)

        monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
        got = m(idx, document_ids=ids)[0]
    assert calls == [(4, 4, False, True)] * 2, calls
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2)
