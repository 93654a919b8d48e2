"""Plan simulator: the memory a step holds when it runs on a plan, checked against its trace first.

The step's footprint is the arena, reserved for the whole step, plus whatever the trace holds outside
the plan: nothing for a plan of scope `all`, the whole-window buffers (parameters, optimizer state,
inputs, at their sizes rounded to the plan's alignment) for a `step` plan. What varies inside is how
much of the arena is in use (aligned live bytes). The plan is re-checked with the independent verifier (its
figures too: planner.plan.check_plan), so a hand-edited or foreign plan is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memplan.errors import PlanError
from memplan.planner.plan import Plan, PlanMismatchError, check_plan, plan_problem
from memplan.planner.problem import ProblemError, align_up
from memplan.traces.format import Trace, live_bytes, trace_digest


@dataclass
class PlanMemory:
    """Per-event memory of a trace run on a plan."""

    arena: int  # bytes reserved for the whole step
    in_use: np.ndarray  # per logical time: aligned bytes of the live planned buffers, inside the arena
    outside: np.ndarray  # per logical time: aligned bytes of the live buffers outside the plan

    @property
    def peak_in_use(self) -> int:
        return int(self.in_use.max(initial=0))

    @property
    def peak_outside(self) -> int:
        return int(self.outside.max(initial=0))

    @property
    def total(self) -> np.ndarray:
        """Per logical time: the arena plus what is held outside the plan."""
        return self.arena + self.outside

    @property
    def peak_total(self) -> int:
        return self.arena + self.peak_outside


def simulate_plan(trace: Trace, plan: Plan, trace_name: str = "trace", plan_name: str = "plan") -> PlanMemory:
    """The memory of `trace` run on `plan`; PlanMismatchError/PlanError if the plan is not valid for it."""
    if plan.digest != trace_digest(trace):
        raise PlanMismatchError(
            f"{plan_name}: plan was made for another trace, not {trace_name} "
            f"(trace digest differs); solve {trace_name} again"
        )
    try:
        problem = plan_problem(plan, trace)
        check_plan(plan, problem)
    except (PlanError, ProblemError) as e:
        raise PlanError(f"{plan_name}: invalid for {trace_name}: {e}") from None
    held_outside = align_up(trace.size, plan.alignment) * problem.outside
    return PlanMemory(
        arena=int(plan.arena),
        in_use=live_bytes(problem.size * problem.active, trace.alloc, trace.free, trace.end),
        outside=live_bytes(held_outside, trace.alloc, trace.free, trace.end),
    )


def match_plans(traces: list[tuple[str, Trace]], plans: list[tuple[str, Plan]]) -> list[tuple[str, Plan] | None]:
    """For each trace, the (name, plan) made for it among `plans` (by trace digest), or None.

    Identical traces (symmetric ranks) take the plans made for them in the order given, and share one
    when only one is given. A plan made for none of the traces, or one plan more than there are
    traces with its digest, raise PlanMismatchError.
    """
    digests = [trace_digest(t) for _, t in traces]
    matched: list[tuple[str, Plan] | None] = [None] * len(traces)
    for plan_name, plan in plans:
        hits = [k for k, d in enumerate(digests) if d == plan.digest]
        if not hits:
            raise PlanMismatchError(f"{plan_name}: plan was made for none of the given traces (trace digest differs)")
        free = [k for k in hits if matched[k] is None]
        if not free:
            raise PlanMismatchError(
                f"{plan_name}: a second plan for {traces[hits[0]][0]} (already planned by {matched[hits[0]][0]})"
            )
        matched[free[0]] = (plan_name, plan)
    for k, digest in enumerate(digests):
        if matched[k] is None:
            matched[k] = next(((n, p) for n, p in plans if p.digest == digest), None)
    return matched
