"""The storages a workload holds before its step is recorded: parameters, optimizer state, inputs.

Inputs include tensors held as attributes of the loss object (labels, masks).

They become the trace's buffers with allocation time 0. Storages are keyed by address, so tied
weights (one storage behind several parameters) count once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

from traces.workload import Workload


@dataclass
class ResidentStorage:
    """One storage that exists before recording: its address, bytes and category."""

    addr: int
    size: int
    category: str  # parameter | gradient | optimizer | input
    module: str


def _tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict) or hasattr(value, "values") and callable(value.values):
        for v in value.values():
            yield from _tensors_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v)


def resident_storages(workload: Workload, device_type: str) -> dict[int, ResidentStorage]:
    """Address -> ResidentStorage for every storage on `device_type` the workload holds now."""
    found: dict[int, ResidentStorage] = {}

    def add(t: torch.Tensor, category: str, module: str) -> None:
        if t.device.type != device_type:
            return
        storage = t.untyped_storage()
        addr, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or addr in found:
            return
        found[addr] = ResidentStorage(addr, size, category, module)

    for path, module in workload.model.named_modules():
        where = f"model.{path}" if path else "model"
        for p in module.parameters(recurse=False):
            add(p, "parameter", where)
        for b in module.buffers(recurse=False):
            add(b, "parameter", where)
    for path, module in workload.model.named_modules():
        for p in module.parameters(recurse=False):
            if p.grad is not None:
                add(p.grad, "gradient", f"model.{path}" if path else "model")
    owner = {id(p): f"model.{path}" if path else "model"
             for path, module in workload.model.named_modules() for p in module.parameters(recurse=False)}
    for param, state in workload.optimizer.state.items():
        for t in _tensors_in(state):
            add(t, "optimizer", owner.get(id(param), ""))
    for t in _tensors_in(workload.inputs):
        add(t, "input", "")
    for t in _tensors_in(getattr(workload.loss_fn, "__dict__", {})):  # e.g. labels held by the loss
        add(t, "input", "")
    return found
