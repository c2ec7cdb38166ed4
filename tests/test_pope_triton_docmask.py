"""Document masking (block_causal) in PoPE's Triton kernel: packed documents against each document run alone.

The reference for the mask is the document by itself: a packed row of documents, with document_ids and positions
restarting at 0 in each document, must give each document's output and the gradients of q, k, v and delta that
pope_attention_reference (float64, straight from the polar score formula) gives for that document alone at
positions 0.. (chunked prefill: its queries from q_offset on). Without CUDA the kernels run in the Triton
interpreter at its small tiles (pope_kernel.INTERPRET_BLOCKS: fwd and dq 32 queries x 16 keys, dK/dV 16 x 32),
so that documents of one, 15, 16, 17, 31, 32 and 33 tokens meet tile edges. The tile counts: the kernels' COUNT
output (the key or query blocks each program visits) against pope_kernel.visited_tiles' formula and against the
blocks of the dense block-causal mask that hold a visible pair.
"""

import inspect

import pytest
import torch
from compiled import fresh_inductor
from custom_ops import check_layout_contract

import pope
import pope_kernel as pk

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 2e-2}
BLOCKS = {
    role: (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for role, c in ((r, pk.KERNELS[r].configs[0]) for r in pk.KERNELS)
}
interpreter_only = pytest.mark.skipif(CUDA, reason="the tile counts assume the interpreter's tiles")


def _ids(lens):
    """Document lengths -> (T,) int32 ids 0, 0, ..., 1, ... (non-decreasing, 0 first)."""
    return torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lens)])


def _positions(ids):
    """Positions restarting at 0 at each document start: (T,) int64."""
    first = torch.searchsorted(ids, ids)
    return torch.arange(len(ids)) - first


def _leaves(B, H, H_kv, Tq, Tk, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(B, H, Tq, d, generator=g)  # peaked attention: the mask and positions matter
    k = 2 * torch.randn(B, H_kv, Tk, d, generator=g)
    v = torch.randn(B, H_kv, Tk, d, generator=g)
    delta = -2 * torch.pi * torch.rand(H_kv, d, generator=g)
    return [t.to(DEV, dtype if t is not delta else torch.float32).requires_grad_() for t in (q, k, v, delta)]


def _per_document_reference(leaves, rows, q_offset, causal, out_grad):
    """Each document of each batch row alone (float64, positions from 0): the packed output and the gradients of the
    (double) leaves under the same output gradient."""
    q, k, v, delta = [t.detach().double().cpu().requires_grad_() for t in leaves]
    Tq = q.shape[2]
    outs = []
    for b, lens in enumerate(rows):
        parts, start = [], 0
        for n in lens:
            end = start + n
            lo = max(start, q_offset)  # the document's first query position
            if end > lo:
                kw = dict(causal=causal, q_offset=lo - start)
                parts.append(
                    pope.pope_attention_reference(
                        q[b : b + 1, :, lo - q_offset : end - q_offset],
                        k[b : b + 1, :, start:end],
                        v[b : b + 1, :, start:end],
                        delta,
                        **kw,
                    )
                )
            start = end
        outs.append(torch.cat(parts, dim=2))
    out = torch.cat(outs, dim=0)
    assert out.shape[2] == Tq
    grads = torch.autograd.grad(out, (q, k, v, delta), out_grad.double().cpu())
    return out, grads


def _packed(rows, B, H, H_kv, q_offset, d, dtype, causal=True, seed=0):
    """(kernel output, its gradients, reference output, reference gradients) for the documents `rows` (one list of
    lengths per batch row, each summing to T)."""
    ids = torch.stack([_ids(lens) for lens in rows]).to(DEV)
    pos = torch.stack([_positions(_ids(lens)) for lens in rows]).to(DEV)
    Tk = ids.shape[1]
    leaves = _leaves(B, H, H_kv, Tk - q_offset, Tk, d, dtype, seed)
    out = pope.pope_attention_triton(
        *leaves, causal=causal, q_offset=q_offset, document_ids=ids.int(), position_ids=pos
    )
    out_grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(DEV, dtype)
    grads = torch.autograd.grad(out, leaves, out_grad)
    ref, ref_grads = _per_document_reference(leaves, rows, q_offset, causal, out_grad)
    return out, grads, ref, ref_grads


# (name, documents per batch row, H, H_kv, q_offset, dtype, causal)
CASES = [
    ("length_one_documents_gqa", [[1, 1, 1, 13, 1, 31, 1, 15]], 4, 2, 0, torch.float32, True),
    ("documents_one_tile_long", [[16, 32, 16]], 2, 2, 0, torch.float16, True),
    ("boundaries_at_tile_edges_and_pm1", [[15, 17, 31, 16, 1, 32]], 2, 1, 0, torch.float32, True),
    ("many_documents_in_one_tile", [[3, 2, 4, 1, 5, 2, 3, 6, 2, 4, 30]], 2, 2, 0, torch.float16, True),
    ("chunked_prefill_q_offset", [[20, 30, 14]], 4, 2, 24, torch.float32, True),
    ("two_rows_different_boundaries", [[10, 40, 14], [33, 31]], 4, 2, 0, torch.float16, True),
    ("not_causal_same_document_only", [[7, 33, 24]], 2, 2, 5, torch.float32, False),
    # q_offset 1: each 32-row query block's last row sits at position 32 or 64, the first key of a 16-key block (the
    # block's causal key range must end one past it, not at it); position 32 starts a document, 64 ends one
    ("last_rows_at_key_block_starts", [[20, 12, 33]], 2, 1, 1, torch.float32, True),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_packed_documents_equal_each_document_alone(case):
    """Output and dq, dk, dv, d(delta) of a packed row equal the per-document float64 reference (positions from 0
    in each document): documents of one token, exactly one tile, boundaries at tile edges and one off, many in one
    tile, a chunk of queries at q_offset > 0, two rows with different boundaries, GQA, fp32 and fp16."""
    name, rows, H, H_kv, q_offset, dtype, causal = case
    out, grads, ref, ref_grads = _packed(rows, len(rows), H, H_kv, q_offset, 16, dtype, causal)
    scale = max(1.0, ref.abs().max().item())
    assert (out.double().cpu() - ref).abs().max().item() <= TOL[dtype] * scale, name
    for which, got, want in zip(("dq", "dk", "dv", "ddelta"), grads, ref_grads):
        err = (got.double().cpu() - want).abs().max().item()
        assert err <= TOL[dtype] * max(1.0, want.abs().max().item()), (name, which, err)


def test_every_query_blocks_last_row_at_a_key_blocks_first_key_with_pinned_tiles():
    """The forward and dq kernels pinned to 16 x 16 tiles (pope_kernel.pin_configs, restored after): at q_offset 1
    the last row of every query block sits at position 16, 32, 48 or 64, the first key of a key block, which the
    block's causal key range must include (the row sees at least itself); documents [0, 20), [20, 32), [32, 65):
    position 32 starts a document, 16 and 48 lie inside one, 64 ends one. Output and gradients equal each document
    alone (float64), fp32."""
    before = pk.pin_configs("fwd=16,16,4,2;dq=16,16,4,2")
    try:
        out, grads, ref, ref_grads = _packed([[20, 12, 33]], 1, 2, 1, 1, 16, torch.float32, seed=13)
    finally:
        for role, configs in before.items():
            pk.KERNELS[role].configs = configs
    assert (out.double().cpu() - ref).abs().max().item() <= TOL[torch.float32] * max(1.0, ref.abs().max().item())
    for which, got, want in zip(("dq", "dk", "dv", "ddelta"), grads, ref_grads):
        err = (got.double().cpu() - want).abs().max().item()
        assert err <= TOL[torch.float32] * max(1.0, want.abs().max().item()), (which, err)


def test_one_document_is_causal_bit_for_bit(monkeypatch):
    """A row that is one document (ids all 0) gives exactly today's causal output and gradients: the document path
    visits the same tiles with the same arithmetic. With position_ids 0..T-1 as well, the output, dq, dk, dv stay
    bitwise equal; d(delta) only to rounding (the gathered rows (B, 1, T, 2d) reduce over batch in another order).
    The tiles are pinned (restored after): documents are part of the autotuner's key, so on a GPU each path may
    time its own winner, another summation order (seen on an H200)."""
    for role in pk.KERNELS:
        monkeypatch.setattr(pk.KERNELS[role], "configs", pk.KERNELS[role].configs)
    pk.pin_configs("fwd=32,32,4,2;dkdv=32,32,4,2;dq=32,32,4,2")
    B, H, T, d = 2, 1, 40, 16
    leaves = _leaves(B, H, H, T, T, d, torch.float32, seed=3)
    g = torch.randn(B, H, T, d, generator=torch.Generator().manual_seed(4)).to(DEV)
    ids = torch.zeros(B, T, dtype=torch.int32, device=DEV)
    pos = torch.arange(T, device=DEV).expand(B, T)
    results = []
    for kw in ({}, dict(document_ids=ids), dict(document_ids=ids, position_ids=pos)):
        out = pope.pope_attention_triton(*leaves, **kw)
        results.append([out, *torch.autograd.grad(out, leaves, g)])
    causal, docs, docs_pos = results
    assert all(torch.equal(a, b) for a, b in zip(causal, docs))
    assert all(torch.equal(a, b) for a, b in zip(causal[:4], docs_pos[:4]))
    torch.testing.assert_close(docs_pos[4], causal[4], rtol=1e-6, atol=1e-5)


def _dense_block_counts(ids, Tq, bm, bn, causal, q_offset, role):
    """The blocks of the dense block-causal mask that hold a visible (query, key) pair, counted per program."""
    Tk = len(ids)
    rows = torch.arange(Tq) + q_offset
    visible = ids[rows][:, None] == ids[None, :]
    if causal:
        visible &= torch.arange(Tk)[None, :] <= rows[:, None]
    if role == "dkdv":
        visible, bm, bn = visible.T, bn, bm
    n_i, n_j = -(-visible.shape[0] // bm), -(-visible.shape[1] // bn)
    pad = torch.zeros(n_i * bm, n_j * bn, dtype=torch.bool)
    pad[: visible.shape[0], : visible.shape[1]] = visible
    return pad.view(n_i, bm, n_j, bn).any(3).any(1).sum(1).tolist()


@interpreter_only
@pytest.mark.parametrize(
    "rows, q_offset, causal",
    [
        ([[15, 17, 31, 16, 1, 32]], 0, True),
        ([[1, 1, 1, 13, 1, 31, 1, 15], [64]], 0, True),
        ([[20, 30, 14]], 24, True),
        ([[20, 12, 33]], 1, True),
        ([[3, 2, 4, 1, 5, 2, 3, 6, 2, 4, 32], [33, 31]], 9, False),
    ],
)
def test_kernels_visit_exactly_the_tiles_the_documents_allow(rows, q_offset, causal):
    """Every program's COUNT (key blocks of a query block in fwd and dq, query blocks of a key block per query head in
    dK/dV) equals visited_tiles' formula and the number of blocks of the dense block-causal mask that hold a visible
    pair, which is the least any kernel that skips whole tiles can visit."""
    B, H, H_kv, d = len(rows), 2, 1, 16
    ids = torch.stack([_ids(lens) for lens in rows])
    Tk = ids.shape[1]
    Tq = Tk - q_offset
    q, k, v, _ = (t.detach() for t in _leaves(B, H, H_kv, Tq, Tk, 2 * d, torch.float32, seed=5))
    v = v[..., :d]
    docs = pk.document_bounds(ids.to(DEV))
    counts = {}
    for role, (bm, bn) in BLOCKS.items():
        n = -(-(Tq if role != "dkdv" else Tk) // (bm if role != "dkdv" else bn))
        counts[role] = torch.full((B * (H if role != "dkdv" else H_kv) * n,), -1, dtype=torch.int32, device=DEV)
    o, lse = pk.launch_forward(q, k, v, causal, q_offset, docs, counts)
    pk.launch_backward(torch.ones_like(o), q, k, v, o, lse, causal, q_offset, docs, counts)
    for role, (bm, bn) in BLOCKS.items():
        heads = H if role != "dkdv" else H_kv
        got = counts[role].view(B, heads, -1).cpu()
        for b in range(B):
            want = pk.visited_tiles(ids[b].tolist(), Tq, bm, bn, causal, q_offset, role)
            assert want == _dense_block_counts(ids[b], Tq, bm, bn, causal, q_offset, role), (role, b)
            assert all(got[b, h].tolist() == want for h in range(heads)), (role, b, got[b].tolist(), want)


def test_visited_tiles_hand_worked_case():
    """visited_tiles' docstring example: 12 keys, 4 x 4 tiles, documents [0, 5) and [5, 12): 1 + 2 + 2 = 5 key blocks
    (causal's triangle: 6); dK/dV 2 + 2 + 1; the same row as one document is the causal triangle 1 + 2 + 3."""
    ids = [0] * 5 + [1] * 7
    assert pk.visited_tiles(ids, 12, 4, 4) == [1, 2, 2]
    assert pk.visited_tiles(ids, 12, 4, 4, role="dkdv") == [2, 2, 1]
    assert pk.visited_tiles([0] * 12, 12, 4, 4) == [1, 2, 3]
    assert pk.visited_tiles(ids, 12, 4, 4, causal=False) == [2, 3, 2]  # rows 0-3 see keys 0-4, rows 4-7 keys 0-11


def test_compiled_forward_and_backward_match_eager(tmp_path):
    """torch.compile (Inductor, a fresh cache, fullgraph) of pope_attention_triton with document_ids and
    position_ids, forward and backward, equals eager."""
    rows = [[10, 23, 31], [33, 31]]
    ids = torch.stack([_ids(lens) for lens in rows]).to(DEV)
    pos = torch.stack([_positions(_ids(lens)) for lens in rows]).to(DEV)
    leaves = _leaves(2, 4, 2, 64, 64, 16, torch.float32, seed=6)

    def f(q, k, v, delta, ids, pos):
        return pope.pope_attention_triton(q, k, v, delta, document_ids=ids, position_ids=pos)

    g = torch.randn(2, 4, 64, 16, generator=torch.Generator().manual_seed(7)).to(DEV)
    want = f(*leaves, ids, pos)
    want_grads = torch.autograd.grad(want, leaves, g)
    with fresh_inductor(tmp_path):
        got = torch.compile(f, fullgraph=True)(*leaves, ids, pos)
        got_grads = torch.autograd.grad(got, leaves, g)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_ops_keep_the_layout_contract_with_documents():
    """opcheck and the layout contract (tests/custom_ops.py) of pope::attention_forward / attention_backward with a
    document table: q~, k~ and v views of one (B, T, .) projection as the model's, GQA (4 query heads, 2 key/value
    heads); the forward on the whole row with grad (opcheck runs its backward too), the backward op on a chunk of
    queries at q_offset 8 with dO a transposed view."""
    B, T, H, H_kv, d = 2, 20, 4, 2, 16  # not d = 8: value width 8 is no width the kernels take (no GPU compiles it)
    g = torch.Generator().manual_seed(8)
    proj = torch.randn(B, T, (H + H_kv) * 2 * d + H_kv * d, generator=g).to(DEV)
    q = proj[..., : H * 2 * d].view(B, T, H, 2 * d).transpose(1, 2)
    k = proj[..., H * 2 * d : (H + H_kv) * 2 * d].view(B, T, H_kv, 2 * d).transpose(1, 2)
    v = proj[..., (H + H_kv) * 2 * d :].view(B, T, H_kv, d).transpose(1, 2)
    docs = pk.document_bounds(torch.stack([_ids([5, 15]), _ids([1, 16, 3])]).to(DEV))
    chunk = q[:, :, 8:]
    o, lse = pk.attention_forward(chunk, k, v, True, 8, docs)
    do = torch.randn(o.shape, generator=g).to(DEV).transpose(1, 2).contiguous().transpose(1, 2)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    check_layout_contract(
        [
            ("whole row forward", pk.attention_forward, (*leaves, True, 0, docs)),
            ("chunk backward at q_offset 8", pk.attention_backward, (do, chunk, k, v, o, lse, True, 8, docs)),
        ]
    )


@pytest.mark.parametrize(
    "ids, pos, match",
    [
        (torch.zeros(2, 20, dtype=torch.int32), None, r"\(B, Tk\) = \(1, 24\)"),
        (torch.zeros(1, 24, dtype=torch.int64), None, "must be int32"),
        (torch.zeros(1, 24, dtype=torch.int32, device="meta"), None, "on q's device"),
        (None, torch.zeros(1, 24, dtype=torch.int32), "position_ids must be int64"),
        (None, torch.zeros(24, dtype=torch.int64), r"position_ids must be \(B, Tk\)"),
    ],
)
def test_bad_document_or_position_ids_raise_one_line(ids, pos, match):
    leaves = [t.detach() for t in _leaves(1, 2, 2, 24, 24, 16, torch.float32, seed=9)]
    with pytest.raises(ValueError, match=match) as e:
        pope.pope_attention_triton(*leaves, document_ids=ids, position_ids=pos)
    assert "\n" not in str(e.value)


@interpreter_only
def test_bench_doc_len_report_counts_the_training_tiles(capsys):
    """bench_kernel.py --doc_len on a CPU: seeded exponential lengths that sum to T, and at the training tiles
    (128 x 64 fwd, 32 x 128 dK/dV, 128 x 32 dq) each kernel's COUNT equals the formula, below causal's count."""
    import bench_kernel as bk

    lens = bk.document_lengths(512, 64, seed=3)
    assert sum(lens) == 512 and min(lens) >= 1 and lens == bk.document_lengths(512, 64, seed=3) and len(lens) > 3
    rows = bk.doc_tile_report(64, seq_lens=(512,), d=16)
    assert [r["kernel"] for r in rows] == ["fwd", "dkdv", "dq"]
    for r in rows:
        assert r["visited"] == r["allowed"] < r["causal"], r
    assert [r["tile"] for r in rows] == [pk.CONFIGS[role][64][0][:2] for role in ("fwd", "dkdv", "dq")]
    assert "| 512 |" in capsys.readouterr().out


def test_document_table_offsets_stay_int32():
    """The kernels index a batch row's (3, Tk) document table in int32: Tk >= 2^31 / 3 keys is refused in one line
    (meta tensors: no memory), one key fewer is accepted."""
    Tk = 2**31 // 3 + 1
    q = torch.empty(1, 1, 1, 16, device="meta")
    k = torch.empty(1, 1, Tk, 16, device="meta")
    ids = torch.empty(1, Tk, dtype=torch.int32, device="meta")
    assert "2^31 / 3" in pk.document_ids_reason(ids, q, k, 0)
    assert pk.document_ids_reason(ids[:, :-1], q, k[:, :, :-1], 0) is None


def test_kernel_entry_point_takes_document_ids():
    """pope_kernel.attention(..., document_ids=) on pre-scaled q~, k~ (GQA, q_offset 6) equals softmax(ln 2 q k^T)
    under the dense block-causal mask, forward and dq, dk, dv (float64 torch); wrong ids raise one line."""
    g = torch.Generator().manual_seed(10)
    ids = _ids([6, 1, 17, 16]).to(DEV)[None].repeat(2, 1)
    q = torch.randn(2, 4, 34, 32, generator=g).to(DEV).requires_grad_()
    k, v = (torch.randn(2, 2, 40, w, generator=g).to(DEV).requires_grad_() for w in (32, 16))
    o, lse = pk.attention(q, k, v, q_offset=6, document_ids=ids.int())
    rows = torch.arange(34, device=DEV) + 6
    visible = (ids[:, rows, None] == ids[:, None, :]) & (torch.arange(40, device=DEV) <= rows[:, None])
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = (q64 @ k64.repeat_interleave(2, 1).transpose(-1, -2)) * 0.6931471805599453
    s = s.masked_fill(~visible[:, None], float("-inf"))
    ref = torch.softmax(s, -1) @ v64.repeat_interleave(2, 1)
    torch.testing.assert_close(o.double(), ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, -1), rtol=0, atol=1e-5)
    do = torch.randn(o.shape, generator=g).to(DEV)
    for got, want in zip(torch.autograd.grad(o, (q, k, v), do), torch.autograd.grad(ref, (q64, k64, v64), do.double())):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="must be int32"):
        pk.attention(q, k, v, q_offset=6, document_ids=ids.long())


def _value(x):
    """An int from the interpreter's scalar or block (its first element), or a Python value."""
    data = getattr(getattr(x, "handle", x), "data", x)
    return int(data.ravel()[0]) if hasattr(data, "ravel") else int(data)


@interpreter_only
@pytest.mark.parametrize(
    "lens, q_offset, causal",
    [([5, 91], 0, True), ([3, 28, 1, 96], 16, True), ([7, 57, 32], 0, False), ([33, 63], 8, False)],
)
def test_the_unmasked_loops_visit_exactly_the_tiles_where_every_pair_is_visible(monkeypatch, lens, q_offset, causal):
    """Which loop visits a tile, not only how many tiles: each kernel's inner loops are spied (the interpreter looks
    them up in pope_kernel's globals at every call) and every (program, tile) is recorded with its MASKED flag. The
    unmasked loops must visit exactly the tiles of the dense block-causal mask in which every (query, key) pair is
    visible (a tile that straddles a document edge, the diagonal, or the end of the keys (fwd, dq) or rows (dK/dV)
    is masked), the masked loops the other tiles that hold a visible pair. Hand-worked, documents [0, 5), [5, 96),
    fwd 32 x 16: rows 32-63 run keys 16-31 unmasked, 0-15 and 32-63 masked; dK/dV 16 x 32: keys 32-63 run rows
    64-95 unmasked. A kernel that sends every tile through the masked loop gives the same numbers and tile counts,
    only slower."""
    ids = _ids(lens)
    Tk = len(ids)
    Tq = Tk - q_offset
    g = torch.Generator().manual_seed(11)
    q, k = (torch.randn(1, 1, n, 32, generator=g) for n in (Tq, Tk))
    v = torch.randn(1, 1, Tk, 16, generator=g)
    visits = []
    for name, own in (("_fwd_inner", "offs_m"), ("_dq_inner", "offs_m"), ("_dkdv_inner", "offs_n")):
        inner = getattr(pk, name)
        signature = inspect.signature(inner.fn)

        def spy(*args, _inner=inner, _sig=signature, _name=name, _own=own, **kwargs):
            a = _sig.bind(*args, **kwargs).arguments
            lo, hi = _value(a["lo"]), _value(a["hi"])
            step = _value(a["BLOCK_M"] if _name == "_dkdv_inner" else a["BLOCK_N"])
            visits.extend((_name, _value(a[_own]), t, bool(_value(a["MASKED"]))) for t in range(lo, hi, step))
            return _inner(*args, **kwargs)

        monkeypatch.setattr(pk, name, spy)
    docs = pk.document_bounds(ids[None])
    o, lse = pk.launch_forward(q, k, v, causal, q_offset, docs)
    pk.launch_backward(torch.ones_like(o), q, k, v, o, lse, causal, q_offset, docs)
    rows = torch.arange(Tq) + q_offset
    visible = ids[rows][:, None] == ids[None, :]
    if causal:
        visible &= torch.arange(Tk)[None, :] <= rows[:, None]
    for name, role in (("_fwd_inner", "fwd"), ("_dq_inner", "dq"), ("_dkdv_inner", "dkdv")):
        bm, bn = BLOCKS[role]
        want = {}
        if role == "dkdv":  # a key block's programs: its real keys against query blocks (rows past Tq: masked)
            for n0 in range(0, Tk, bn):
                for m0 in range(0, Tq, bm):
                    tile = visible[m0 : m0 + bm, n0 : n0 + bn]
                    if tile.any():
                        want[(n0, m0)] = not (tile.all() and m0 + bm <= Tq)
        else:  # a query block's programs: its real rows against key blocks (keys past Tk: masked)
            for m0 in range(0, Tq, bm):
                for n0 in range(0, Tk, bn):
                    tile = visible[m0 : m0 + bm, n0 : n0 + bn]
                    if tile.any():
                        want[(m0, n0)] = not (tile.all() and n0 + bn <= Tk)
        got = [(own, t, masked) for n, own, t, masked in visits if n == name]
        assert len(got) == len(set(got)), (role, "a tile visited twice")
        assert {(own, t): masked for own, t, masked in got} == want, role
        assert not all(want.values()), (role, "the case has no unmasked tile")
    if lens == [5, 91]:
        assert {(t, m) for n, own, t, m in visits if n == "_fwd_inner" and own == 32} == {
            (0, True),
            (16, False),
            (32, True),
            (48, True),
        }
        assert {t for n, own, t, m in visits if n == "_dkdv_inner" and own == 32 and not m} == {64, 80}


@interpreter_only
def test_a_document_launch_is_tuned_apart_from_a_causal_launch_of_the_same_shape(monkeypatch):
    """Documents enter the autotune key: the forward given two candidates and a timing that prefers 32-row tiles
    for causal launches and 16-row tiles for document launches (the autotuner's _bench replaced, no disk cache)
    tunes a causal launch, then a document launch of the same shapes and dtypes: the document launch is timed on
    its own and runs its own winner, not the causal launch's cached tile; a second causal launch reuses its entry.
    Every kernel's declared key names DOC (without it, Triton 3.7-3.9 still part the two by the document table's
    dtype, which the autotuner appends to every key: the declared key is what a later Triton keeps)."""
    assert all("DOC" in pk.KERNELS[role].keys and "CAUSAL" in pk.KERNELS[role].keys for role in pk.KERNELS)
    kernel = pk.KERNELS["fwd"]
    wide, narrow = pk.tile_config(32, 16, 4, 2), pk.tile_config(16, 16, 4, 2)
    monkeypatch.setattr(kernel, "configs", [wide, narrow])
    monkeypatch.setattr(kernel, "cache", {})
    monkeypatch.setattr(kernel, "cache_results", False)
    timed = []

    def bench(*args, config, **kwargs):
        doc = bool(kwargs.get("DOC", False))
        timed.append((doc, config.kwargs["BLOCK_M"]))
        return [1.0 if config.kwargs["BLOCK_M"] == (16 if doc else 32) else 2.0] * 3

    monkeypatch.setattr(kernel, "_bench", bench)
    g = torch.Generator().manual_seed(12)
    q, k = (torch.randn(1, 2, 48, 32, generator=g) for _ in range(2))
    v = torch.randn(1, 2, 48, 16, generator=g)
    ids = _ids([20, 28])[None]
    pk.launch_forward(q, k, v, True, 0)
    assert kernel.best_config == wide and timed == [(False, 32), (False, 16)]
    o, _ = pk.launch_forward(q, k, v, True, 0, pk.document_bounds(ids))
    assert kernel.best_config == narrow and timed[2:] == [(True, 32), (True, 16)]
    pk.launch_forward(q, k, v, True, 0)
    assert kernel.best_config == wide and len(timed) == 4 and len(kernel.cache) == 2
    visible = (ids[0][:, None] == ids[0][None, :]) & torch.ones(48, 48, dtype=torch.bool).tril()
    s = (q.double() @ k.double().transpose(-1, -2)) * 0.6931471805599453  # the narrow tile's output is right too
    ref = torch.softmax(s.masked_fill(~visible, float("-inf")), -1) @ v.double()
    torch.testing.assert_close(o.double(), ref, rtol=0, atol=1e-5)


def test_bench_kernel_alone_with_documents_is_the_attention_it_times():
    """bench_kernel._kernel_alone with per-token rotation rows and document ids (bench_documents' pope_kernel row):
    the kernels alone on its q~, k~ give pope_attention_triton's output with the same document_ids and position_ids,
    so the row times the attention the model computes."""
    import bench_kernel as bk

    lens = [[5, 20, 7], [1, 31]]
    ids = torch.stack([_ids(x) for x in lens]).to(DEV)
    pos = torch.stack([_positions(_ids(x)) for x in lens]).to(DEV)
    q, k, v, delta = (t.detach() for t in _leaves(2, 3, 3, 32, 32, 16, torch.float32, seed=21))
    rows = pope.pope_rotation_table(32, 16, device=DEV)[pos].unsqueeze(1)
    kernel = bk._kernel_alone(q, k, v, delta, rows, ids.int())
    want = pope.pope_attention_triton(q, k, v, delta, document_ids=ids, position_ids=pos)
    torch.testing.assert_close(kernel(), want, rtol=1e-5, atol=1e-5)
    assert [t.shape[-1] for t in kernel.extra_leaves] == [32, 32]
