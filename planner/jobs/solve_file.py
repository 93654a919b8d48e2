"""`memplan solve` without the CLI: read a trace or MiniMalloc CSV, solve it, write the verified plan."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from memplan.planner.minimalloc_csv import read_csv, write_csv
from memplan.planner.plan import Plan, write_plan
from memplan.planner.problem import DEFAULT_ALIGNMENT, Problem, ProblemError, problem_from_trace
from memplan.solvers.portfolio import Progress, solve
from memplan.traces.format import load

TRACE_ALIGNMENT, CSV_ALIGNMENT = DEFAULT_ALIGNMENT, 1


@dataclass
class SolveReport:
    """The outcome of solving one input file: the plan and where it was written."""

    source: str
    plan: Plan
    output: str | None

    def summary(self) -> dict:
        p = self.plan
        return {
            "input": self.source,
            "output": self.output,
            "buffers": p.buffers,
            "outside": sum(1 for o in p.offsets if o < 0),
            "scope": p.scope,
            "bound": p.bound,
            "bound_source": p.bound_source,
            "arena": p.arena,
            "ratio": round(p.arena / p.bound, 6) if p.bound else 1.0,
            "status": p.status,
            "gap": round(p.gap, 6),
            "solver": p.solver,
            "seconds": p.seconds,
            "capacity": p.capacity,
            "alignment": p.alignment,
        }


def load_problem(path: str, alignment: int | None = None, scope: str = "all") -> Problem:
    """A Problem from a MiniMalloc CSV (alignment 1 by default) or a memplan trace (alignment 512)."""
    if os.fspath(path).endswith((".csv", ".csv.gz")):
        if scope != "all":
            raise ProblemError(f"--scope {scope}: a MiniMalloc CSV has no training step; plan a trace")
        return read_csv(path, alignment=alignment or CSV_ALIGNMENT)[0]
    return problem_from_trace(load(path), alignment=alignment or TRACE_ALIGNMENT, scope=scope)


def throttled(report: Callable[[str], None], every: float = 0.5) -> Callable[[Progress], None]:
    """A progress callback printing at most one line per `every` seconds, plus each new best arena."""
    last = {"t": -every, "best": None}

    def tell(p: Progress) -> None:
        now = time.monotonic()
        if p.best != last["best"] or now - last["t"] >= every:
            last.update(t=now, best=p.best)
            report(f"best {p.best:,} B  bound {p.bound:,} B  {p.seconds:.1f} s  ({p.solver})")

    return tell


def solve_file(
    path: str,
    output: str | None = None,
    *,
    method: str = "auto",
    time_limit: float = 10.0,
    capacity: int | None = None,
    alignment: int | None = None,
    scope: str = "all",
    progress: Callable[[str], None] | None = None,
) -> SolveReport:
    """Solve one trace or CSV; write the plan (JSON, or CSV with offsets when `output` ends in .csv)."""
    to_csv = output is not None and os.fspath(output).endswith((".csv", ".csv.gz"))
    if to_csv and scope != "all":
        raise ProblemError(f"--scope {scope}: a MiniMalloc CSV cannot leave buffers out; write a .json plan")
    problem = load_problem(path, alignment, scope)
    plan = solve(
        problem,
        method=method,
        time_limit=time_limit,
        capacity=capacity,
        progress=throttled(progress) if progress else None,
    )
    if output is not None:
        if to_csv:  # solve() verified the plan against this problem: writing it does not again
            write_csv(output, problem, plan.offsets)
        else:
            write_plan(plan, output)
    return SolveReport(os.fspath(path), plan, None if output is None else os.fspath(output))
