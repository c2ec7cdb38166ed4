"""The rotation tables (issue 61): how a table's length is checked at its boundary (exactly enough rows pass, one
fewer is refused), where a grown GPT.rotation lives (a real device move: a model on the `meta` device), that a dtype
cast of the model keeps the table float32, and that the static decoding step refuses a table decode() would."""

import math

import pytest
import torch

import pope
from model import GPT, GPTConfig, KVCache, rotation_table

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _qkv(Tq, Tk, d=16, H=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (2 * torch.randn(1, H, T, d, generator=g) for T in (Tq, Tk, Tk))
    delta = -2 * math.pi * torch.rand(H, d, generator=g)
    return q.to(DEV), k.to(DEV), v.to(DEV), delta.to(DEV)


def test_the_query_form_takes_a_table_of_exactly_q_offset_plus_tq_rows_and_refuses_one_fewer():
    """Queries at positions 5..7 read rows 5..7: a table of 8 rows is enough and gives the rows of a longer one
    (by hand: the 8-row table's rows are the first 8 of any longer one); 7 rows are one short."""
    q, _, _, delta = _qkv(3, 3)
    long = pope.pope_rotation_table(64, 16, device=DEV)
    want = pope.pope_query_decode_form(q, 5, delta, rotation=long)
    got = pope.pope_query_decode_form(q, 5, delta, rotation=pope.pope_rotation_table(8, 16, device=DEV))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match=r"rotation must be \(>= 8, 32\)"):
        pope.pope_query_decode_form(q, 5, delta, rotation=long[:7])
    with pytest.raises(ValueError, match="rotation must be"):
        pope.pope_query_decode_form(q, 5, delta, rotation=long[:, :30])


def test_the_triton_path_takes_a_table_of_exactly_max_q_offset_plus_tq_tk_rows():
    """backend='triton' reads rows 0..max(q_offset + Tq, Tk) - 1: a chunk of 4 queries at 6..9 over 12 keys needs 12
    rows (the keys'), 4 queries at 10..13 over 12 keys needs 14 (the queries'); exactly that many give the float64
    reference, one fewer is refused."""
    pytest.importorskip("pope_kernel")
    for q_offset, need in ((6, 12), (10, 14)):
        q, k, v, delta = _qkv(4, 12, seed=q_offset)
        table = pope.pope_rotation_table(need, 16, device=DEV)
        got = pope.pope_attention(q, k, v, delta, q_offset=q_offset, backend="triton", rotation=table)
        want = pope.pope_attention_reference(q, k, v, delta, q_offset=q_offset)
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
        with pytest.raises(ValueError, match=f">= {need}"):
            pope.pope_attention(q, k, v, delta, q_offset=q_offset, backend="triton", rotation=table[: need - 1])


@pytest.mark.parametrize("pos_encoding", ["pope", "rope"])
def test_a_grown_rotation_table_lives_on_the_models_device(pos_encoding):
    """A model moved to the `meta` device (a real device move, as to a GPU): the table a longer context grows
    (to the next power of two) is on that device, not the CPU it is built on (on a GPU, a CPU table past block_size
    is a device mismatch in the next forward). ensure_positions is what hidden_states calls for every forward (the
    forward itself cannot run on `meta`: autocast has no meta device)."""
    model = GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=1, n_head=2, n_embd=32, pos_encoding=pos_encoding))
    model = model.to("meta")
    assert model.rotation.device.type == "meta"
    model.ensure_positions(40)
    assert model.rotation.device.type == "meta" and model.rotation.shape[0] == 64
    model.ensure_positions(100)
    assert model.rotation.device.type == "meta" and model.rotation.shape[0] == 128


@pytest.mark.parametrize("cast", [lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double()])
def test_a_dtype_cast_of_the_model_keeps_its_rotation_table_float32(cast):
    """model.to(torch.bfloat16), .half(), .double() cast the weights, not GPT.rotation: the table stays float32 and
    equals a freshly built one bit for bit (a bf16 table would round cos/sin to 8 bits; the decode kernel takes
    float32 only), also after growing."""
    model = GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=1, n_head=2, n_embd=32, pos_encoding="pope"))
    model.ensure_positions(20)
    cast(model)
    assert model.lm_head.weight.dtype != torch.float32
    assert model.rotation.dtype == torch.float32 and torch.equal(model.rotation, rotation_table(model.config, 32))


def test_the_decoding_step_refuses_a_16_bit_or_short_table():
    """pope_decode_step (what GPT.decode_step compiles) checks its table as decode() does, on shapes and dtype:
    a bf16 table, one row short of the cache (L = 8) and a wrong width are refused in one line, both backends'
    entry; a float32 table of exactly L rows is taken."""
    B, H, d, L = 1, 2, 16, 8
    q, _, _, delta = _qkv(1, 1)
    mu, v = torch.rand(B, H, L, d, device=DEV), torch.randn(B, H, L, d, device=DEV)
    at, seen = torch.tensor([3], device=DEV), torch.arange(L, device=DEV) <= 3
    table = pope.pope_rotation_table(L, d, device=DEV)
    out = pope.pope_decode_step(q, mu, v, delta, table, at, seen)
    assert out.shape == (B, H, 1, d) and torch.isfinite(out).all()
    for bad in (table.bfloat16(), table[: L - 1], table[:, :-2]):
        with pytest.raises(ValueError, match="the decoding step needs a float32 rotation table"):
            pope.pope_decode_step(q, mu, v, delta, bad, at, seen)


def test_a_bf16_cast_model_decodes_with_its_float32_table():
    """A model cast to bf16 decodes through the static step (GPT.decode_step) with its table float32: the step's
    logits equal forward's through the KV cache (the same bf16 weights)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=1, n_head=2, n_embd=32, pos_encoding="pope")).eval()
    model = model.to(torch.bfloat16)
    idx = torch.randint(0, 32, (1, 5))
    with torch.no_grad():
        cache = KVCache(1, 8)
        model.hidden_states(idx[:, :4], cache)
        step = model.decode_step(idx[:, 4:], cache, torch.tensor(4)).float()
        full = model(idx)[0][:, -1].float()
    torch.testing.assert_close(step, full, atol=2e-2, rtol=2e-2)


@pytest.mark.slow
def test_a_table_grown_ahead_costs_the_compiled_training_step_no_recompile():
    """Dynamo's graph count (torch._dynamo counters; backend 'eager': the guards are Dynamo's, whatever the backend)
    over compiled training steps at block_size with an eager evaluation of the raw model at 40 tokens between them
    (past block_size 16): the growth (to 64 rows) recompiles the training step once; grown ahead to 40 positions
    before compiling, nothing recompiles. About 15 s on 2 busy cores (3 traces)."""
    from torch._dynamo.utils import counters

    def graphs(grow_ahead):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        cfg = GPTConfig(block_size=16, vocab_size=32, n_layer=1, n_head=2, n_embd=32, attn_backend="torch")
        model = GPT(cfg)
        if grow_ahead:
            model.ensure_positions(40)
        step = torch.compile(model, backend="eager")
        x = torch.randint(0, 32, (2, 16))
        step(x, x)[1].backward()
        with torch.no_grad():
            model(torch.randint(0, 32, (1, 40)))
        step(x, x)[1].backward()
        assert model.rotation.shape[0] == 64
        return counters["stats"]["unique_graphs"]

    try:
        assert graphs(grow_ahead=False) == 2 and graphs(grow_ahead=True) == 1
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("pos_encoding", ["pope", "rope"])
def test_positions_up_to_a_power_of_two_grow_the_table_to_hold_it(pos_encoding):
    """The table grows to the next power of two that holds the largest position: hand-worked, a model built with 16
    rows (block_size 16) given position_ids whose largest is 15 keeps 16 rows; 16 -> 32 rows, 31 -> 32, 32 -> 64
    (exactly a power of two needs the next one: positions 0..32 are 33 rows), 63 -> 64, 64 -> 128; a context of
    exactly 32 tokens (no position_ids) -> 32 rows, 33 -> 64. RoPE and PoPE are relative, so the logits of the
    positions shifted up to each largest equal those at positions 0..7 (the table's own rows, float32, to 1e-5)."""
    torch.manual_seed(0)
    cfg = dict(block_size=16, vocab_size=32, n_layer=1, n_head=2, n_embd=32, pos_encoding=pos_encoding, bias=False)
    if pos_encoding == "pope":
        cfg["pope_delta_init"] = "uniform"
    base = GPT(GPTConfig(**cfg)).eval()
    with torch.no_grad():  # peaked attention: a wrong row changes the logits
        base.transformer.h[0].attn.c_attn.weight.mul_(8.0)
    idx = torch.randint(0, 32, (2, 8))
    pos = torch.arange(8).expand(2, 8)
    with torch.no_grad():
        ref = base(idx, position_ids=pos)[0]
    for largest, rows in ((15, 16), (16, 32), (31, 32), (32, 64), (63, 64), (64, 128)):
        m = GPT(GPTConfig(**cfg)).eval()
        m.load_state_dict(base.state_dict())
        assert m.rotation.shape[0] == 16
        with torch.no_grad():
            got = m(idx, position_ids=pos + (largest - 7))[0]
        assert m.rotation.shape[0] == rows, (largest, m.rotation.shape[0])
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5, msg=f"largest position {largest}")
    for T, rows in ((32, 32), (33, 64)):
        m = GPT(GPTConfig(**cfg)).eval()
        with torch.no_grad():
            m(torch.randint(0, 32, (1, T)))
        assert m.rotation.shape[0] == rows, (T, m.rotation.shape[0])
