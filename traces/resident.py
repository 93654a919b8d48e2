"""The tensors and storages a workload holds before its step is recorded: parameters, optimizer state,
inputs.

Inputs include tensors held by the loss object or closure (labels, masks).

They become the trace's buffers with allocation time 0. Storages are keyed as the recorder keys
them, so tied weights (one storage behind several parameters) count once. A parameter held by several
modules (T5's `shared` embedding and `lm_head`) is labelled with the first of them in `named_modules()`
order, the module of its name in `named_parameters()` (which lists a tied parameter once), and so are
its gradient and its optimizer state.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from memplan.traces.inputs.workload import Workload, optimizer_state


@dataclass
class ResidentStorage:
    """One storage that exists before the step: its key, bytes, category and module."""

    key: int  # the recorder's storage key (the data address of a real storage)
    size: int
    category: str  # parameter | gradient | optimizer | input | what Workload.held says (communication)
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


def _held_by(function: Any) -> list:
    """What a loss object or closure holds: its attributes and the variables it closes over."""
    cells = getattr(function, "__closure__", None) or ()
    held = list(getattr(function, "__dict__", {}).values())
    for cell in cells:
        try:
            held.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return held


def resident_tensors(workload: Workload, device_type: str | None = None) -> Iterator[tuple[torch.Tensor, str, str]]:
    """(tensor, category, module) for every tensor the workload holds now on `device_type` (any device when
    None: a CUDA model's AdamW keeps its step counters on the CPU), in a fixed order: parameters and buffers,
    gradients, optimizer state, inputs, tensors held by the loss, what the workload's step keeps (Workload.held).

    Capture and replay's adoption both walk this order, so they see the same storages first.
    """
    for t, category, module in _held(workload):
        t = local_tensor(t)
        if device_type is None or t.device.type == device_type:
            yield t, category, module


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds `t`'s bytes on this rank: a DTensor's (FSDP2's sharded parameters and their
    optimizer state) local shard, any other tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _held(workload: Workload) -> Iterator[tuple[torch.Tensor, str, str]]:
    """resident_tensors on every device."""

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
    owner: dict[int, str] = {}  # a tied parameter's module is the first that holds it, as in its own label above
    for path, module in workload.model.named_modules():
        for p in module.parameters(recurse=False):
            owner.setdefault(id(p), where(path))
    for param, state in optimizer_state(workload.optimizer):
        for t in _tensors_in(state):
            yield t, "optimizer", owner.get(id(param), "")
    for t in _tensors_in(workload.inputs):
        yield t, "input", ""
    for t in _tensors_in(_held_by(workload.loss_fn)):  # e.g. labels held by the loss
        yield t, "input", ""
    yield from workload.held()


def _loose_module_tensors(workload: Workload) -> Iterator[tuple[torch.Tensor, str, str]]:
    """(tensor, 'parameter', module) for modules alive outside the workload's model (a frozen teacher
    used by the loss, say): parameters and buffers, the module named by its class and path."""
    inside = {id(m) for m in workload.model.modules()}
    for obj in gc.get_objects():
        if issubclass(type(obj), nn.Module) and id(obj) not in inside:  # type(): touches no __class__ property
            root = type(obj).__name__
            for path, module in obj.named_modules():
                inside.add(id(module))
                for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
                    yield t, "parameter", f"{root}.{path}" if path else root


def resident_storages(
    workload: Workload, key: Callable[[torch.Tensor], int], alive: set[int]
) -> dict[int, ResidentStorage]:
    """Storage key -> ResidentStorage for each storage in `alive` (the keys alive when the step begins)
    that the workload holds, or that a module outside the workload holds; the rest are unnamed."""
    found: dict[int, ResidentStorage] = {}

    def take(tensors: Iterator[tuple[torch.Tensor, str, str]]) -> None:
        for t, category, module in tensors:
            k = key(t)
            if k in alive and k not in found:
                found[k] = ResidentStorage(k, t.untyped_storage().nbytes(), category, module)

    take(resident_tensors(workload))
    if len(found) < len(alive):
        take(_loose_module_tensors(workload))
    return found
