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
MEMORY_EVENT = "[memory]"  # the profiler's name for an allocation or free


@dataclass
class MemoryEvent:
    """One allocation (size > 0) or free (size < 0) reported by the allocator, in time order."""

    time_ns: int
    size: int
    addr: int
    phase: str
    module: str
    op: str
    stream: int = 0  # the CUDA stream, from the caching allocator's history (0 on the CPU)


@dataclass
class StepEvents:
    """The memory events of one device in order, and where the step's phases begin and end (ns)."""

    events: list[MemoryEvent]
    backward_start_ns: int | None
    optimizer_start_ns: int | None
    optimizer_end_ns: int | None


# The context an event inherits from its ancestors, carried down the tree in one pass as a tuple:
# (innermost memplan module range, sequence number of the innermost autograd evaluate_function or -1,
#  inside the memplan backward range, inside Optimizer.step/zero_grad,
#  innermost aten op that is not an allocation helper, innermost aten op).
_ROOT = ("", -1, False, False, "", "")


def _enter(ctx: tuple, name: str, event) -> tuple:
    """The context of a non-aten op's children (aten ops are handled inline, they are most events)."""
    module, evaluate_seq, backward, optimizer, op, any_op = ctx
    if name.startswith(MODULE_RANGE):
        return (name[len(MODULE_RANGE):], evaluate_seq, backward, optimizer, op, any_op)
    if name.startswith(EVALUATE_FUNCTION):
        if evaluate_seq >= 0:  # a node run by a backward (recomputation): its forward ran in backward too
            return ctx
        return (module, event.extra_fields.sequence_number, backward, optimizer, op, any_op)
    if name == BACKWARD_RANGE:
        return (module, evaluate_seq, True, optimizer, op, any_op)
    if name.startswith(OPTIMIZER_RANGES):
        return (module, evaluate_seq, backward, True, op, any_op)
    return ctx


def step_events(tree, device_type: str) -> StepEvents:
    """Collect the labelled memory events of `device_type` ('cpu' or 'cuda') from an event tree."""
    forward_module_of_seq: dict[int, str] = {}
    allocations = []
    marks: dict[str, int | None] = {"backward": None, "optimizer": None, "optimizer_end": None}
    op_tag = _EventType.TorchOp

    def visit(events, ctx: tuple) -> None:  # recursion is cheaper than an explicit stack here
        for e in events:
            name = e.name
            if name == MEMORY_EVENT:
                fields = e.extra_fields
                if fields.device.type == device_type:
                    allocations.append((e.start_time_ns, len(allocations), fields, ctx))
                continue
            is_aten = name.startswith("aten::")
            if (is_aten or e.tag == op_tag) and ctx[1] < 0 and not ctx[2] and not ctx[3]:
                # Forward ops (aten ops and custom autograd Functions alike) report the next sequence
                # number until one creates the autograd node and takes it: the last forward op (in time
                # order) with a number is its creator. (Backward and optimizer ops create no node anyone
                # asks about: not read, it is slow.)
                seq = e.extra_fields.sequence_number
                if seq >= 0:
                    forward_module_of_seq[seq] = ctx[0]
            if is_aten:
                inner = ctx[:5] + (name,) if name in ALLOCATION_HELPERS else ctx[:4] + (name, name)
            elif e.tag == op_tag:
                if name == BACKWARD_RANGE and marks["backward"] is None:
                    marks["backward"] = e.start_time_ns
                elif name.startswith(OPTIMIZER_RANGES[0]) and marks["optimizer"] is None:
                    marks["optimizer"], marks["optimizer_end"] = e.start_time_ns, e.end_time_ns
                inner = _enter(ctx, name, e)
            else:
                inner = ctx
            children = e.children
            if children:
                visit(children, inner)

    visit(tree, _ROOT)
    backward_start = marks["backward"]
    allocations.sort(key=lambda x: (x[0], x[1]))
    events = []
    for time_ns, _, fields, (module, evaluate_seq, backward, optimizer, op, any_op) in allocations:
        if optimizer:
            phase, module = "optimizer", ""
        elif evaluate_seq >= 0 or backward:
            phase = "backward"
            module = forward_module_of_seq.get(evaluate_seq, "") if evaluate_seq >= 0 else ""
        elif backward_start is None or time_ns < backward_start:
            phase = "forward"
        else:
            phase, module = "other", ""
        events.append(MemoryEvent(time_ns, int(fields.alloc_size), int(fields.ptr), phase, module,
                                  op or any_op or SCALAR_OP))
    return StepEvents(events, backward_start, marks["optimizer"], marks["optimizer_end"])
