"""What the allocator replays from a plan and its trace: the slot of the k-th allocation of a step."""

from __future__ import annotations

from dataclasses import dataclass

from memplan.errors import MemplanError
from memplan.planner.plan import Plan, PlanMismatchError, check_plan, plan_problem
from memplan.traces.format import Trace

CPU_ALIGNMENT = 64  # PyTorch's CPU allocator aligns every block to 64 bytes; kernels may rely on it


class ReplayError(MemplanError):
    """A plan cannot be replayed: wrong trace, unusable device, arena not available."""


@dataclass
class Schedule:
    """Planned allocations of one step in order (offset, requested size) and the reserved slots.

    Reserved slots belong to buffers that exist for the whole step (parameters, optimizer state,
    inputs): the replay moves them there before the steps (adoption); until then a slot holds nothing.
    A plan of scope `step` places none of them (offset -1): they get no slot and stay outside the arena.
    """

    offsets: list[int]
    sizes: list[int]
    reserved_offsets: list[int]
    reserved_sizes: list[int]
    arena: int
    bound: int
    alignment: int  # each block holds its size rounded up to this, as in the plan

    def __len__(self) -> int:
        return len(self.offsets)


def schedule_from(plan: Plan, trace: Trace, device: str = "cpu") -> Schedule:
    """The schedule of `plan` over its `trace`; ReplayError when they do not belong together, PlanError when the
    verifier refuses the plan (a replay never runs a plan whose live buffers could share bytes)."""
    try:
        check_plan(plan, plan_problem(plan, trace))
    except PlanMismatchError:
        raise ReplayError("the plan was made for a different trace (digest mismatch)") from None
    if device == "cpu" and plan.alignment % CPU_ALIGNMENT:
        raise ReplayError(
            f"plan alignment {plan.alignment} is not a multiple of {CPU_ALIGNMENT}, the CPU "
            f"allocator's alignment: solve again with --alignment {CPU_ALIGNMENT} or more"
        )
    order = [int(i) for i in trace.recorded if trace.size[i] > 0]  # size-0 requests touch no memory
    end = trace.end
    whole = [
        i
        for i in range(len(trace))
        if trace.alloc[i] == 0 and trace.free[i] == end and trace.size[i] > 0 and plan.offsets[i] >= 0
    ]
    return Schedule(
        offsets=[int(plan.offsets[i]) for i in order],
        sizes=[int(trace.size[i]) for i in order],
        reserved_offsets=[int(plan.offsets[i]) for i in whole],
        reserved_sizes=[int(trace.size[i]) for i in whole],
        arena=int(plan.arena),
        bound=int(plan.bound),
        alignment=int(plan.alignment),
    )
