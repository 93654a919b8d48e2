"""The `auto` portfolio and the single-method entry points, all returning a planner.plan.Plan.

auto: greedy orders first; at the bound (or within the capacity) the search stops. Otherwise, on one stream
without groups or fixed offsets (and at most SEARCH_MAX_BUFFERS buffers), the exact canonical search
decides "fits at the capacity?", or bisects between the bound and the best arena; on other problems a
squeaky-wheel loop re-runs the best greedy order with the buffers that end above the bound moved earlier.
CP-SAT then minimises (or decides the capacity) in the rest of the time, hinted with the best plan so far,
when its model is small enough to help.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from memplan.planner.plan import Plan
from memplan.planner.problem import OUTSIDE, Problem
from memplan.planner.verify import verify_plan
from memplan.solvers.bounds import lower_bound
from memplan.solvers.cpsat import MAX_TERMS, cpsat_place, model_terms
from memplan.solvers.greedy import greedy, squeaky_wheel
from memplan.solvers.search import FITS, INFEASIBLE, applicable, search_fit
from memplan.traces.errors import MemplanError

METHODS = ("auto", "greedy", "cpsat")
SEARCH_MAX_BUFFERS = 5000  # the exact search is hopeless beyond this (MiniMalloc-style DFS)
SEARCH_SHARE = 0.7  # when minimising, the fraction of the time limit the exact search may use


class CapacityError(MemplanError):
    """The problem cannot be placed within the requested capacity (`proven`), or no such plan was found in time."""

    def __init__(self, message: str, proven: bool):
        super().__init__(message)
        self.proven = proven


@dataclass
class Progress:
    """One progress report: best arena so far, best lower bound, seconds since the start, and by whom."""

    best: int
    bound: int
    seconds: float
    solver: str


class _Best:
    """The best placement so far and the best proven bound, reported to the progress callback."""

    def __init__(self, p: Problem, bound: int, start: float, report: Callable | None):
        self.p, self.bound, self.start, self.report = p, bound, start, report
        self.offsets: np.ndarray | None = None
        self.arena: int | None = None
        self.solver = ""

    def offer(self, offsets: np.ndarray, arena: int, solver: str) -> None:
        """Keep this placement if it beats the best so far, and report progress either way."""
        if self.arena is None or arena < self.arena:
            self.offsets, self.arena, self.solver = offsets, arena, solver
        self.tell(solver)

    def tell(self, solver: str, arena: int | None = None) -> None:
        """Report progress; `arena` is a solver's improvement not yet offered as a placement (CP-SAT's)."""
        if self.report is not None:
            best = self.arena if arena is None else min(arena, self.arena or arena)
            self.report(Progress(best, self.bound, time.monotonic() - self.start, solver))

    def elapsed(self) -> float:
        """Seconds since the solve started."""
        return time.monotonic() - self.start

    def plan(self, capacity: int | None) -> Plan:
        """The best placement as a Plan, buffers outside the scope marked OUTSIDE."""
        arena, bound = int(self.arena), int(min(self.bound, self.arena))
        offsets = np.where(self.p.outside, OUTSIDE, self.offsets)
        return Plan(
            digest=self.p.digest,
            alignment=self.p.alignment,
            offsets=[int(x) for x in offsets],
            arena=arena,
            bound=bound,
            status="optimal" if arena == bound else "feasible",
            gap=(arena / bound - 1.0) if bound else 0.0,
            solver=self.solver,
            seconds=round(self.elapsed(), 3),
            capacity=capacity,
            scope=self.p.scope,
        )


def _search_at(best: _Best, target: int, seconds: float, capacity: int | None) -> str:
    """Run the exact search at one target; record a placement or a proof. Returns its status."""
    status, offs, _ = search_fit(best.p, target, max(seconds, 0.0))
    if status == FITS:
        best.offer(offs, int((offs + best.p.size)[best.p.size > 0].max(initial=0)), "search")
    elif status == INFEASIBLE:
        if capacity is not None:
            raise CapacityError(
                f"cannot fit in {capacity} bytes: no placement exists "
                f"(proven by search; lower bound {best.bound} bytes)",
                proven=True,
            )
        best.bound = max(best.bound, target + 1)
        best.tell("search")
    return status


def _search_down(best: _Best, deadline: float) -> None:
    """Minimise with the search: the bound first, then bisect between the bound and the best arena."""
    if _search_at(best, best.bound, (deadline - time.monotonic()) / 3, None) == FITS:
        return
    low = best.bound
    while best.arena > best.bound and time.monotonic() < deadline - 0.05:
        target = (low + best.arena - 1) // 2
        if target < low:
            break
        status = _search_at(best, target, max((deadline - time.monotonic()) / 3, 0.05), None)
        if status != FITS:
            low = target + 1  # proven (infeasible) or given up (timeout): look higher


def solve(
    problem: Problem,
    method: str = "auto",
    time_limit: float = 10.0,
    capacity: int | None = None,
    progress: Callable[[Progress], None] | None = None,
) -> Plan:
    """Place every buffer of `problem`; with `capacity`, stop at the first plan that fits (error if none).
    The plan returned has passed the independent verifier."""
    if method not in METHODS:
        raise MemplanError(f"unknown method {method!r} (expected one of {', '.join(METHODS)})")
    start = time.monotonic()
    p = problem
    bound = lower_bound(p)
    if capacity is not None and bound > capacity:
        raise CapacityError(f"cannot fit in {capacity} bytes: the lower bound is {bound} bytes", proven=True)
    best = _Best(p, bound, start, progress)
    goal = capacity if capacity is not None else bound
    first = greedy(p, stop_at=goal, deadline=start + time_limit / 2)
    best.offer(first.offsets, first.arena, first.name)
    if method != "greedy" and best.arena > goal:
        model_fits = model_terms(p) <= MAX_TERMS
        if method == "auto" and applicable(p) and int(p.active.sum()) <= SEARCH_MAX_BUFFERS:
            if capacity is not None:
                _search_at(best, capacity, time_limit - best.elapsed(), capacity)
            else:
                _search_down(best, start + SEARCH_SHARE * time_limit)
        elif method == "auto":
            until = start + (SEARCH_SHARE if model_fits else 1.0) * time_limit
            offsets, arena = squeaky_wheel(p, first, goal, until)
            best.offer(offsets, arena, "greedy+squeaky-wheel")
        if not model_fits:
            best.tell("cpsat skipped: model too large")
        left = time_limit - best.elapsed()
        goal = capacity if capacity is not None else best.bound
        if best.arena > goal and left > 0.05 and model_fits:
            res = cpsat_place(
                p, best.bound, left, hint=best.offsets, capacity=capacity, on_solution=lambda a: best.tell("cpsat", a)
            )
            if res.offsets is not None:
                best.offer(res.offsets, res.arena, "cpsat")
            if res.status == "infeasible" and capacity is not None:
                raise CapacityError(
                    f"cannot fit in {capacity} bytes: no placement exists "
                    f"(proven by CP-SAT; lower bound {bound} bytes)",
                    proven=True,
                )
            if res.status in ("optimal", "feasible"):
                best.bound = max(best.bound, res.bound)
    if capacity is not None and best.arena > capacity:
        raise CapacityError(
            f"no plan within {capacity} bytes found in {best.elapsed():.1f} s "
            f"(best {best.arena} bytes, lower bound {best.bound} bytes)",
            proven=False,
        )
    plan = best.plan(capacity)
    verify_plan(p, plan.offsets, plan.arena, capacity)  # no plan leaves here unchecked, printed or written
    return plan
