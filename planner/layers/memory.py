"""Bytes a forward pass holds for backward, and the per-layer formulas of REFERENCE §1 they are checked against."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from memplan.traces.errors import MemplanError


class MeasureError(MemplanError):
    """A measurement was asked of something it does not apply to (unknown mode, trace without backward)."""


def saved_bytes(model: nn.Module, forward: Callable[[], object]) -> int:
    """Bytes of the distinct non-parameter storages autograd saves while `forward()` runs (the graph is kept
    until return)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    storages: dict[int, int] = {}
    kept = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    del out
    kept.clear()
    return sum(storages.values())


@dataclass(frozen=True)
class LayerShape:
    """The symbols of REFERENCE §1: sequence s, micro-batch b, hidden h, heads a, bytes per element p."""

    s: int
    b: int
    h: int
    a: int
    p: int

    def formula(self, mode: str) -> int:
        """Activation bytes one Transformer layer holds for backward under `mode` (Megatron's accounting)."""
        sbh, as2b, p = self.s * self.b * self.h, self.a * self.s * self.s * self.b, self.p
        if mode == "baseline":
            return sbh * (16 * p + 2) + as2b * (2 * p + 1)
        if mode == "tempo":
            return sbh * (10 * p + 6) + as2b * (p + 1)
        if mode == "selective":
            return sbh * (16 * p + 2)
        if mode == "tempo+selective":
            return sbh * (10 * p + 6)
        raise MeasureError(f"no formula for layers mode {mode!r}")


def held_for_backward(trace) -> int:
    """Bytes a captured step holds from forward into backward: forward-phase buffers still live when backward begins."""
    backward = [i for i, phase in enumerate(trace.phase) if phase == "backward"]
    if not backward:
        raise MeasureError("the trace has no backward phase: nothing is held for backward")
    start = int(trace.alloc[backward].min())
    forward = [i for i, phase in enumerate(trace.phase) if phase == "forward"]
    live = [i for i in forward if trace.alloc[i] < start < trace.free[i]]
    return int(trace.size[live].sum())
