"""Reads the memory events of a profiled step out of the PyTorch profiler's event tree, with labels.

Each allocation or free the device's allocator reported becomes a MemoryEvent carrying the phase
(forward, backward, optimizer, other), the module path and the aten op it happened in, found from
its ancestors in the tree: the ranges of `traces.step_marks`, the autograd engine's
`evaluate_function` ranges (mapped back to the forward op's module through the sequence number)
and the optimizer's own `Optimizer.step#...` / `Optimizer.zero_grad#...` ranges.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch._C._profiler import _EventType

from traces.step_marks import BACKWARD_RANGE, MODULE_RANGE

EVALUATE_FUNCTION = "autograd::engine::evaluate_function: "
OPTIMIZER_RANGES = ("Optimizer.step#", "Optimizer.zero_grad#")
# Ops that only obtain memory for an enclosing op: the enclosing op is named instead.
ALLOCATION_HELPERS = frozenset({
    "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
    "aten::new_empty_strided", "aten::resize_", "aten::zeros", "aten::zero_",
})
SCALAR_OP = "python scalar"  # an allocation outside any op: a Python number wrapped as a tensor


@dataclass
class MemoryEvent:
    """One allocation (size > 0) or free (size < 0) reported by the allocator, in time order."""

    time_ns: int
    size: int
    addr: int
    phase: str
    module: str
    op: str


@dataclass
class StepEvents:
    """The memory events of one device in order, and where the step's phases begin and end (ns)."""

    events: list[MemoryEvent]
    backward_start_ns: int | None
    optimizer_start_ns: int | None
    optimizer_end_ns: int | None


def _is_op(event) -> bool:
    return event.tag == _EventType.TorchOp


def _ancestors(event) -> list:
    chain = []
    parent = event.parent
    while parent is not None:
        chain.append(parent)
        parent = parent.parent
    return chain  # innermost first


def _op_name(ancestors: list) -> str:
    aten = [a.name for a in ancestors if _is_op(a) and a.name.startswith("aten::")]
    for name in aten:
        if name not in ALLOCATION_HELPERS:
            return name
    return aten[0] if aten else SCALAR_OP


def _module_in_forward(ancestors: list) -> str:
    for a in ancestors:
        if _is_op(a) and a.name.startswith(MODULE_RANGE):
            return a.name[len(MODULE_RANGE):]
    return ""


def _walk(roots):
    stack = list(reversed(roots))
    while stack:
        e = stack.pop()
        yield e
        stack.extend(reversed(e.children))


def step_events(tree, device_type: str) -> StepEvents:
    """Collect the labelled memory events of `device_type` ('cpu' or 'cuda') from an event tree."""
    forward_module_of_seq: dict[int, str] = {}
    allocations = []
    backward_start = optimizer_start = optimizer_end = None
    for order, e in enumerate(_walk(tree)):
        if e.tag == _EventType.Allocation:
            if e.extra_fields.device.type == device_type:
                allocations.append((e.start_time_ns, order, e))
            continue
        if not _is_op(e):
            continue
        name = e.name
        if name == BACKWARD_RANGE and backward_start is None:
            backward_start = e.start_time_ns
        elif name.startswith(OPTIMIZER_RANGES[0]) and optimizer_start is None:
            optimizer_start, optimizer_end = e.start_time_ns, e.end_time_ns
        seq = e.extra_fields.sequence_number
        if seq >= 0 and not name.startswith(EVALUATE_FUNCTION):
            # Ops report the next sequence number until one creates the autograd node and takes it:
            # the last forward op (in time order) with a number is the node's creator.
            ancestors = _ancestors(e)
            if not any(_is_op(a) and a.name.startswith(EVALUATE_FUNCTION) for a in ancestors):
                forward_module_of_seq[seq] = _module_in_forward([e] + ancestors)

    allocations.sort(key=lambda x: (x[0], x[1]))
    events = []
    for time_ns, _, e in allocations:
        ancestors = _ancestors(e)
        names = [a.name for a in ancestors if _is_op(a)]
        evaluate = next((a for a in ancestors if _is_op(a) and a.name.startswith(EVALUATE_FUNCTION)), None)
        if any(n.startswith(OPTIMIZER_RANGES) for n in names):
            phase, module = "optimizer", ""
        elif evaluate is not None or BACKWARD_RANGE in names:
            phase = "backward"
            seq = evaluate.extra_fields.sequence_number if evaluate is not None else -1
            module = forward_module_of_seq.get(seq, "")
        elif backward_start is None or time_ns < backward_start:
            phase, module = "forward", _module_in_forward(ancestors)
        else:
            phase, module = "other", ""
        events.append(MemoryEvent(time_ns=time_ns, size=int(e.extra_fields.alloc_size),
                                  addr=int(e.extra_fields.ptr), phase=phase, module=module,
                                  op=_op_name(ancestors)))
    return StepEvents(events, backward_start, optimizer_start, optimizer_end)
