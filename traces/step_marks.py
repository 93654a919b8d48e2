"""Marks that let a profiled training step be labelled: module and backward ranges, optimizer hooks.

While `marked_step` is active, every module call runs inside a profiler range named
`memplan.module:<path>` (the workload's loss function inside `memplan.module:loss`),
`torch.autograd.backward` runs inside `memplan.phase:backward`, and the
optimizer's step hooks note which storages hold gradients when the step starts and optimizer state
when it ends. None of this allocates tensor memory, so the step's allocations stay those of a plain step.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.autograd.profiler import record_function

from traces.workload import Workload

MODULE_RANGE = "memplan.module:"
BACKWARD_RANGE = "memplan.phase:backward"
ROOT_MODULE = "model"
LOSS_MODULE = "loss"


@dataclass
class StepMarks:
    """What the hooks saw during the marked step: storage addresses of gradients and optimizer state."""

    grad_ptrs: set[int] = field(default_factory=set)  # p.grad storages when optimizer.step() begins
    state_ptrs: set[int] = field(default_factory=set)  # optimizer state storages when it ends


def module_paths(model: torch.nn.Module) -> dict[int, str]:
    """id(module) -> dotted path, the root named `model` (so `model.encoder.layer.0`)."""
    return {id(m): f"{ROOT_MODULE}.{name}" if name else ROOT_MODULE for name, m in model.named_modules()}


def state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every tensor held in the optimizer's per-parameter state (moments, step counters, ...)."""
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@contextlib.contextmanager
def _module_ranges(model: torch.nn.Module) -> Iterator[None]:
    paths = module_paths(model)
    open_ranges: list[record_function] = []

    def enter(module, _inputs):
        rf = record_function(MODULE_RANGE + paths.get(id(module), type(module).__name__))
        rf.__enter__()
        open_ranges.append(rf)

    def leave(_module, _inputs, _output):
        open_ranges.pop().__exit__(None, None, None)

    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(enter))
        handles.append(m.register_forward_hook(leave, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        while open_ranges:
            open_ranges.pop().__exit__(None, None, None)


@contextlib.contextmanager
def _loss_range(workload: Workload) -> Iterator[None]:
    loss_fn = workload.loss_fn

    def marked_loss(output, inputs):
        with record_function(MODULE_RANGE + LOSS_MODULE):
            return loss_fn(output, inputs)

    workload.loss_fn = marked_loss
    try:
        yield
    finally:
        workload.loss_fn = loss_fn


@contextlib.contextmanager
def _backward_range() -> Iterator[None]:
    original = torch.autograd.backward

    def marked_backward(*args, **kwargs):
        with record_function(BACKWARD_RANGE):
            return original(*args, **kwargs)

    torch.autograd.backward = marked_backward
    try:
        yield
    finally:
        torch.autograd.backward = original


@contextlib.contextmanager
def _optimizer_hooks(optimizer: torch.optim.Optimizer, marks: StepMarks) -> Iterator[None]:
    def before(opt, _args, _kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    marks.grad_ptrs.add(_storage_ptr(p.grad))

    def after(opt, _args, _kwargs):
        marks.state_ptrs.update(_storage_ptr(t) for t in state_tensors(opt))

    handles = [optimizer.register_step_pre_hook(before), optimizer.register_step_post_hook(after)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def marked_step(workload: Workload) -> Iterator[StepMarks]:
    """Install the module and loss ranges, the backward range and the optimizer hooks for one step."""
    marks = StepMarks()
    with (_module_ranges(workload.model), _loss_range(workload), _backward_range(),
          _optimizer_hooks(workload.optimizer, marks)):
        yield marks
