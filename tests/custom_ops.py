"""The custom-op layout contract as a test helper (the contract: pope_kernel's module docstring).

Every torch.library op in the 'pope' namespace takes any input strides and returns every output
contiguous, and its fake kernel says so. Checked here on the layouts the model really passes:

    model_op_calls(model, idx, ...)  records the pope:: op calls (and their tensors, strides included) of
                                     one eager forward and backward of model.py's GPT, or of a KV-cache
                                     prefill and decoding step: the cases follow model.py if it changes
    token_major(t)                   a (B, H, T, d) view made dense in (B, T, H, d) memory order: how
                                     Inductor saves model.py's q, k, v views for the backward
    check_layout_contract(cases)     torch.library.opcheck with every default test_util (schema, fake
                                     tensor, autograd registration, AOT dispatch with dynamic shapes) on
                                     each (name, op, args), the real op's outputs contiguous, and the fake
                                     kernel's outputs of the same shapes, dtypes and strides (fake_meta)

A new custom op (e.g. a decoding kernel) adds its calls to tests/test_custom_ops.py, whose coverage test
fails for a pope:: op that no case calls.
"""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

from model import KVCache

NAMESPACE = "pope"


def registered_ops():
    """Names ('pope::attention_forward', ...) of every op registered in the pope namespace."""
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith(NAMESPACE + "::"))


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == NAMESPACE:
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def model_op_calls(model, idx, *, autocast=None, backward=True, decode=0):
    """[(OpOverload, args)] of the pope:: ops that model.py's GPT calls on idx (B, T) token ids.

    autocast: a dtype for torch.autocast on idx's device, or None. backward: also the backward of the
    loss (next-token targets idx rolled by one). decode > 0: instead a KV-cache prefill of idx[:, :-decode]
    and `decode` one-token steps (no grad), as GPT.generate runs them. The tensors are the model's own
    (views of its activations, with their strides), detached."""
    rec = _Recorder()
    with torch.autocast(idx.device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
        if decode:
            cache = KVCache(model.config.n_layer, idx.shape[1])
            with torch.no_grad(), rec:
                model.hidden_states(idx[:, :-decode], cache)
                for t in range(idx.shape[1] - decode, idx.shape[1]):
                    model.hidden_states(idx[:, t : t + 1], cache)
        else:
            with rec:
                _, loss = model(idx, idx.roll(-1, dims=1))
                if backward:
                    loss.backward()
    model.zero_grad(set_to_none=True)
    assert not any(kw for _, _, kw in rec.calls), "the pope ops take positional arguments only"
    return [(func, tree_map_only(torch.Tensor, lambda t: t.detach(), args)) for func, args, _ in rec.calls]


def token_major(t):
    """(B, H, T, d) -> the same values, dense in (B, T, H, d) memory order (strides (T H d, d, H d, 1))."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def with_grad(args):
    """args with every floating-point tensor a leaf that requires grad (strides kept), so opcheck also
    checks the op's autograd registration and runs its backward under AOT dispatch."""
    return tree_map_only(torch.Tensor, lambda t: t.detach().requires_grad_(t.is_floating_point()), args)


def meta(outputs):
    """[(shape, dtype, strides)] of the tensors in an op's outputs (any nesting)."""
    return [(tuple(t.shape), t.dtype, t.stride()) for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor)]


def fake_meta(op, args):
    """meta() of op's outputs from its fake kernel: op run under FakeTensorMode on fake copies of args (same shapes,
    dtypes, strides and devices), as Inductor sees it when it lays out the real outputs."""
    with FakeTensorMode() as mode:
        return meta(op(*tree_map_only(torch.Tensor, mode.from_tensor, args)))


def check_layout_contract(cases):
    """For each (name, op, args): torch.library.opcheck(op, args) with all its default test_utils, then the
    real op's tensor outputs must be contiguous, and the fake kernel's outputs must have the real ones' shapes,
    dtypes and strides. Raises AssertionError naming the case and the check."""
    for name, op, args in cases:
        try:
            torch.library.opcheck(op, args)
        except Exception as e:  # OpCheckError: name the case, keep opcheck's message
            raise AssertionError(f"{name}: {op}: {e}\n  inputs: {describe(args)}") from e
        real = op(*args)
        outputs, _ = tree_flatten(real)
        bad = [
            (i, tuple(t.shape), t.stride())
            for i, t in enumerate(outputs)
            if isinstance(t, torch.Tensor) and not t.is_contiguous()
        ]
        assert not bad, f"{name}: {op}: outputs (index, shape, strides) not contiguous: {bad}"
        fake = fake_meta(op, args)
        assert fake == meta(real), f"{name}: {op}: fake outputs {fake} != real {meta(real)}"


def describe(args):
    """The tensors of args as 'shape/strides/dtype', for messages."""
    return [
        f"{tuple(t.shape)}/{t.stride()}/{str(t.dtype).replace('torch.', '')}"
        for t in tree_flatten(args)[0]
        if isinstance(t, torch.Tensor)
    ]
