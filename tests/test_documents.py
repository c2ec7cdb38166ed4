"""Packed documents with block-causal masking (issue 58): the reference for a packed row is each document
run by itself with positions from 0. Logits, loss and every gradient (δ included) must agree, for every
encoding, grouped-query attention, the boolean SDPA mask and FlexAttention's BlockMask (eager here, the
CUDA path's predicate), and under torch.compile; plus pope_attention with q_offset > 0 and the one-line errors."""

import functools

import pytest
import torch
import torch.nn.functional as F

import model as model_module
import pope
from model import GPT, GPTConfig

V, T = 40, 16
# three rows: documents of length 1 and boundaries at varied places; one document (= causal); many short ones
LENGTHS = ([1, 1, 5, 1, 8], [16], [2, 3, 2, 1, 3, 2, 3])
ENCODINGS = {
    "rope": {},
    "yarn": {"pos_encoding": "rope", "rope_scaling": 2.0, "rope_original_block_size": 8},
    "pope": {"pope_delta_init": "uniform"},
    "pope_nodelta": {"pope_use_delta": False},
    "pope_relu": {"pope_magnitude": "relu", "pope_delta_init": "uniform"},
    "pope_identity": {"pope_magnitude": "identity", "pope_delta_init": "uniform"},
    "rope_half": {},
    "alibi_half": {},
    "learned": {},
    "sinusoidal": {},
    "none": {},
}


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton tests' device: CPU runs the interpreter


def document_ids(lengths=LENGTHS):
    """(B, T) int32 ids and (B, T) int64 positions restarting at 0, built by hand from the lengths."""
    ids = [sum(([i] * n for i, n in enumerate(row)), []) for row in lengths]
    pos = [sum((list(range(n)) for n in row), []) for row in lengths]
    return torch.tensor(ids, dtype=torch.int32), torch.tensor(pos, dtype=torch.int64)


def gpt(name, n_kv_head=2, n_layer=2, n_embd=32):
    kw = dict(ENCODINGS[name])
    kw.setdefault("pos_encoding", name.split("_")[0] if name.startswith("pope") else name)
    torch.manual_seed(0)
    cfg = GPTConfig(
        block_size=T,
        vocab_size=V,
        n_layer=n_layer,
        n_head=4,
        n_kv_head=n_kv_head,
        n_embd=n_embd,
        attn_backend="torch",
        **kw,
    )
    m = GPT(cfg).double()
    with torch.no_grad():  # peaked attention: a mask that leaks across documents changes the result
        for block in m.transformer.h:
            block.attn.c_attn.weight.mul_(12.0)
        m.lm_head.weight.mul_(5.0)
    return m


def loss_grads(m, idx, y, **kw):
    """(logits, summed cross-entropy, {name: grad}) of one forward and backward."""
    logits, _ = m(idx, **kw)
    loss = F.cross_entropy(logits.view(-1, V), y.view(-1), reduction="sum")
    m.zero_grad(set_to_none=True)
    loss.backward()
    grads = {n.replace("_orig_mod.", ""): p.grad.clone() for n, p in m.named_parameters()}  # compiled: its names
    return logits.detach(), loss.detach(), grads


def reference(m, idx, y, lengths):
    """Each document alone (positions from 0): its logits in place, the summed loss and gradients."""
    logits, loss, grads = torch.empty(*idx.shape, V, dtype=m.lm_head.weight.dtype), 0.0, None
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            lg, ls, gr = loss_grads(m, idx[b : b + 1, start : start + n], y[b : b + 1, start : start + n])
            logits[b, start : start + n] = lg[0]
            loss = loss + ls
            grads = gr if grads is None else {k: grads[k] + gr[k] for k in gr}
            start += n
    return logits, loss, grads


def assert_packed_equals_documents(m, flex=False, lengths=LENGTHS):
    torch.manual_seed(1)
    idx, y = torch.randint(0, V, (len(lengths), T)), torch.randint(0, V, (len(lengths), T))
    ids, pos = document_ids(lengths)
    want = reference(m, idx, y, lengths)
    mp = pytest.MonkeyPatch()
    if flex:  # the CUDA path's BlockMask and flex_attention, run eagerly on the CPU
        mp.setattr(model_module, "document_mask", functools.partial(pope.document_mask, flex=True))
    try:
        if flex:  # FlexAttention has no backward on the CPU (torch 2.13): the logits only
            with torch.no_grad():
                torch.testing.assert_close(m(idx, document_ids=ids, position_ids=pos)[0], want[0], atol=1e-9, rtol=1e-9)
            return
        got = loss_grads(m, idx, y, document_ids=ids, position_ids=pos)
    finally:
        mp.undo()
    torch.testing.assert_close(got[0], want[0], atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(got[1], want[1], atol=1e-9, rtol=1e-9)
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], atol=1e-9, rtol=1e-7, msg=name)
    causal = m(idx)[0]  # the mask matters: without it the packed rows differ (not the one-document row)
    assert (causal[0] - want[0][0]).abs().max() > 1e-3 and (causal[2] - want[0][2]).abs().max() > 1e-3
    torch.testing.assert_close(causal[1], want[0][1], atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("name", list(ENCODINGS))
def test_packed_documents_equal_each_document_alone(name):
    """SDPA's boolean block-causal mask, GQA (4 query heads over 2 key/value heads), positions reset."""
    assert_packed_equals_documents(gpt(name))


@pytest.mark.parametrize("name", ["pope", "alibi_half"])
def test_packed_documents_through_flex_block_mask(name):
    """The CUDA path: a FlexAttention BlockMask (mask_mod on the ids) and flex_attention (ALiBi: score_mod),
    forward only (no flex backward on the CPU)."""
    assert_packed_equals_documents(gpt(name), flex=True)


def test_packed_documents_without_gqa():
    assert_packed_equals_documents(gpt("pope", n_kv_head=None))


def test_positions_not_reset_change_only_absolute_encodings():
    """RoPE/PoPE are relative: positions 0..T-1 give the reset run's logits (to rounding); learned does not."""
    torch.manual_seed(2)
    idx, (ids, pos) = torch.randint(0, V, (3, T)), document_ids()
    for name in ("pope", "rope"):
        m = gpt(name)
        torch.testing.assert_close(m(idx, document_ids=ids)[0], m(idx, document_ids=ids, position_ids=pos)[0])
    m = gpt("learned")
    assert (m(idx, document_ids=ids)[0] - m(idx, document_ids=ids, position_ids=pos)[0]).abs().max() > 1e-3


def test_positions_past_the_table_grow_it_and_give_the_shifted_run():
    """position_ids beyond the rotation table's rows (here up to 1000 + T, the table holds T) grow it, as a longer
    context does: RoPE/PoPE are relative, so every position shifted by 1000 gives the unshifted logits. A negative
    position is refused in one line."""
    torch.manual_seed(3)
    idx, (ids, pos) = torch.randint(0, V, (3, T)), document_ids()
    for name in ("pope", "rope"):
        m = gpt(name)
        assert m.rotation.shape[0] < 1000
        ref = m(idx, document_ids=ids, position_ids=pos)[0]
        torch.testing.assert_close(m(idx, document_ids=ids, position_ids=pos + 1000)[0], ref, atol=1e-5, rtol=1e-5)
        assert m.rotation.shape[0] >= 1000 + T
        with pytest.raises(ValueError, match=">= 0") as e:
            m(idx, document_ids=ids, position_ids=pos - 1)
        assert "\n" not in str(e.value)


def test_pope_attention_q_offset_over_packed_documents():
    """A chunked prefill: queries q_offset.. of a packed row equal the rows of the full call, for both masks,
    grouped heads, positions reset; the float64 reference formula per document agrees."""
    torch.manual_seed(3)
    B, H, H_kv, d = 3, 4, 2, 8
    q, k, v = torch.randn(B, H, T, d, dtype=torch.float64) * 3, *(torch.randn(2, B, H_kv, T, d, dtype=torch.float64))
    delta = -6 * torch.rand(H_kv, d, dtype=torch.float64)
    ids, pos = document_ids()
    full = pope.pope_attention(q, k, v, delta, backend="torch", document_ids=ids, position_ids=pos)
    for flex in (False, True):
        for off in (5, 11):
            mask = pope.document_mask(ids, T - off, off, flex=flex)
            part = pope.pope_attention(
                q[:, :, off:], k, v, delta, backend="torch", q_offset=off, document_ids=ids, position_ids=pos, mask=mask
            )
            torch.testing.assert_close(part, full[:, :, off:], atol=1e-10, rtol=1e-10)
    for b, row in enumerate(LENGTHS):
        start = 0
        for n in row:
            s = slice(start, start + n)
            want = pope.pope_attention_reference(q[b : b + 1, :, s], k[b : b + 1, :, s], v[b : b + 1, :, s], delta)
            torch.testing.assert_close(full[b : b + 1, :, s], want, atol=1e-6, rtol=1e-6)  # float32 table
            start += n


triton_documents = pytest.mark.skipif(pope.pope_kernel is None, reason="no Triton")


@triton_documents
def test_triton_backend_packed_documents_match_torch():
    torch.manual_seed(4)
    B, H, H_kv, d = 3, 2, 1, 16
    q, k, v = torch.randn(B, H, T, d) * 2, *(torch.randn(2, B, H_kv, T, d))
    delta = -6 * torch.rand(H_kv, d)
    ids, pos = document_ids()
    q, k, v, delta, ids, pos = (t.to(DEVICE) for t in (q, k, v, delta, ids, pos))
    got = pope.pope_attention(q, k, v, delta, backend="triton", document_ids=ids, position_ids=pos)
    want = pope.pope_attention(q, k, v, delta, backend="torch", document_ids=ids, position_ids=pos)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@triton_documents
def test_gpt_on_the_triton_backend_packed_documents_match_the_torch_path():
    """The model hands the kernel the ids and positions (no mask built for it): logits and δ's gradient as the
    torch path's, which equal each document alone (above); fp32, the interpreter on CPU."""
    m = gpt("pope", n_layer=1, n_embd=64).float().to(DEVICE)  # head dim 16: the kernel's smallest
    torch.manual_seed(6)
    idx, (ids, pos) = torch.randint(0, V, (3, T)), document_ids()
    idx, ids, pos = idx.to(DEVICE), ids.to(DEVICE), pos.to(DEVICE)
    out = {}
    for backend in ("torch", "triton"):
        m.config.attn_backend = backend  # one GPTConfig, shared by every layer
        logits, _ = m(idx, document_ids=ids, position_ids=pos)
        (delta,) = torch.autograd.grad(logits.square().sum(), [m.transformer.h[0].attn.pope_delta])
        out[backend] = logits.detach(), delta
    torch.testing.assert_close(out["triton"][0], out["torch"][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out["triton"][1], out["torch"][1], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda ids: ids.flip(1), "non-decreasing"),
        (lambda ids: ids[:, :-1], "must be a"),
        (lambda ids: ids.long(), "must be a"),
        (lambda ids: ids.to("meta"), "device"),
    ],
)
def test_bad_document_ids_get_one_line_errors(make, match):
    q = torch.randn(3, 2, T, 8)
    ids, _ = document_ids()
    with pytest.raises(ValueError, match=match) as e:
        pope.pope_attention(q, q, q, backend="torch", document_ids=make(ids))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=match):
        gpt("rope")(torch.zeros(3, T, dtype=torch.long), document_ids=make(ids))


@pytest.mark.parametrize(
    "make",
    [
        lambda pos: pos[0],  # rank 1: one row of positions for every batch row
        lambda pos: pos[:, :, None],  # rank 3
        lambda pos: pos[:1],  # (1, T) for B = 3: would broadcast the first row's positions to every row
        lambda pos: pos[:, :-1],  # one key short
        lambda pos: torch.cat([pos, pos[:, :1]], 1),  # one key too many
        lambda pos: pos.int(),  # int32
        lambda pos: pos.double(),  # float
        lambda pos: pos.tolist(),  # not a tensor
    ],
    ids=["rank1", "rank3", "one_row_for_three", "short", "long", "int32", "float64", "list"],
)
def test_bad_position_ids_get_one_line_errors_on_the_torch_path(make):
    """pope_attention's torch backend (and GPT.forward over it) refuses position_ids that are not a (B, Tk) int64
    tensor, in one line that names the shape and dtype it needs, before any row of the table is read; a (1, T) table
    for B = 3 would otherwise broadcast one row's positions to every row, and an int32 one would index the table
    silently. The same call with the real (B, T) int64 positions runs."""
    q = torch.randn(3, 2, T, 8)
    ids, pos = document_ids()
    for kw in ({"document_ids": ids}, {}):
        with pytest.raises(ValueError, match=r"position_ids must be a \(B, Tk\) = \(3, 16\) torch.int64") as e:
            pope.pope_attention(q, q, q, backend="torch", position_ids=make(pos), **kw)
        assert "\n" not in str(e.value)
        assert pope.pope_attention(q, q, q, backend="torch", position_ids=pos, **kw).shape == q.shape
    m = gpt("pope")
    with pytest.raises(ValueError, match=r"position_ids must be a \(B, Tk\)"):
        m(torch.zeros(3, T, dtype=torch.long), document_ids=ids, position_ids=make(pos))


def test_the_mask_is_left_out_where_popes_attention_resolves_to_the_kernel_not_where_it_is_set(monkeypatch):
    """GPT builds the per-step document mask (on CUDA a FlexAttention BlockMask) unless PoPE's attention resolves to
    the Triton kernel, which masks from the ids itself. What decides is the backend 'auto' resolves to for the
    run's tensors (pope_backend), not the setting: on a GPU (mocked: CUDA tensors, sm_90, tiles that fit) 'auto' in
    bf16 resolves to the kernel (no mask), 'auto' in fp32 and 'torch' to the torch path (a mask); on this CPU 'auto'
    resolves to the torch path whatever the dtype (a mask). Each case's decision is pope_backend's on the layer's
    q, k, v; the mask is counted, not built."""
    import model as model_module
    import pope_kernel

    m = gpt("pope", n_layer=1, n_embd=64)  # head dim 16: the kernel's smallest
    masks = []
    monkeypatch.setattr(model_module, "document_mask", lambda ids: masks.append(1) or "mask")
    idx, (ids, pos) = torch.zeros(3, T, dtype=torch.long), document_ids()

    def built(backend, autocast):
        m.config.attn_backend = backend
        n = len(masks)
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            mask = m._documents(idx, None, ids, pos).mask
            probe = torch.zeros(1, 4, T, 16)
            resolved = pope.pope_backend(probe, probe, probe, backend)
        assert (mask == "mask") == (len(masks) == n + 1) == (resolved == "torch"), (backend, autocast, resolved)
        return mask is not None

    assert built("auto", True) and built("auto", False) and built("torch", True)  # this CPU: the torch path
    assert not built("triton", False)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setattr(pope_kernel, "device_unsupported_reason", lambda *a: None)
    assert not built("auto", True)  # a GPU in bf16: the kernel, no mask
    assert built("auto", False) and built("torch", True) and not built("triton", True)


def test_pope_attention_over_packed_documents_under_torch_compile(tmp_path):
    """The real Inductor (a fresh cache) on the torch path's attention with document ids, positions reset and
    GQA: outputs and the gradients of q, k, v and δ equal eager's, which equals each document alone (above)."""
    from compiled import fresh_inductor

    torch.manual_seed(5)
    B, H, H_kv, d = 3, 4, 2, 8
    q = (torch.randn(B, H, T, d) * 3).requires_grad_()
    k, v = (torch.randn(B, H_kv, T, d).requires_grad_() for _ in range(2))
    delta = (-6 * torch.rand(H_kv, d)).requires_grad_()
    ids, pos = document_ids()

    def run(fn):
        out = fn(q, k, v, delta, backend="torch", document_ids=ids, position_ids=pos)
        grads = torch.autograd.grad((out * torch.arange(d)).sum(), (q, k, v, delta))
        return out.detach(), grads

    want = run(pope.pope_attention)
    with fresh_inductor(tmp_path):
        got = run(torch.compile(pope.pope_attention, dynamic=False))
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-5)


@pytest.mark.slow
def test_packed_documents_under_torch_compile(tmp_path):
    """The real Inductor (a fresh cache): packed PoPE rows (GQA, δ, positions reset) give each document's own
    logits, loss and gradients, through the compiled forward and backward."""
    from compiled import fresh_inductor

    m = gpt("pope", n_layer=1).float()
    torch.manual_seed(1)
    idx, y = torch.randint(0, V, (3, T)), torch.randint(0, V, (3, T))
    ids, pos = document_ids()
    want = reference(m, idx, y, LENGTHS)
    with fresh_inductor(tmp_path):
        got = loss_grads(torch.compile(m, dynamic=False), idx, y, document_ids=ids, position_ids=pos)
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=2e-5)
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], atol=1e-4, rtol=1e-4)
    assert (m(idx)[0][0] - want[0][0]).abs().max() > 1e-3  # eager causal: the mask matters here


def test_the_order_of_the_ids_is_read_once_per_forward_and_no_mask_is_built_for_the_kernel(monkeypatch):
    """GPT.forward checks that document_ids never decrease once (a host sync on a GPU), not once per layer; and
    where PoPE's attention resolves to the Triton kernel ('triton' here; 'auto' on a GPU in bf16), which
    masks from the ids, it builds no mask (on CUDA a BlockMask per step that nothing would read)."""
    import model as model_module

    orders, masks = [], []
    real_check, real_mask = pope.check_document_ids, model_module.document_mask
    monkeypatch.setattr(pope, "check_document_ids", lambda *a, **kw: orders.append(a[-1]) or real_check(*a, **kw))
    monkeypatch.setattr(model_module, "check_document_ids", lambda *a: orders.append(True) or real_check(*a))
    monkeypatch.setattr(model_module, "document_mask", lambda ids: masks.append(1) or real_mask(ids))
    m = gpt("pope", n_layer=3)
    ids, pos = document_ids()
    m(torch.zeros(3, T, dtype=torch.long), document_ids=ids, position_ids=pos)
    assert orders == [True, False, False, False] and masks == [1]  # one check with the order, 3 layers without
    m.config.attn_backend = "triton"  # resolves to the kernel as 'auto' does on a GPU in bf16 (CPU: the interpreter)
    assert m._documents(torch.zeros(3, T, dtype=torch.long), None, ids, pos).mask is None
    assert masks == [1]


@pytest.mark.parametrize("name", ["rope", "pope", "alibi_half", "learned"])
def test_position_ids_alone_take_the_causal_path_and_give_the_masked_result(name, monkeypatch):
    """position_ids without document_ids are one document per row: causal attention. GPT builds no document
    mask (the masked SDPA path, and on CUDA a BlockMask per step, for a causal result) and gives the logits of
    the masked path with every id 0 (the reference: that path, run with one document per row)."""
    torch.manual_seed(4)
    m = gpt(name)
    idx, pos = torch.randint(0, V, (2, T)), torch.arange(T).repeat(2, 1) + torch.tensor([[0], [3]])
    pos = pos.clamp(max=T - 1) if name == "learned" else pos
    want = m(idx, document_ids=torch.zeros(2, T, dtype=torch.int32), position_ids=pos)[0]
    masks, real = [], model_module.document_mask
    monkeypatch.setattr(model_module, "document_mask", lambda ids: masks.append(1) or real(ids))
    got = m(idx, position_ids=pos)[0]
    assert masks == []
    torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)


def test_alibi_builds_its_document_bias_once_per_forward_for_every_layer(monkeypatch):
    """ALiBi under the CPU's boolean document mask: the (B, n_head, T, T) float bias is built once per forward
    and shared by the 3 layers (it was built in every layer); the logits are still each document's alone."""
    calls, real = [], model_module.alibi_bias
    monkeypatch.setattr(model_module, "alibi_bias", lambda *a, **kw: calls.append(a[1:3]) or real(*a, **kw))
    m = gpt("alibi_half", n_layer=3)
    ids, pos = document_ids()
    m(torch.zeros(3, T, dtype=torch.long), document_ids=ids, position_ids=pos)
    assert calls == [(T, T)]
    assert_packed_equals_documents(gpt("alibi_half", n_layer=3))


@pytest.mark.parametrize("name", ["rope", "rope_half"])
def test_rope_gathers_its_rotation_rows_once_per_forward_for_every_layer(name, monkeypatch):
    """RoPE at position_ids: the rows rotation[positions] (B, 1, T, n_rot) are gathered once per forward and every
    layer rotates with that one tensor, so autograd saves one copy, not n_layer (it was gathered in every layer);
    the logits and gradients are each document's alone."""
    seen, real = [], model_module.rope_rotate
    monkeypatch.setattr(model_module, "rope_rotate", lambda x, rows: seen.append(rows.data_ptr()) or real(x, rows))
    m = gpt(name, n_layer=3)
    ids, pos = document_ids()
    m(torch.zeros(3, T, dtype=torch.long), document_ids=ids, position_ids=pos)[0].sum().backward()
    assert len(seen) == 6 and len(set(seen)) == 1  # q and k of 3 layers, one tensor
    assert_packed_equals_documents(gpt(name, n_layer=3))


@pytest.mark.parametrize("name", ["learned", "sinusoidal", "rope", "pope"])
def test_a_negative_position_is_a_one_line_value_error_for_every_encoding(name):
    """position_ids -1: the one-line ValueError of GPT.forward for every encoding (learned raised a bare
    IndexError from its embedding, before the check ran)."""
    ids, pos = document_ids()
    with pytest.raises(ValueError, match="position_ids must be >= 0") as e:
        gpt(name)(torch.zeros(3, T, dtype=torch.long), document_ids=ids, position_ids=pos - 1)
    assert "\n" not in str(e.value)
