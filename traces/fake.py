"""Fake tensors for a capture: the model is built and its step run with no memory and no arithmetic.

`FakeCapture` is PyTorch's FakeTensorMode with two additions. Every fake tensor an op returns claims its
storage in the recorder, so the trace holds the storages the program saw (not the meta storages fake
tensor mode makes for its own work). In-place random fills (`uniform_`, `normal_`, ...) return their
input untouched: they allocate nothing on a real device, their values do not matter here, and on a
machine without CUDA fake tensor mode cannot run them for a fake CUDA tensor.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_leaves

from traces.recorder import Recorder

aten = torch.ops.aten
RANDOM_FILLS = frozenset({aten.uniform_, aten.normal_, aten.bernoulli_, aten.random_, aten.exponential_,
                          aten.cauchy_, aten.log_normal_, aten.geometric_})  # every overload: all in place


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a fake tensor (its sizes are real, its values are not)."""
    return isinstance(tensor, FakeTensor)


class FakeCapture(FakeTensorMode):
    """FakeTensorMode whose op outputs claim their storages in `recorder`."""

    def __init__(self, recorder: Recorder):
        super().__init__(allow_non_fake_inputs=True)
        self._claim = recorder.claim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in RANDOM_FILLS:
            return args[0]
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for t in tree_leaves(out):
            if isinstance(t, FakeTensor):
                self._claim(t)
        return out
