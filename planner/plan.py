"""The memplan-plan/1 format: one byte offset per trace buffer, the arena, the bound and how it was found.

A plan is only written after the verifier (planner/verify.py) accepted it against its problem.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from memplan.errors import PlanError
from memplan.files import atomic_write, read_bytes
from memplan.planner.problem import Problem, problem_from_trace
from memplan.planner.verify import verify_plan
from memplan.traces.format import Trace

FORMAT = "memplan-plan/1"
STATUSES = ("optimal", "feasible")


@dataclass
class Plan:
    """A verified placement: offsets[i] is the byte offset of trace buffer i inside an arena of `arena` bytes."""

    digest: str  # trace_digest of the trace (or CSV digest) it was made for
    alignment: int
    offsets: list[int]
    arena: int
    bound: int  # best proven lower bound on the arena
    status: str  # "optimal" (arena == bound) or "feasible"
    gap: float  # arena / bound - 1 (0 when optimal)
    solver: str  # which method produced the offsets
    seconds: float
    capacity: int | None = None  # the capacity the plan was asked to fit, if any
    scope: str = "all"  # "all" buffers placed, or the "step"'s own (whole-window buffers at offset -1)
    bound_source: str = ""  # how the bound was proven, in words (e.g. "max-live"); "" in older plans

    @property
    def buffers(self) -> int:
        return len(self.offsets)


def plan_to_dict(plan: Plan) -> dict:
    """The JSON-ready memplan-plan/1 document."""
    return {"format": FORMAT, **asdict(plan)}


def plan_problem(plan: Plan, trace: Trace) -> Problem:
    """The allocation problem `plan` places, built from `trace` with the plan's alignment and scope."""
    return problem_from_trace(trace, alignment=plan.alignment, scope=plan.scope)


def check_plan(plan: Plan, problem: Problem) -> None:
    """PlanError unless `plan` was made for `problem` (digest, alignment, scope) and passes the verifier."""
    if plan.digest != problem.digest:
        raise PlanError("plan was made for a different trace (digest mismatch)")
    if plan.alignment != problem.alignment:
        raise PlanError(f"plan alignment {plan.alignment} differs from the problem's {problem.alignment}")
    if plan.scope != problem.scope:
        raise PlanError(f"plan scope {plan.scope!r} differs from the problem's {problem.scope!r}")
    verify_plan(problem, plan.offsets, plan.arena, plan.capacity)


def save_plan(plan: Plan, problem: Problem, path: str | os.PathLike) -> None:
    """Verify the plan against its problem, then write it atomically (gzipped if the name ends in .gz)."""
    check_plan(plan, problem)
    atomic_write(path, json.dumps(plan_to_dict(plan), separators=(",", ":")))


def _field(data: dict, name: str, kinds, name_of_file: str):
    if name not in data:
        raise PlanError(f"{name_of_file}: missing field {name!r}")
    v = data[name]
    if not isinstance(v, kinds) or isinstance(v, bool):
        raise PlanError(f"{name_of_file}: field {name!r} has the wrong type ({type(v).__name__})")
    return v


def load_plan(path: str | os.PathLike) -> Plan:
    """Read a memplan-plan/1 file; errors name the file and the field."""
    name = os.fspath(path)
    try:
        data = json.loads(read_bytes(path))
    except FileNotFoundError:
        raise PlanError(f"{name}: no such file") from None
    except (OSError, ValueError) as e:
        raise PlanError(f"{name}: not a readable JSON plan ({type(e).__name__})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PlanError(f"{name}: not a {FORMAT} file")
    offsets = _field(data, "offsets", list, name)
    scope = data.get("scope", "all")  # plans written before scopes existed place every buffer
    if scope not in ("all", "step"):
        raise PlanError(f"{name}: scope {scope!r} is not one of all, step")
    lowest = 0 if scope == "all" else -1
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= lowest for x in offsets):
        raise PlanError(f"{name}: offsets must be non-negative integers (-1 outside a step plan)")
    status = _field(data, "status", str, name)
    if status not in STATUSES:
        raise PlanError(f"{name}: status {status!r} is not one of {', '.join(STATUSES)}")
    capacity = data.get("capacity")
    if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool)):
        raise PlanError(f"{name}: field 'capacity' has the wrong type")
    return Plan(
        digest=_field(data, "digest", str, name),
        alignment=_field(data, "alignment", int, name),
        offsets=offsets,
        arena=_field(data, "arena", int, name),
        bound=_field(data, "bound", int, name),
        status=status,
        gap=float(_field(data, "gap", (int, float), name)),
        solver=_field(data, "solver", str, name),
        seconds=float(_field(data, "seconds", (int, float), name)),
        capacity=capacity,
        scope=scope,
        bound_source=str(data.get("bound_source", "")),
    )
