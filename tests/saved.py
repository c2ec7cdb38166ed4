"""What a forward keeps for its backward, measured by storage lifetime (a test helper).

    kept_for_backward(forward, keep)   runs forward() and returns (its output, the shapes of the tensors it created
                                       that match keep and whose storage is still alive once it has returned)

torch.autograd.graph.saved_tensors_hooks sees what autograd saves outside a checkpoint, but not what a selective
activation checkpoint caches: SAC keeps its MUST_SAVE outputs in its own store, past every hook (torch 2.15 warns
that a later release will route them through the hooks). A test that counted q~, k~ with hooks passed with a policy
that saved everything. Here every tensor an op creates in the forward is tracked by a weak reference to its storage
(PyTorch keeps one Python object per storage, so the reference lives exactly as long as the memory); with the output,
and so its autograd graph, alive and garbage collected, what is still alive is what the backward holds, whoever
holds it (autograd, a checkpoint's cache, a custom Function's ctx).
"""

import gc
import weakref

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class _Created(TorchDispatchMode):
    """Weak references to the storages of the tensors the ops under it return, the ones keep(t) selects."""

    def __init__(self, keep):
        super().__init__()
        self.keep, self.refs = keep, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and self.keep(t):
                ref = weakref.ref(t.untyped_storage())  # one ref object per storage: views count once
                self.refs[id(ref)] = ref, tuple(t.shape)
        return out


def kept_for_backward(forward, keep=lambda t: True):
    """forward: a callable running a differentiable forward; keep: tensor -> bool, the tensors to track (e.g. by
    shape). -> (forward's output, [shape of each tracked storage still alive after the forward], one entry per
    storage). Keep the output alive while reading the list: it holds the graph, and with it what was saved.
    Parameters and inputs are not created by the forward and are never counted."""
    created = _Created(keep)
    with created:
        out = forward()
    gc.collect()
    return out, [shape for ref, shape in created.refs.values() if ref() is not None]
