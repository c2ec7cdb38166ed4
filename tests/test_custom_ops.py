"""Every pope:: custom op keeps the layout contract (pope_kernel's module docstring) on the layouts the model
passes: opcheck (schema, fake tensor, autograd registration, AOT dispatch with dynamic shapes) and
contiguous outputs, on the op calls recorded from model.py's GPT (tests/custom_ops.py).

The calls: pope.py's Cartesian q~, k~ with v a view of one c_attn projection (model.split_heads), multi-head
and grouped-query, fp32 and under fp16 autocast, with and without δ, every magnitude; the backward's dO, a
transposed view; the same v made dense in (B, T, H, d) order, as Inductor saves it for the backward; a chunk
of queries at q_offset > 0 over more keys; and the KV-cache's decoding calls (slices of the preallocated
cache, q_offset > 0, Tk > Tq)."""

import pytest
import torch
from compiled import DEV, pope_gpt
from custom_ops import (
    _Recorder,
    check_layout_contract,
    fake_meta,
    meta,
    model_op_calls,
    registered_ops,
    token_major,
    with_grad,
)

import pope
import pope_kernel as pk
from model import KVCache

B, T = 2, 12
# name: (GPTConfig fields, autocast dtype, forward checked with grad, q, k, v as Inductor saves them)
CONFIGS = {
    "mha_fp32_softplus": (dict(), None, True, False),
    "gqa_fp16_relu_no_delta": (
        dict(n_head=4, n_kv_head=2, pope_use_delta=False, pope_magnitude="relu"),
        torch.float16,
        False,
        True,
    ),
    "gqa_fp32_identity": (dict(n_head=4, n_kv_head=2, pope_magnitude="identity"), None, False, False),
}
FORWARD, BACKWARD = torch.ops.pope.attention_forward.default, torch.ops.pope.attention_backward.default
DECODE = torch.ops.pope.decode.default
DECODE_AT = torch.ops.pope.decode_at.default


def _idx(seed=0, T=T):
    return torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(seed)).to(DEV)


def _is_token_major(t):
    return t.stride() == token_major(t).stride()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_kernel_ops_keep_the_contract_on_the_training_layouts(name):
    """attention_forward and attention_backward as one eager training step of the model calls them: the Cartesian
    q~, k~ that pope.py forms, v a view of the projection (neither contiguous nor dense), dO a transposed view; in
    one config v instead dense in (B, T, H, d) order, the layout Inductor saves it in for the backward (where a
    fake that copied its strides made the compiled step fail)."""
    kw, amp, grad, inductor = CONFIGS[name]
    calls = model_op_calls(pope_gpt(**kw), _idx(), autocast=amp)
    assert [op for op, _ in calls] == [FORWARD, BACKWARD]
    (_, fwd), (_, bwd) = calls
    assert not fwd[2].is_contiguous() and not bwd[0].is_contiguous() and _is_token_major(bwd[0])
    if inductor:
        v = token_major(fwd[2])
        assert _is_token_major(v) and not v.is_contiguous()
        fwd, bwd = fwd[:2] + (v,) + fwd[3:], bwd[:3] + (v,) + bwd[4:]
    check_layout_contract(
        [(f"{name} forward", FORWARD, with_grad(fwd) if grad else fwd), (f"{name} backward", BACKWARD, bwd)]
    )


def test_ops_keep_the_contract_on_the_cached_and_offset_layouts():
    """KV-cache decoding as GPT.generate runs it: a prefill of 9 tokens through pope::attention_forward, then
    one-token steps through pope::decode at q_offset 9, 10, 11 (key magnitudes and values as slices of the
    cache's preallocated buffers, grouped heads); and pope::attention_forward for the last 4 queries of the
    training step's q~ (q_offset 8, a slice) over all 12 keys."""
    calls = model_op_calls(pope_gpt(n_head=4, n_kv_head=2), _idx(1), decode=3)
    assert [op for op, _ in calls] == [FORWARD] + [DECODE] * 3
    op, args = calls[2]  # the decoding step at q_offset 10
    q, mu, v, rot, causal, q_offset, n_split = args
    assert (q.shape[1:3], mu.shape[1:3], q_offset) == ((4, 1), (2, 11), 10)
    assert not mu.is_contiguous() and not v.is_contiguous()
    (_, fwd), _ = model_op_calls(pope_gpt(), _idx(2))
    qc, kc, v_all = fwd[:3]
    chunk = (qc[:, :, 8:], kc, v_all, True, 8)
    assert not chunk[0].is_contiguous()
    check_layout_contract([("decoding step", op, args), ("query chunk at q_offset 8", FORWARD, chunk)])


def test_the_static_decoding_op_keeps_the_contract_on_the_whole_cache():
    """pope::decode_at as GPT.decode_step calls it (generate(compile=True)): the query form, the whole
    preallocated cache (the model's own buffers, keys past the position unwritten), the rotation table and the
    position as a (1,) int64 tensor."""
    model, idx = pope_gpt(n_head=4, n_kv_head=2), _idx(1)
    rec = _Recorder()
    with torch.no_grad():
        cache = KVCache(1, 16)
        model.ensure_positions(16)
        model.hidden_states(idx[:, :9], cache)
        with rec:
            model.decode_step(idx[:, 9:10], cache, torch.tensor(9, device=DEV))
    ((op, args, _),) = rec.calls
    assert op is DECODE_AT and args[1].shape[2] == 16 and args[4].tolist() == [9]
    check_layout_contract([("static decoding step", op, args)])


def test_every_pope_op_is_checked():
    """A pope:: op that no case above calls (a new kernel) fails here: add its calls to this file."""
    checked = {"pope::attention_forward", "pope::attention_backward", "pope::decode", "pope::decode_at"}
    assert set(registered_ops()) == checked, set(registered_ops()) ^ checked
    assert pope.pope_kernel is pk


def test_under_autocast_with_delta_the_fakes_give_the_real_dtypes_and_delta_keeps_its_own():
    """One training step of a PoPE GPT with δ, fp32 weights, under fp16 autocast: pope::attention_forward and
    attention_backward receive fp16 operands, and their fake kernels give the real outputs' shapes, dtypes and
    strides (custom_ops.fake_meta); the gradients that leave the region keep their parameters' dtype (δ's
    float32) and equal the torch backend's under the same autocast."""
    calls = model_op_calls(pope_gpt(n_head=4, n_kv_head=2), _idx(3), autocast=torch.float16)
    assert [op for op, _ in calls] == [FORWARD, BACKWARD]
    assert {t.dtype for _, args in calls for t in args if isinstance(t, torch.Tensor)} == {
        torch.float16,
        torch.float32,
    }  # lse
    for op, args in calls:  # (opcheck runs on fp16 autocast's calls in the training-layout test above)
        assert fake_meta(op, args) == meta(op(*args)), op
    grads = {}
    for backend in ("triton", "torch"):
        model = pope_gpt(n_head=4, n_kv_head=2, attn_backend=backend)
        with torch.autocast(DEV, dtype=torch.float16):
            model(_idx(3), _idx(3).roll(-1, dims=1))[1].backward()
        grads[backend] = model.transformer.h[0].attn.pope_delta.grad
    assert grads["triton"].dtype == grads["torch"].dtype == torch.float32
    scale = grads["torch"].abs().max()
    assert scale > 0 and (grads["triton"] - grads["torch"]).abs().max() <= 0.01 * scale  # seen: 0.0012


@pytest.mark.parametrize("d, dv", [(16, 32), (32, 16)])
def test_the_decoding_ops_fakes_are_dv_wide_when_dv_is_not_d(d, dv):
    """pope::decode and pope::decode_at with values of width dv != d (key magnitudes d wide, queries 2d wide): the
    fake kernels' o is (B, H, Tq, dv), as the real op's, with the real dtypes and strides; opcheck passes on cache
    slices, grouped heads and two splits."""
    g = torch.Generator().manual_seed(0)
    B, H, H_kv, Tk, L = 1, 4, 2, 20, 24
    qd = torch.randn(B, H, 1, 2 * d, generator=g).to(DEV)
    mu_buf = torch.rand(B, H_kv, L, d, generator=g).to(DEV)
    v_buf = torch.randn(B, H_kv, L, dv, generator=g).to(DEV)
    rot = pope.pope_rotation_table(L, d, device=DEV)
    at = torch.tensor([Tk - 1], device=DEV)
    cases = [
        (f"decode d={d} dv={dv}", DECODE, (qd, mu_buf[:, :, :Tk], v_buf[:, :, :Tk], rot, True, Tk - 1, 2)),
        (f"decode_at d={d} dv={dv}", DECODE_AT, (qd, mu_buf, v_buf, rot, at, 2)),
    ]
    check_layout_contract(cases)
    for name, op, args in cases:
        o, lse = op(*args)
        assert o.shape == (B, H, 1, dv) and lse.shape == (B, H, 1), name
    torch.testing.assert_close(DECODE(*cases[0][2])[0], DECODE_AT(*cases[1][2])[0])
