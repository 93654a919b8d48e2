"""Marks that label a recorded step: module and phase as the recorder sees them, and optimizer hooks.

While `marked_step` is active, every module call tells the recorder its dotted path (the root is
`model`, so `model.encoder.layer.0`; the workload's loss function is `loss`), `torch.autograd.backward`
runs in the backward phase and `optimizer.step()` in the optimizer phase, and the optimizer's hooks
note which storages hold gradients when the step starts and optimizer state when it ends. None of
this allocates tensor memory, so the step's allocations stay those of a plain step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch.utils.hooks import RemovableHandle

from memplan.traces.inputs.workload import Workload, optimizer_state
from memplan.traces.on_import import patched_on_import
from memplan.traces.ranks.communication import collective_buffers
from memplan.traces.recorder import BACKWARD, FORWARD, OPTIMIZER, OTHER, Recorder
from memplan.traces.resident import local_tensor

ROOT_MODULE = "model"
LOSS_MODULE = "loss"


@dataclass
class StepMarks:
    """What the hooks saw during the marked step: storage keys and when the phases began (event counts)."""

    grad_keys: set[int] = field(default_factory=set)  # p.grad storages when optimizer.step() begins
    state_keys: set[int] = field(default_factory=set)  # optimizer state storages when it ends
    backward_at: int | None = None  # events recorded before backward began
    backward_starts: list[int] = field(default_factory=list)  # ... before each backward began (one per micro-batch)
    optimizer_at: int | None = None  # ... before optimizer.step() began
    optimizer_end: int | None = None  # ... before it ended
    collectives: dict[int, tuple[int, str]] = field(default_factory=dict)  # FSDP2's collective buffers: allocation
    #                                                                         time -> (key, collective)


def module_paths(model: torch.nn.Module) -> dict[int, str]:
    """id(module) -> dotted path, the root named `model` (so `model.encoder.layer.0`)."""
    return {id(m): f"{ROOT_MODULE}.{name}" if name else ROOT_MODULE for name, m in model.named_modules()}


def state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every tensor held in the optimizer's per-parameter state (moments, step counters, ...), a wrapped one's too."""
    for _, state in optimizer_state(optimizer):
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def _never_compiled(handles: list[tuple[RemovableHandle, Callable]]) -> Callable[[ModuleType], None]:
    """What keeps the module hooks registered with `handles` out of torch.compile once torch._dynamo is imported (at
    once if it is, else when the program imports it: traces/on_import.py): a compiled model calls its hooks from its
    eager parts (at graph breaks), and Dynamo compiling them there would be work, and allocations, that a plain step
    does not do. Without torch._dynamo imported nothing is compiled (and importing it would cost seconds inside an
    eager step)."""

    def disable(dynamo: ModuleType) -> None:
        disabled = {hook: dynamo.disable(hook) for hook in {hook for _, hook in handles}}
        for handle, hook in handles:
            table = handle.hooks_dict_ref()
            if table is not None and handle.id in table:
                table[handle.id] = disabled[hook]

    return disable


@contextlib.contextmanager
def _module_labels(model: torch.nn.Module, roots: list[torch.nn.Module], recorder: Recorder) -> Iterator[None]:
    """Module labels; a call of the whole model (of one of `roots`, a pipeline's stages) outside backward is a forward
    (gradient accumulation's next micro-batch after a backward included)."""
    labels = {key: recorder.intern(path) for key, path in module_paths(model).items()}
    entered: list[int] = []
    starts = {id(m) for m in roots}

    def enter(module, _inputs):
        if id(module) in starts and not entered and torch.is_grad_enabled():
            recorder.set_phase(FORWARD)
        recorder.enter_module(labels.get(id(module)) or recorder.intern(type(module).__name__))
        entered.append(1)

    def leave(_module, _inputs, _output):
        if entered:
            entered.pop()
            recorder.leave_module()

    handles = []
    for m in model.modules():
        handles.append((m.register_forward_pre_hook(enter), enter))
        handles.append((m.register_forward_hook(leave, always_call=True), leave))
    try:
        with patched_on_import("torch._dynamo", _never_compiled(handles)):
            yield
    finally:
        for h, _ in handles:
            h.remove()
        while entered:
            entered.pop()
            recorder.leave_module()


@contextlib.contextmanager
def _loss_label(workload: Workload, recorder: Recorder) -> Iterator[None]:
    loss_fn, label = workload.loss_fn, recorder.intern(LOSS_MODULE)

    def labelled_loss(output, inputs):
        recorder.enter_module(label)
        try:
            return loss_fn(output, inputs)
        finally:
            recorder.leave_module()

    workload.loss_fn = labelled_loss
    try:
        yield
    finally:
        workload.loss_fn = loss_fn


@contextlib.contextmanager
def _backward_phase(recorder: Recorder, marks: StepMarks) -> Iterator[None]:
    original = torch.autograd.backward

    def backward(*args, **kwargs):
        started = recorder.set_phase(BACKWARD)
        marks.backward_starts.append(started)
        if marks.backward_at is None:
            marks.backward_at = started
        try:
            return original(*args, **kwargs)
        finally:
            recorder.set_phase(OTHER)

    torch.autograd.backward = backward
    try:
        yield
    finally:
        torch.autograd.backward = original


@contextlib.contextmanager
def _optimizer_hooks(optimizer: torch.optim.Optimizer, recorder: Recorder, marks: StepMarks) -> Iterator[None]:
    def before(opt, _args, _kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    marks.grad_keys.add(recorder.storage_key(local_tensor(p.grad)))  # FSDP2's: its shard
        started = recorder.set_phase(OPTIMIZER)
        if marks.optimizer_at is None:
            marks.optimizer_at = started

    def after(opt, _args, _kwargs):
        marks.optimizer_end = recorder.set_phase(OTHER)
        marks.state_keys.update(recorder.storage_key(t) for t in state_tensors(opt))

    handles = [optimizer.register_step_pre_hook(before), optimizer.register_step_post_hook(after)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def marked_step(workload: Workload, recorder: Recorder) -> Iterator[StepMarks]:
    """Label one step: module and loss hooks, the backward and optimizer phases (forward until backward), FSDP2's
    collective buffers."""
    marks = StepMarks()
    recorder.set_phase(FORWARD)
    try:
        with (
            _module_labels(workload.model, workload.roots(), recorder),
            _loss_label(workload, recorder),
            _backward_phase(recorder, marks),
            _optimizer_hooks(workload.optimizer, recorder, marks),
            collective_buffers(recorder, marks.collectives),
        ):
            yield marks
    finally:
        recorder.set_phase(OTHER)
