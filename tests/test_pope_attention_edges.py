"""The attention API's edge cases, on both PoPE backends (torch, and Triton under the interpreter on CPU),
against the float64 reference: a single query at every offset, grouped heads that do not divide, delta's
gradient with other inputs frozen, a strided value tensor, and a q_offset sweep over a key-tile period."""

import math

import pytest
import torch

import pope

pk = pytest.importorskip("pope_kernel")
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
BACKENDS = ["torch", "triton"]


def _qkv(H, H_kv, Tq, Tk, d=16, dv=16, seed=0, gain=2.0):
    """Raw q, k, v (scaled: peaked attention, so one wrongly seen or dropped key shows) and delta."""
    g = torch.Generator().manual_seed(seed)
    q = gain * torch.randn(1, H, Tq, d, generator=g)
    k = gain * torch.randn(1, H_kv, Tk, d, generator=g)
    v = torch.randn(1, H_kv, Tk, dv, generator=g)
    delta = -2 * math.pi * torch.rand(H_kv, d, generator=g)
    return (t.to(DEV) for t in (q, k, v, delta))


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_query_at_every_offset_sees_only_keys_up_to_its_position(backend):
    """Tq = 1 at q_offset 0..Tk-1 (bottom-right alignment for any q_offset, not only Tk - 1): pope_attention
    and pope_attention_decode equal the float64 reference, which masks keys j > q_offset. The decode
    shortcut (one token sees every cached key) is right only at q_offset >= Tk - 1."""
    Tk, H, H_kv = 12, 4, 2
    q_all, k, v, delta = _qkv(H, H_kv, Tk, Tk, seed=1)
    mu = pope.pope_key_magnitude(k)
    for q_offset in range(Tk):
        q = q_all[:, :, q_offset : q_offset + 1]
        kw = dict(causal=True, rope_theta=500.0, q_offset=q_offset, backend=backend)
        want = pope.pope_attention_reference(q, k, v, delta, causal=True, rope_theta=500.0, q_offset=q_offset)
        got = pope.pope_attention(q, k, v, delta, **kw)
        cached = pope.pope_attention_decode(q, mu, v, delta, **kw)
        for name, out in (("pope_attention", got), ("pope_attention_decode", cached)):
            assert (out.double() - want).abs().max().item() < 1e-4, (name, q_offset)


def test_sdpa_attention_one_query_at_every_offset():
    """sdpa_attention (RoPE and NoPE's path too) with Tq = 1: query at q_offset sees keys 0..q_offset only."""
    g = torch.Generator().manual_seed(2)
    Tk = 9
    k, v = torch.randn(1, 2, Tk, 8, generator=g), torch.randn(1, 2, Tk, 8, generator=g)
    for q_offset in range(Tk):
        q = torch.randn(1, 2, 1, 8, generator=g)
        logits = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(8)
        logits[..., q_offset + 1 :] = float("-inf")
        want = torch.softmax(logits, -1) @ v.double()
        got = pope.sdpa_attention(q, k, v, causal=True, q_offset=q_offset)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5, msg=f"q_offset {q_offset}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_heads_that_do_not_divide_raise_a_clear_error(backend):
    """H = 6 query heads over H_kv = 4 key/value heads cannot be grouped: ValueError naming the rule."""
    q, k, v, delta = _qkv(6, 4, 5, 5)
    with pytest.raises(ValueError, match="H a multiple of H_kv"):
        pope.pope_attention(q, k, v, delta, backend=backend)
    with pytest.raises(ValueError, match="H a multiple of H_kv"):
        pope.pope_attention_decode(q, pope.pope_key_magnitude(k), v, delta, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("trained", [("delta",), ("q", "k", "delta"), ("v", "delta")])
def test_delta_gradient_with_other_inputs_frozen(backend, trained):
    """Tuning the phase biases alone (v frozen; q, k frozen too): d(delta) and the other trained inputs'
    gradients still equal the float64 reference's; the frozen ones get none."""
    q, k, v, delta = _qkv(2, 2, 9, 14, seed=3)
    leaves = dict(q=q, k=k, v=v, delta=delta)
    for name in trained:
        leaves[name] = leaves[name].clone().requires_grad_()
    out = pope.pope_attention(*leaves.values(), q_offset=5, backend=backend)
    ref_leaves = {n: t.detach().double().requires_grad_(n in trained) for n, t in leaves.items()}
    ref = pope.pope_attention_reference(*ref_leaves.values(), q_offset=5)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(DEV)
    got = torch.autograd.grad(out, [leaves[n] for n in trained], dout)
    want = torch.autograd.grad(ref, [ref_leaves[n] for n in trained], dout.double())
    for name, a, b in zip(trained, got, want):
        assert a is not None and b.abs().max() > 1e-3, name
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=1e-4, msg=name)


def test_triton_value_tensor_with_a_non_unit_last_stride():
    """v as a transposed view (last stride Tk, not 1): the Triton path copies it to the layout its kernel
    reads; output and gradients equal the reference."""
    q, k, _, delta = _qkv(2, 2, 11, 11, seed=5)
    v_t = torch.randn(1, 2, 16, 11, generator=torch.Generator().manual_seed(6)).to(DEV).requires_grad_()
    v = v_t.transpose(-1, -2)
    assert v.stride(-1) != 1
    out = pope.pope_attention(q, k, v, delta, backend="triton")
    ref_v = v_t.detach().double().requires_grad_()
    ref = pope.pope_attention_reference(q, k, ref_v.transpose(-1, -2), delta)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(DEV)
    (got,), (want,) = torch.autograd.grad(out, [v_t], dout), torch.autograd.grad(ref, [ref_v], dout.double())
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_triton_q_offset_sweep_over_a_key_tile_period():
    """Every q_offset in one period of the key tiles the interpreter runs (pope_kernel.INTERPRET_BLOCKS:
    keys in blocks of 16 in the forward and dQ kernels, 32 in dK/dV), with a query block's last row able to
    see the key just past a tile boundary: an off-by-one in a causal loop bound drops that key for some
    q_offset. Queries are a chunk at the end of the keys (Tk = q_offset + Tq), as when decoding."""
    blocks = pk.INTERPRET_BLOCKS
    period = math.lcm(blocks["fwd"][1], blocks["dq"][1], blocks["dkdv"][1])
    Tq = blocks["fwd"][0]  # one full query block
    q_full, k_full, v_full, delta = _qkv(1, 1, Tq, Tq + period, seed=8)
    delta = delta.requires_grad_()
    failures = []
    for q_offset in range(period):
        Tk = q_offset + Tq
        q, k, v = (t.clone().requires_grad_() for t in (q_full, k_full[:, :, :Tk], v_full[:, :, :Tk]))
        out = pope.pope_attention(q, k, v, delta, q_offset=q_offset, backend="triton")
        ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v, delta)]
        ref = pope.pope_attention_reference(*ref_leaves, q_offset=q_offset)
        dout = torch.ones_like(out)
        got = (out, *torch.autograd.grad(out, (q, k, v, delta), dout))
        want = (ref, *torch.autograd.grad(ref, ref_leaves, dout.double()))
        for name, a, b in zip(("out", "dq", "dk", "dv", "ddelta"), got, want):
            err = (a.double() - b).abs().max().item()
            if err > 1e-4 * max(1.0, b.abs().max().item()):
                failures.append((q_offset, name, err))
    assert not failures, failures


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_negative_position_or_one_past_the_table_is_refused_in_one_line(backend):
    """pope_attention with position_ids (issue 69): position -1 would read the table's last row (a silently wrong
    output, on both backends) and a position past the table's rows raised IndexError; both are one-line
    ValueErrors, with the table given (rotation=) and without it (a table of max(q_offset + Tq, Tk) rows).
    Positions inside the table still match the float64 reference."""
    T, H = 8, 2
    q, k, v, delta = _qkv(H, H, T, T, seed=5)
    pos = torch.arange(T, device=DEV).expand(1, T).contiguous()
    table = pope.pope_rotation_table(2 * T, q.shape[-1], device=DEV)
    for rotation, rows in ((None, T), (table, 2 * T)):
        kw = dict(backend=backend, rotation=rotation)
        got = pope.pope_attention(q, k, v, delta, position_ids=pos + (rows - T), **kw)
        want = pope.pope_attention_reference(q, k, v, delta)  # relative: shifting every position changes nothing
        torch.testing.assert_close(got.double().cpu(), want.double().cpu(), atol=2e-4, rtol=2e-4)
        for bad, words in ((pos - 1, "must be >= 0"), (pos + rows - T + 1, f"past the rotation table's {rows} rows")):
            with pytest.raises(ValueError, match=words) as e:
                pope.pope_attention(q, k, v, delta, position_ids=bad, **kw)
            assert "\n" not in str(e.value)
    if backend == "triton":  # the kernel's own entry point checks too
        with pytest.raises(ValueError, match="must be >= 0"):
            pope.pope_attention_triton(q, k, v, delta, position_ids=pos - 1)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_rotation_rows_cover_the_queries_past_the_keys_on_every_entry_point(backend):
    """Issue 76, pc-nrows-keys-only: the rotation table a call needs, builds and checks holds max(q_offset + Tq, Tk)
    rows, the queries' positions as well as the keys'. Queries at 7, 8, 9 over 8 keys (their rows 7..9 of an 8-row
    table would be one row, broadcast silently to all three): pope_attention, pope_attention_triton and
    pope_attention_decode equal the float64 reference with no table (one built here) and with a table of exactly 10
    rows, and refuse an 8-row table (enough for the keys alone) in one line. With position_ids the bound is the
    table's rows, not the keys': positions up to 3 Tk - 1 of a 3 Tk-row table run (shifted positions: the same
    output) through pope_attention and pope_attention_triton itself, and 3 Tk is refused by both."""
    Tq, Tk, q_offset, H = 3, 8, 7, 2
    q, k, v, delta = _qkv(H, H, Tq, Tk, seed=7)
    want = pope.pope_attention_reference(q, k, v, delta, q_offset=q_offset)
    mu_k = pope.pope_key_magnitude(k)
    table = pope.pope_rotation_table(q_offset + Tq, q.shape[-1], device=DEV)
    calls = {
        "pope_attention": lambda **kw: pope.pope_attention(q, k, v, delta, q_offset=q_offset, backend=backend, **kw),
        "pope_attention_decode": lambda **kw: pope.pope_attention_decode(
            q, mu_k, v, delta, q_offset=q_offset, backend=backend, **kw
        ),
    }
    if backend == "triton":
        calls["pope_attention_triton"] = lambda **kw: pope.pope_attention_triton(
            q, k, v, delta, q_offset=q_offset, **kw
        )
    for name, call in calls.items():
        for rotation in (None, table):
            got = call(rotation=rotation)
            torch.testing.assert_close(got.double().cpu(), want.cpu(), atol=2e-4, rtol=2e-4, msg=name)
        with pytest.raises(ValueError, match="rotation must be") as e:
            call(rotation=table[:Tk])
        assert "\n" not in str(e.value), name
    T = Tk
    q, k, v, delta = _qkv(H, H, T, T, seed=8)
    want = pope.pope_attention_reference(q, k, v, delta)
    big = pope.pope_rotation_table(3 * T, q.shape[-1], device=DEV)
    pos = torch.arange(T, device=DEV).expand(1, T).contiguous() + 2 * T  # the last rows: 2T..3T-1
    calls = {"pope_attention": lambda **kw: pope.pope_attention(q, k, v, delta, backend=backend, rotation=big, **kw)}
    if backend == "triton":
        calls["pope_attention_triton"] = lambda **kw: pope.pope_attention_triton(q, k, v, delta, rotation=big, **kw)
    for name, call in calls.items():
        got = call(position_ids=pos)
        torch.testing.assert_close(got.double().cpu(), want.cpu(), atol=2e-4, rtol=2e-4, msg=name)
        with pytest.raises(ValueError, match=f"past the rotation table's {3 * T} rows"):
            call(position_ids=pos + 1)


def test_the_position_check_leaves_a_compiled_graph_whole(tmp_path):
    """The check reads the positions (a host sync) in eager mode only: under torch.compile(fullgraph=True), which
    fails on any graph break, pope_attention with position_ids compiles (Inductor) and equals the eager call."""
    from compiled import fresh_inductor

    T, H = 8, 2
    q, k, v, delta = (t.cpu() for t in _qkv(H, H, T, T, seed=6))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]], dtype=torch.int32)

    def attend(q, k, v, delta, pos, ids):
        return pope.pope_attention(q, k, v, delta, backend="torch", position_ids=pos, document_ids=ids)

    with fresh_inductor(tmp_path):
        got = torch.compile(attend, fullgraph=True)(q, k, v, delta, pos, ids)
    torch.testing.assert_close(got, attend(q, k, v, delta, pos, ids), atol=1e-5, rtol=1e-5)
