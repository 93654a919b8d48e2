"""The memplan-plan/1 format: one byte offset per trace buffer, the arena, the bound and how it was found.

A plan is only written after the verifier (planner/verify.py) accepted it against its problem, and only read
(load_plan) together with its trace, verified again: a plan file edited by hand, or made for another trace, is
refused by every command before any of its figures is shown or replayed.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields

from memplan.errors import PlanError
from memplan.files import atomic_write, read_json
from memplan.limits import short_repr
from memplan.planner.problem import MAX_BYTES, Problem, ProblemError, problem_from_trace
from memplan.planner.verify import verify_figures, verify_plan
from memplan.traces.format import Trace, trace_digest

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


class PlanMismatchError(PlanError):
    """A plan was made for another trace (its digest differs)."""


def plan_to_dict(plan: Plan) -> dict:
    """The JSON-ready memplan-plan/1 document (its offsets the plan's own list, not a copy: a million of them
    would take longer to copy than to write)."""
    return {"format": FORMAT, **{f.name: getattr(plan, f.name) for f in fields(plan)}}


def plan_problem(plan: Plan, trace: Trace) -> Problem:
    """The allocation problem `plan` places, built from `trace` with the plan's alignment and scope."""
    return problem_from_trace(trace, alignment=plan.alignment, scope=plan.scope)


def check_plan(plan: Plan, problem: Problem) -> None:
    """PlanError unless `plan` was made for `problem` (digest, alignment, scope) and passes the verifier, its
    figures (arena, bound, status, gap) included."""
    if plan.digest != problem.digest:
        raise PlanMismatchError("plan was made for a different trace (digest mismatch)")
    if plan.alignment != problem.alignment:
        raise PlanError(f"plan alignment {plan.alignment} differs from the problem's {problem.alignment}")
    if plan.scope != problem.scope:
        raise PlanError(f"plan scope {plan.scope!r} differs from the problem's {problem.scope!r}")
    verify_plan(problem, plan.offsets, plan.arena, plan.capacity)
    verify_figures(problem, plan.offsets, arena=plan.arena, bound=plan.bound, status=plan.status, gap=plan.gap,
                   bound_source=plan.bound_source)  # fmt: skip


def save_plan(plan: Plan, problem: Problem, path: str | os.PathLike) -> None:
    """Verify the plan against its problem, then write it atomically (gzipped if the name ends in .gz)."""
    check_plan(plan, problem)
    write_plan(plan, path)


def write_plan(plan: Plan, path: str | os.PathLike) -> None:
    """Write a plan the verifier has just accepted against its problem (the plan solve() returns) atomically,
    without verifying it again; any other plan goes through save_plan."""
    atomic_write(path, json.dumps(plan_to_dict(plan), separators=(",", ":")))


def _field(data: dict, name: str, kinds, name_of_file: str):
    if name not in data:
        raise PlanError(f"{name_of_file}: missing field {name!r}")
    v = data[name]
    if not isinstance(v, kinds) or isinstance(v, bool):
        raise PlanError(f"{name_of_file}: field {name!r} has the wrong type ({type(v).__name__})")
    return v


def _bytes_field(data: dict, name: str, name_of_file: str, lowest: int = 0) -> int:
    """An integer field of bytes, from `lowest` to below 2**62 (where memplan's arithmetic stays exact)."""
    v = _field(data, name, int, name_of_file)
    if not lowest <= v < MAX_BYTES:
        raise PlanError(f"{name_of_file}: field {name!r} is {short_repr(v)}, outside [{lowest}, 2**62)")
    return v


def _number_field(data: dict, name: str, name_of_file: str) -> float:
    """A finite, non-negative number field (gap, seconds)."""
    v = float(_field(data, name, (int, float), name_of_file))
    if not (math.isfinite(v) and v >= 0):
        raise PlanError(f"{name_of_file}: field {name!r} is {v}, not a finite number of at least 0")
    return v


TraceSource = Trace | Sequence[Trace] | Callable[[], Trace | Sequence[Trace]]


def load_plan(path: str | os.PathLike, traces: TraceSource) -> Plan:
    """Read a memplan-plan/1 file and verify it against the trace it was made for (the one of `traces` with its
    digest; a function gives the trace once the file has parsed, so a replay captures a step only for a readable
    plan). The one way memplan reads a plan file: PlanError names the file and the fault, PlanMismatchError when
    no trace is the plan's."""
    name = os.fspath(path)
    plan = _parse_plan(path)
    given = traces() if callable(traces) else traces
    candidates = [given] if isinstance(given, Trace) else list(given)
    trace = next((t for t in candidates if trace_digest(t) == plan.digest), None)
    if trace is None:
        which = "another trace, not the trace given" if isinstance(given, Trace) else "none of the given traces"
        raise PlanMismatchError(f"{name}: plan was made for {which} (trace digest differs)")
    try:
        check_plan(plan, plan_problem(plan, trace))
    except (PlanError, ProblemError) as e:
        raise PlanError(f"{name}: invalid for its trace: {e}") from None
    return plan


def _parse_plan(path: str | os.PathLike) -> Plan:
    """The fields of a memplan-plan/1 file, checked for type and range (not yet against a trace: load_plan)."""
    name = os.fspath(path)
    data = read_json(path, PlanError)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PlanError(f"{name}: not a {FORMAT} file")
    offsets = _field(data, "offsets", list, name)
    scope = data.get("scope", "all")  # plans written before scopes existed place every buffer
    if scope not in ("all", "step"):
        raise PlanError(f"{name}: scope {short_repr(scope)} is not one of all, step")
    lowest = 0 if scope == "all" else -1
    if not all(type(x) is int and lowest <= x < MAX_BYTES for x in offsets):
        raise PlanError(f"{name}: offsets must be non-negative integers below 2**62 (-1 outside a step plan)")
    status = _field(data, "status", str, name)
    if status not in STATUSES:
        raise PlanError(f"{name}: status {short_repr(status)} is not one of {', '.join(STATUSES)}")
    capacity = data.get("capacity")
    if capacity is not None:
        capacity = _bytes_field(data, "capacity", name)
    return Plan(
        digest=_field(data, "digest", str, name),
        alignment=_bytes_field(data, "alignment", name, lowest=1),
        offsets=offsets,
        arena=_bytes_field(data, "arena", name),
        bound=_bytes_field(data, "bound", name),
        status=status,
        gap=_number_field(data, "gap", name),
        solver=_field(data, "solver", str, name),
        seconds=_number_field(data, "seconds", name),
        capacity=capacity,
        scope=scope,
        bound_source=_field(data, "bound_source", str, name) if "bound_source" in data else "",
    )
