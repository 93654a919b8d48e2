"""The tensors and storages a workload holds before its step is recorded: parameters, optimizer state,
inputs.

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


def resident_tensors(workload: Workload) -> Iterator[tuple[torch.Tensor, str, str]]:
    """(tensor, category, module) for every tensor the workload holds now, on any device, in a fixed
    order: parameters and buffers, gradients, optimizer state, inputs, tensors held by the loss.

    Capture and replay's adoption both walk this order, so they see the same storages first.
    """
    def where(path: str) -> str:
        return f"model.{path}" if path else "model"

    for path, module in workload.model.named_modules():
        for p in module.parameters(recurse=False):
            yield p, "parameter", where(path)
        for b in module.buffers(recurse=False):
            yield b, "parameter", where(path)
    for path, module in workload.model.named_modules():
        for p in module.parameters(recurse=False):
            if p.grad is not None:
                yield p.grad, "gradient", where(path)
    owner = {id(p): where(path) for path, module in workload.model.named_modules()
             for p in module.parameters(recurse=False)}
    for param, state in workload.optimizer.state.items():
        for t in _tensors_in(state):
            yield t, "optimizer", owner.get(id(param), "")
    for t in _tensors_in(workload.inputs):
        yield t, "input", ""
    for t in _tensors_in(getattr(workload.loss_fn, "__dict__", {})):  # e.g. labels held by the loss
        yield t, "input", ""


def resident_storages(workload: Workload, device_type: str) -> dict[int, ResidentStorage]:
    """Address -> ResidentStorage for every storage on `device_type` the workload holds now."""
    found: dict[int, ResidentStorage] = {}
    for t, category, module in resident_tensors(workload):
        if t.device.type != device_type:
            continue
        storage = t.untyped_storage()
        addr, size = storage.data_ptr(), storage.nbytes()
        if size > 0 and addr not in found:
            found[addr] = ResidentStorage(addr, size, category, module)
    return found
