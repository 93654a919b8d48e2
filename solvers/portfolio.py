"""The `auto` portfolio and the single-method entry points, all returning a planner.plan.Plan.

auto, in steps: greedy orders first; at the bound (or within the capacity) the solve stops. Otherwise, on
one stream without groups or fixed offsets (and at most SEARCH_MAX_BUFFERS buffers), the exact canonical
search decides "fits at the capacity?", or minimises: a probe at the bound, then rounds, each with twice the
work per probe, of a bisection pass between the bound and the best arena and a descent that restarts the
search from the bottom of the best placement one unit below its arena; on other problems a squeaky-wheel
loop re-runs the best greedy order with the buffers that end above the bound moved earlier. CP-SAT then
minimises (or decides the capacity) with the rest of the budget, hinted with the best plan so far, when its
model is small enough to help. Before the search, the exact search on time windows tries to prove a bound
above max-live (solvers/window_bound.py). No method gets more than its share: the window bound BOUND_SHARE,
the search SEARCH_SHARE of what is left (CAPACITY_SEARCH_SHARE when deciding a capacity), CP-SAT the rest.
Every share is deterministic work (solvers/budget.py); the time limit is a ceiling. The bound says how it
was proven: a cheap bound, or the search or CP-SAT proving no placement (of a window's buffers, or of all).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from memplan.errors import MemplanError
from memplan.planner.plan import Plan, check_plan
from memplan.planner.problem import OUTSIDE, Problem
from memplan.solvers.bounds import Bound, cheap_bound
from memplan.solvers.budget import Budget
from memplan.solvers.cpsat import MAX_TERMS, cpsat_place, model_terms
from memplan.solvers.greedy import greedy, squeaky_wheel
from memplan.solvers.search import FITS, HEURISTICS, INFEASIBLE, applicable, search_fit
from memplan.solvers.window_bound import window_bound

METHODS = ("auto", "greedy", "cpsat")
SEARCH_MAX_BUFFERS = 5000  # the exact search is hopeless beyond this (MiniMalloc-style DFS)
SEARCH_SHARE = 0.9  # when minimising, the share of the budget the search (or squeaky wheel) may use
CAPACITY_SEARCH_SHARE = 0.5  # when deciding a capacity, the search's share; CP-SAT has the rest
BOUND_SHARE = 0.1  # before the search, the share for proving a bound above max-live on time windows
FIRST_PROBE_SHARE = 0.25  # of the search's share, what the probe at the bound may use
PROBE_SHARE = 1 / 32  # of the search's share, what each probe of the first bisection pass may use
DESCENT_PROBE_SHARE = 1 / 64  # of the search's share, what each probe of the first descent may use
DESCENT_LEVELS = tuple(level / 20 for level in range(19, 0, -1))  # 95%, 90%, ..., 5% of the best arena
RESOLUTION = 1 / 4096  # bisection stops short of the best arena by less than this fraction of it


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

    def __init__(self, p: Problem, bound: Bound, start: float, report: Callable | None):
        self.p, self.start, self.report = p, start, report
        self.bound, self.bound_source = bound.value, bound.source
        self.offsets: np.ndarray | None = None
        self.arena: int | None = None
        self.solver = ""

    def offer(self, offsets: np.ndarray, arena: int, solver: str) -> None:
        """Keep this placement if it beats the best so far, and report progress either way."""
        if self.arena is None or arena < self.arena:
            self.offsets, self.arena, self.solver = offsets, arena, solver
        self.tell(solver)

    def raise_bound(self, value: int, source: str) -> None:
        """Keep a proven bound if it beats the best so far."""
        if value > self.bound:
            self.bound, self.bound_source = value, source
            self.tell(source)

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
            offsets=offsets.tolist(),
            arena=arena,
            bound=bound,
            status="optimal" if arena == bound else "feasible",
            gap=(arena / bound - 1.0) if bound else 0.0,
            solver=self.solver,
            seconds=round(self.elapsed(), 3),
            capacity=capacity,
            scope=self.p.scope,
            bound_source=self.bound_source,
        )


def _search_at(
    best: _Best, budget: Budget, target: int, seconds: float, unit: int = 1, prefix: np.ndarray | None = None
) -> str:
    """Run the exact search at one target with `seconds` of work, after `prefix` if one is given; record a
    placement, or a proof when there is no prefix. Returns its status (FITS, INFEASIBLE, or TIMEOUT when the
    work or the ceiling ran out). Every arena is a multiple of `unit` (canonical placements stack whole
    buffers), so a proof at `target` proves the next multiple."""
    steps = budget.search_steps(min(seconds, budget.seconds), len(HEURISTICS))
    result = search_fit(best.p, target, steps, budget.wall_left(), prefix)
    budget.spend_search(result.work)
    if result.status == FITS:
        arena = int((result.offsets + best.p.size)[best.p.size > 0].max(initial=0))
        best.offer(result.offsets, arena, "search")
    elif result.status == INFEASIBLE and prefix is None:
        best.raise_bound(-(-(target + 1) // unit) * unit, f"search: no placement fits in {target:,} B")
    return result.status


def _prove_bound(best: _Best, budget: Budget, share: float) -> None:
    """Try to prove a bound above the best one on time windows' buffers, in `share` seconds of work."""
    threads = len(HEURISTICS)
    result = window_bound(best.p, best.bound, budget.search_steps(share, threads), budget.wall_left())
    budget.spend_search(result.work * threads)
    if result.bound is not None:
        best.raise_bound(result.bound.value, result.bound.source)


def _search_down(best: _Best, budget: Budget, share: float) -> None:
    """Minimise with the search in `share` seconds of work: the bound first, then rounds of a bisection pass
    and a descent, each round with twice the work per probe of the one before."""
    floor = budget.seconds - share  # the work that must be left for the others
    if best.arena <= best.bound:
        return
    sizes = best.p.size[best.p.active]
    unit = int(np.gcd.reduce(sizes)) if len(sizes) else 1
    first_probe = FIRST_PROBE_SHARE * share
    if _search_at(best, budget, best.bound, first_probe, unit) == FITS:
        return
    probe, descent_probe, whole = PROBE_SHARE * share, DESCENT_PROBE_SHARE * share, True
    while best.arena > best.bound and not budget.exhausted(floor):
        arena = best.arena
        _bisect(best, budget, probe, floor, unit, whole)
        if whole and best.arena == arena:
            # Nothing fits between the bound and the best arena at the first pass's work: the targets above
            # the bound are no easier than the bound itself, whose tight capacity prunes hardest (memplan's own
            # traces: the greedy within 1% of max-live, and max-live reachable), so the bound gets twice the
            # first probe's work instead of a descent from a placement the search could not improve.
            if _search_at(best, budget, best.bound, min(2 * first_probe, budget.seconds - floor), unit) == FITS:
                return
        _descend(best, budget, descent_probe, floor, unit)
        probe, descent_probe, whole = 2 * probe, 2 * descent_probe, False


def _bisect(best: _Best, budget: Budget, probe: float, floor: float, unit: int, whole: bool) -> None:
    """One pass of bisection between the bound and the best arena over multiples of `unit`, `probe` seconds
    of work per target; a target that is proven infeasible or runs out of work sends the pass higher. Unless
    `whole`, the pass ends at its first placement: the descent improves on it for less work than the
    targets just below it, which mostly run out of work."""
    low = best.bound
    while low < best.arena and not budget.exhausted(floor):
        target = (low + best.arena - 1) // 2 // unit * unit
        if target < low or best.arena - target < best.arena * RESOLUTION:
            return
        if _search_at(best, budget, target, min(probe, budget.seconds - floor), unit) == FITS:
            if not whole:
                return
        else:
            low = max(target + 1, best.bound)


def _descend(best: _Best, budget: Budget, probe: float, floor: float, unit: int) -> None:
    """Large-neighbourhood descent: restart the search one unit below the best arena from the bottom of the
    best placement (its buffers below a level, in their order, dropped as low as they go), for each level of
    DESCENT_LEVELS that keeps a different number of buffers, `probe` seconds of work each; rounds over the
    levels go on while one of them improves. The search rebuilds the top of a placement the bisection found,
    which its own backtracking rarely reaches: at --time-limit 10 this took MiniMalloc's D from 1,039,360
    to 1,025,024 and J from 1,044,480 to 1,033,216."""
    active = np.nonzero(best.p.active)[0]
    improved = True
    while improved and best.arena > best.bound and not budget.exhausted(floor):
        improved = False
        by_offset = active[np.argsort(best.offsets[active], kind="stable")]
        target = max(best.arena - unit, best.bound)
        kept = {len(by_offset)}  # keeping every buffer leaves nothing to search
        for level in DESCENT_LEVELS:
            prefix = by_offset[best.offsets[by_offset] < level * best.arena]
            if len(prefix) in kept:
                continue
            kept.add(len(prefix))
            if _search_at(best, budget, target, min(probe, budget.seconds - floor), unit, prefix) == FITS:
                improved = True
                break
            if budget.exhausted(floor):
                return


def solve(
    problem: Problem,
    method: str = "auto",
    time_limit: float = 10.0,
    capacity: int | None = None,
    progress: Callable[[Progress], None] | None = None,
) -> Plan:
    """Place every buffer of `problem`; with `capacity`, stop at the first plan that fits (error if none).
    The answer depends on the work `time_limit` buys, not on the machine's load (solvers/budget.py).
    The plan returned has passed the independent verifier."""
    if method not in METHODS:
        raise MemplanError(f"unknown method {method!r} (expected one of {', '.join(METHODS)})")
    start = time.monotonic()
    p = problem
    budget = Budget.for_time_limit(time_limit, start)

    # 1. The cheap bound; with a capacity below it there is nothing to search.
    bound = cheap_bound(p)
    if capacity is not None and bound.value > capacity:
        raise CapacityError(
            f"cannot fit in {capacity} bytes: the lower bound is {bound.value} bytes ({bound.source})", proven=True
        )
    best = _Best(p, bound, start, progress)

    def goal() -> int:
        """What the solve stops at: the capacity, or the best bound so far."""
        return capacity if capacity is not None else best.bound

    # 2. Greedy orders, stopping at the goal or when the work is spent (the first placement cut short is
    #    finished by the sweep); the wall ceiling applies at half the time limit, the first placement's at
    #    the time limit (without it there is no plan).
    work = budget.greedy_steps(budget.seconds)
    first = greedy(p, stop_at=goal(), deadline=start + time_limit / 2, work=work, first_deadline=budget.deadline)
    budget.spend_greedy(first.work)
    best.offer(first.offsets, first.arena, first.name)
    if method == "greedy" or best.arena <= goal():
        return _finish(best, capacity)

    # 3. On one stream, a bound past max-live from time windows; then the search (or, on other problems,
    #    the squeaky wheel) in its share of the work.
    model_fits = model_terms(p) <= MAX_TERMS
    if method == "auto":
        searchable = applicable(p) and int(p.active.sum()) <= SEARCH_MAX_BUFFERS
        if searchable:
            _prove_bound(best, budget, BOUND_SHARE * budget.seconds)
        share = (CAPACITY_SEARCH_SHARE if capacity is not None else SEARCH_SHARE) * budget.seconds
        if not model_fits:
            share = budget.seconds
        if searchable and capacity is not None:
            if best.bound <= capacity:
                _search_at(best, budget, capacity, share)
        elif searchable:
            _search_down(best, budget, share)
        else:
            improved = squeaky_wheel(p, first, goal(), budget.greedy_steps(share), budget.deadline)
            budget.spend_greedy(improved.work)
            best.offer(improved.offsets, improved.arena, "greedy+squeaky-wheel")
    if capacity is not None and best.bound > capacity:
        raise CapacityError(
            f"cannot fit in {capacity} bytes: no placement exists "
            f"({best.bound_source}; lower bound {best.bound} bytes)",
            proven=True,
        )

    # 4. CP-SAT with the rest of the work, hinted with the best plan so far.
    if not model_fits:
        best.tell("cpsat skipped: model too large")
    elif best.arena > goal() and budget.seconds > 0 and budget.wall_left() > 0.05:
        res = cpsat_place(
            p,
            best.bound,
            budget.wall_left(),
            hint=best.offsets,
            capacity=capacity,
            on_solution=lambda a: best.tell("cpsat", a),
            deterministic_time=budget.cpsat_time(budget.seconds),
        )
        budget.spend_cpsat(res.work)
        if res.offsets is not None:
            best.offer(res.offsets, res.arena, "cpsat")
        if res.status == "infeasible" and capacity is not None:
            raise CapacityError(
                f"cannot fit in {capacity} bytes: no placement exists "
                f"(proven by CP-SAT; lower bound {best.bound} bytes)",
                proven=True,
            )
        if res.status in ("optimal", "feasible"):
            best.raise_bound(res.bound, f"CP-SAT: no placement below {res.bound:,} B")
    return _finish(best, capacity)


def _finish(best: _Best, capacity: int | None) -> Plan:
    """The best plan, verified; CapacityError when it does not fit the capacity."""
    if capacity is not None and best.arena > capacity:
        raise CapacityError(
            f"no plan within {capacity} bytes found in {best.elapsed():.1f} s "
            f"(best {best.arena} bytes, lower bound {best.bound} bytes)",
            proven=False,
        )
    plan = best.plan(capacity)
    check_plan(plan, best.p)  # no plan leaves here unchecked (its figures too), printed or written
    return plan
