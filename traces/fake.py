"""Fake tensors for a capture: the model is built and its step run with no memory and no arithmetic.

`FakeCapture` is PyTorch's FakeTensorMode with three additions.
- Every fake tensor an op returns claims its storage in the recorder, so the trace holds the storages
  the program saw (not the meta storages fake tensor mode makes for its own work).
- In-place random fills (`uniform_`, `normal_`, ...) return their input untouched: they allocate
  nothing on a real device, their values do not matter here, and on a machine without CUDA fake
  tensor mode cannot run them for a fake CUDA tensor.
- Values that depend on data get a rule instead of an error (DATA_RULE): a scalar read from a
  tensor (`.item()`, `bool(t)`) is 0 (False), and a selection whose size depends on the data
  (`nonzero`, `masked_select`) selects nothing. Each use is counted per op in `data_dependent`, and
  the trace's meta keeps the counts.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._pytree import tree_leaves

from traces.errors import MemplanError
from traces.recorder import Recorder

aten = torch.ops.aten
RANDOM_FILLS = frozenset({aten.uniform_, aten.normal_, aten.bernoulli_, aten.random_, aten.exponential_,
                          aten.cauchy_, aten.log_normal_, aten.geometric_})  # every overload: all in place
DATA_RULE = "a scalar read from a fake tensor is 0 (False); a data-dependent selection selects nothing"


class DataDependentError(MemplanError):
    """An op's output size depends on tensor values in a way DATA_RULE does not cover."""


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a fake tensor (its sizes are real, its values are not)."""
    return isinstance(tensor, FakeTensor)


def module_to(model: nn.Module, device=None, dtype: torch.dtype | None = None) -> nn.Module:
    """`model.to(device, dtype)`, also for a model of fake tensors: fake parameters cannot be swapped in
    place (fake tensor mode holds weak references to them), so each is rebound to its converted copy,
    tied ones once. Only floating-point tensors change dtype, as with `Module.to`."""
    if not any(is_fake(t) for t in (*model.parameters(), *model.buffers())):
        return model.to(device=device, dtype=dtype)
    converted: dict[int, torch.Tensor] = {}

    def convert(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in converted:
            new = t.detach().to(device=device, dtype=dtype if t.is_floating_point() else None)
            converted[id(t)] = nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new
        return converted[id(t)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    table[name] = convert(t)
    return model


class FakeCapture(FakeTensorMode):
    """FakeTensorMode whose op outputs claim their storages in `recorder`, with DATA_RULE."""

    def __init__(self, recorder: Recorder):
        super().__init__(allow_non_fake_inputs=True)
        self._claim = recorder.claim
        self.data_dependent: Counter[str] = Counter()  # op -> times DATA_RULE decided its output

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in RANDOM_FILLS:
            return args[0]
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            out = self._by_rule(func, args)
        for t in tree_leaves(out):
            if isinstance(t, FakeTensor):
                self._claim(t)
        return out

    def _by_rule(self, func, args):
        """DATA_RULE's output for `func`; DataDependentError for an op it does not cover."""
        packet = func.overloadpacket
        self.data_dependent[str(packet)] += 1
        if packet is aten._local_scalar_dense:
            return False if args[0].dtype == torch.bool else 0.0 if args[0].is_floating_point() else 0
        if packet is aten.nonzero:
            with self:
                return torch.empty((0, args[0].dim()), dtype=torch.long, device=args[0].device)
        if packet is aten.masked_select:
            with self:
                return torch.empty(0, dtype=args[0].dtype, device=args[0].device)
        raise DataDependentError(f"{packet}: its output size depends on tensor values, which fake tensors do "
                                 "not have (trace without --fake)")
