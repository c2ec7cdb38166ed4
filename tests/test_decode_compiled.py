"""Compiled decoding (issue 52): GPT.decode_step, one token over a static KV cache with the position as a tensor,
under torch.compile(fullgraph=True), as model.generate(compile=True) and sample.py --compile run it.

Its tokens are the eager decoder's (greedy, fp32, bit for bit) for every encoding; one compile serves every step
(no recompile, no graph break); a step runs no eager op outside the compiled graph and no host sync. Models get
weights that make attention peaked (position and, for PoPE, delta matter), so a wrong key or phase changes tokens."""

import pytest
import torch
from compiled import fresh_inductor
from torch._dynamo.utils import counters
from torch.profiler import ProfilerActivity, profile

from model import GPT, GPTConfig, KVCache

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ENCODINGS = {
    "rope": dict(pos_encoding="rope"),
    "pope": dict(pos_encoding="pope", pope_delta_init="uniform"),
    "pope_gqa_relu": dict(pos_encoding="pope", n_head=4, n_kv_head=2, pope_magnitude="relu", pope_delta_init="uniform"),
    "pope_no_delta": dict(pos_encoding="pope", pope_use_delta=False),
    "pope_triton_gqa": dict(
        pos_encoding="pope", n_head=4, n_kv_head=2, n_embd=64, pope_delta_init="uniform", attn_backend="triton"
    ),  # pope_kernel.decode_at (the interpreter on a CPU)
    "rope_gqa": dict(pos_encoding="rope", n_head=4, n_kv_head=2),
    "yarn": dict(pos_encoding="rope", rope_scaling=4.0, rope_original_block_size=16),
    "learned": dict(pos_encoding="learned"),
    "sinusoidal": dict(pos_encoding="sinusoidal"),
    "none": dict(pos_encoding="none"),
    "rope_half": dict(pos_encoding="rope_half"),
    "alibi_half": dict(pos_encoding="alibi_half", n_head=4),
}


def _model(kw, n_layer=2, seed=0):
    torch.manual_seed(seed)
    kw = {"n_layer": n_layer, "n_head": 2, "n_embd": 32, "block_size": 64, "vocab_size": 64, "dropout": 0.0, **kw}
    model = GPT(GPTConfig(**kw)).eval()
    with torch.no_grad():  # peaked attention and logits far from ties
        for block in model.transformer.h:
            block.attn.c_attn.weight.mul_(6.0)
        model.lm_head.weight.mul_(4.0)
    return model.to(DEV)


def _prompt(seed=1, T=7):
    return torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(seed)).to(DEV)


@torch.no_grad()
def _static_greedy(model, idx, n_new):
    """Greedy decoding through decode_step, not compiled: a prefill, then one step per token."""
    cache = KVCache(model.config.n_layer, idx.shape[1] + n_new)
    model.ensure_positions(cache.max_len)
    logits = model.lm_head(model.hidden_states(idx, cache)[:, -1]).float()
    pos = torch.tensor(idx.shape[1], device=idx.device)
    for i in range(n_new):
        nxt = logits.argmax(-1, keepdim=True)
        idx = torch.cat((idx, nxt), 1)
        if i + 1 < n_new:
            logits = model.decode_step(nxt, cache, pos)
            pos += 1
            cache.q_offset += 1
    return idx


@pytest.mark.parametrize("name", list(ENCODINGS))
def test_the_static_step_gives_the_full_forwards_logits_and_the_eager_decoders_tokens(name):
    """Teacher-forced over 12 random tokens after a 7-token prefill: every step's logits equal the full forward's
    at that position (fp32 rounding); greedy, the same tokens as generate's eager decoder, bit for bit."""
    model = _model(ENCODINGS[name])
    stream = _prompt(seed=3, T=19)
    with torch.no_grad():
        full, _ = model(stream)
        cache = KVCache(model.config.n_layer, 19)
        model.ensure_positions(19)
        model.hidden_states(stream[:, :7], cache)
        for t in range(7, 19):
            got = model.decode_step(stream[:, t : t + 1], cache, torch.tensor(t, device=DEV))
            cache.q_offset += 1
            torch.testing.assert_close(got, full[:, t].float(), atol=2e-5, rtol=1e-5, msg=f"{name} at position {t}")
    idx = _prompt()
    assert torch.equal(_static_greedy(model, idx, 12), model.generate(idx, 12, temperature=0))


@pytest.mark.parametrize("name", ["pope_triton_gqa"])
def test_compiled_generate_gives_the_eager_tokens_from_one_graph(name, tmp_path):
    """8 new tokens: the eager tokens; one graph, compiled once (no recompile after the first token), no graph
    break (fullgraph=True would raise). A second prompt whose length rounds to the same cache reuses it."""
    model = _model(ENCODINGS[name], n_layer=1)
    idx = _prompt()
    want = model.generate(idx, 8, temperature=0)
    with fresh_inductor(tmp_path):
        counters.clear()
        got = model.generate(idx, 8, temperature=0, compile=True)
        again = model.generate(_prompt(seed=2, T=5), 6, temperature=0, compile=True)  # 11 -> 16 rows, as 15 -> 16
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["stats"])
    assert torch.equal(got, want)
    assert torch.equal(again, model.generate(_prompt(seed=2, T=5), 6, temperature=0))


def test_a_compiled_step_runs_nothing_outside_its_graph_and_never_syncs(tmp_path):
    """Profiled after warm-up: every aten op of a step runs inside the compiled region (none eager around it: the
    only opaque op is PoPE's decode kernel, pope::decode_at) and none reads a value back to the host
    (aten::item / _local_scalar_dense)."""
    model = _model(ENCODINGS["pope_triton_gqa"], n_layer=1)
    idx = _prompt()
    with fresh_inductor(tmp_path), torch.no_grad():
        cache = KVCache(1, 32)
        model.ensure_positions(32)
        model.hidden_states(idx, cache)
        step, pos, nxt = model.compiled_decode_step(cache), torch.tensor(7, device=DEV), idx[:, :1]
        for _ in range(2):
            step(nxt, cache, pos)
            pos += 1
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(nxt, cache, pos)
    outside, syncs = [], []
    for e in prof.events():
        chain, p = [], e
        while p is not None:
            chain.append(p.name)
            p = p.cpu_parent
        if e.name.startswith("aten::") and not any(n.startswith("Torch-Compiled Region") for n in chain):
            outside.append(e.name)
        if e.name in ("aten::item", "aten::_local_scalar_dense"):
            syncs.append(e.name)
    assert not outside and not syncs, (outside, syncs)


def test_compiled_decoding_needs_a_prefilled_cache():
    with pytest.raises(ValueError, match="prefilled"):
        _model(ENCODINGS["rope"]).compiled_decode_step(KVCache(2, 8))


def test_building_the_compiled_step_grows_the_table_and_the_recompile_budget_of_the_step_only(monkeypatch):
    """A cache longer than GPT.rotation gets its rows before tracing; and every GPT's decode_step shares Dynamo's
    per-function recompile budget (8), which fullgraph=True turns into an error past the 8th batch size, cache size
    or model (bench.py's decode tables compile 12): the step runs with model.DECODE_RECOMPILE_LIMIT, while the
    process's limit (training's compiled forward obeys it) is the same before, during and after generate(compile=True).
    torch.compile is spied (the step runs eagerly) to read the limit the step's call sees."""
    import model as model_mod

    seen = []

    def spy_compile(fn, **kw):
        def step(*args):
            seen.append(torch._dynamo.config.recompile_limit)
            return fn(*args)

        return step

    monkeypatch.setattr(torch, "compile", spy_compile)
    model, idx = _model(ENCODINGS["rope"]), _prompt()
    cache = KVCache(2, 200)
    with torch.no_grad():
        model.hidden_states(idx, cache)
    # config.patch, not monkeypatch: torch 2.15's config module hides a setting that monkeypatch deletes on undo
    with torch._dynamo.config.patch(recompile_limit=2):
        assert model.rotation.shape[0] == 64
        model.compiled_decode_step(cache)
        assert model.rotation.shape[0] == 256
        assert torch._dynamo.config.recompile_limit == 2 and seen == []
        model.generate(idx, 4, temperature=0, compile=True)
        assert seen == [model_mod.DECODE_RECOMPILE_LIMIT] * 3  # 3 steps after the prefill's token, each raised
        assert torch._dynamo.config.recompile_limit == 2  # the process's limit untouched
    with torch._dynamo.config.patch(recompile_limit=100):  # a higher limit set by the user is kept for the step too
        seen.clear()
        model.generate(idx, 2, temperature=0, compile=True)
        assert seen == [100] and torch._dynamo.config.recompile_limit == 100


def test_rope_refuses_a_rotation_table_shorter_than_its_positions():
    model = _model(ENCODINGS["rope"])
    x = torch.randn(1, 5, 32, device=DEV)
    with pytest.raises(ValueError, match="ensure_positions"):
        model.transformer.h[0].attn(x, model.rotation[:3])


@pytest.mark.parametrize("name", ["rope", "pope", "alibi_half"])
def test_the_static_step_never_reads_a_cache_row_nobody_wrote(name):
    """The step attends over the whole preallocated cache, the rows past its position masked: their softmax weight
    is 0, but 0 times a garbage value is NaN, so a prefill must allocate zeros (KVCache.update), not empty memory.
    Run with PyTorch's deterministic mode, which fills uninitialised memory with NaN: the logits still equal the
    full forward's, over a cache twice as long as the tokens."""
    model = _model(ENCODINGS[name], n_layer=1)
    stream = _prompt(seed=5, T=12)
    was, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with torch.no_grad():
            full, _ = model(stream)
            cache = KVCache(1, 24)
            model.hidden_states(stream[:, :5], cache)
            for t in range(5, 12):
                got = model.decode_step(stream[:, t : t + 1], cache, torch.tensor(t, device=DEV))
                cache.q_offset += 1
                torch.testing.assert_close(got, full[:, t].float(), atol=2e-5, rtol=1e-5, msg=f"{name} at {t}")
    finally:
        torch.use_deterministic_algorithms(was)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def test_compiled_generate_rounds_its_cache_up_and_steps_at_each_tokens_position(monkeypatch, tmp_path):
    """generate(compile=True)'s own bookkeeping, through its real compiled step (Inductor), spied on. Its cache is
    the prompt plus the new tokens rounded up to a power of two, so lengths that round alike share one compiled
    step: 9 + 7 = 16 -> 16 (not 32), 10 + 7 = 17 -> 32, 5 + 3 = 8 -> 8. Each step runs at its token's position T, T
    + 1, ... and its logits are the full forward's at that position of the generated sequence (tokens alone can hide
    a wrong position: a 1-layer model's next token depends mostly on the current one); its tokens are the eager
    decoder's."""
    import model as model_mod

    sizes, calls = [], []

    class Recorded(KVCache):
        def __init__(self, n_layer, max_len):
            sizes.append(max_len)
            super().__init__(n_layer, max_len)

    model = _model(ENCODINGS["rope"], n_layer=1)
    compiled = model.compiled_decode_step

    def spied(cache):
        real = compiled(cache)

        def step(idx, cache, pos):
            logits = real(idx, cache, pos)
            calls.append((int(pos), logits.clone()))
            return logits

        return step

    monkeypatch.setattr(model_mod, "KVCache", Recorded)
    monkeypatch.setattr(model, "compiled_decode_step", spied)
    with fresh_inductor(tmp_path):
        for T, n_new, rows in ((9, 7, 16), (10, 7, 32), (5, 3, 8)):
            idx = _prompt(seed=T, T=T)
            sizes.clear()
            calls.clear()
            got = model.generate(idx, n_new, temperature=0, compile=True)
            assert sizes == [rows], (T, n_new, sizes)
            assert torch.equal(got, model.generate(idx, n_new, temperature=0)), (T, n_new)
            assert [p for p, _ in calls] == list(range(T, T + n_new - 1))
            with torch.no_grad():
                full = model(got)[0].float()
            for p, logits in calls:
                torch.testing.assert_close(logits, full[:, p], atol=2e-5, rtol=1e-5, msg=f"step at position {p}")


def test_the_static_step_takes_the_decode_kernel_up_to_its_row_limit():
    """decode_step_backend sends a group of G = H / H_kv query heads to the decode kernel while G fits its
    DECODE_MAX_ROWS query rows (64: multi-query attention with 64 heads), as pope_attention_decode does for
    G * Tq <= DECODE_MAX_ROWS, and to the torch path past it (G = 128)."""
    import pope_kernel
    from pope import decode_step_backend

    limit = pope_kernel.DECODE_MAX_ROWS
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter takes CPU tensors, a GPU CUDA ones
    mu, v = torch.ones(1, 1, 32, 16, device=dev), torch.ones(1, 1, 32, 16, device=dev)
    assert decode_step_backend(torch.ones(1, limit, 1, 16, device=dev), mu, v, "triton") == "triton"
    assert decode_step_backend(torch.ones(1, 2 * limit, 1, 16, device=dev), mu, v, "triton") == "torch"


def test_the_step_gets_cuda_graphs_and_static_cache_addresses_on_cuda_only(monkeypatch):
    """Which compile the decoding step gets, by the cache's device: torch.compile(fullgraph=True, dynamic=False)
    everywhere, mode='reduce-overhead' (CUDA graphs) and every cache buffer marked a static address on CUDA only,
    one compile per device type. CUDA is faked minimally: the cache's buffers are stand-ins that say is_cuda and
    device 'cuda'; torch.compile and mark_static_address are spied."""
    compiles, static = [], []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiles.append(kw) or fn)
    monkeypatch.setattr(torch._dynamo, "mark_static_address", static.append)

    class CudaBuffer:
        is_cuda, device = True, torch.device("cuda")

    model = _model(ENCODINGS["rope"]).cpu()  # the real cache below is a CPU one, on a GPU machine too
    cache = KVCache(2, 8)
    cache.k, cache.v = [CudaBuffer(), CudaBuffer()], [CudaBuffer(), CudaBuffer()]
    model.compiled_decode_step(cache)
    assert compiles == [dict(fullgraph=True, dynamic=False, mode="reduce-overhead")]
    assert len(static) == 4 and {id(b) for b in static} == {id(b) for b in (*cache.k, *cache.v)}
    model.compiled_decode_step(cache)  # kept: no second compile for the same device type (its buffers marked again)
    assert len(compiles) == 1 and len(static) == 8
    cpu = KVCache(2, 8)
    with torch.no_grad():
        model.hidden_states(_prompt().cpu(), cpu)
    model.compiled_decode_step(cpu)
    assert compiles[1:] == [dict(fullgraph=True, dynamic=False, mode=None)] and len(static) == 8
