"""`memplan solve` on generated traces of 10^5 and 10^6 buffers: the wall time of each phase, and of the command.

Usage: .venv/bin/python benchmarks/solve_large.py [--buffers N ...] [--time-limit S]
For each size (default 100,000 and 1,000,000) it writes a step-like trace (tests/large_trace.py: log-normal sizes,
geometric lifetimes, about 200 buffers live), then times `memplan solve TRACE --time-limit S -o PLAN` as a user
runs it (a new process: start-up and imports included), and the same work in this process phase by phase: reading
the trace, building the problem, the solve (what --time-limit bounds: the bound, the greedy placements or the
sweep, the improvement phases), the verifier's check of the plan, and writing the plan. The load average at the
start says how busy the machine was; the command's CPU seconds, what its wall time would be on an idle machine.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from large_trace import step_like, write_trace  # noqa: E402  the generated trace the solver's large tests use

from memplan.planner.plan import write_plan  # noqa: E402
from memplan.planner.problem import problem_from_trace  # noqa: E402
from memplan.solvers import solve  # noqa: E402
from memplan.traces.format import load  # noqa: E402


def command(trace: Path, plan: Path, time_limit: float) -> tuple[float, float]:
    """Wall and CPU seconds of `memplan solve` in a new process (the memplan this script imports, by the same path).
    On a busy machine the CPU seconds say what the wall would be on an idle one (the solve is one thread, but for
    the search's three on problems of at most 5,000 buffers)."""
    code = "import sys; from memplan.cli import main; sys.exit(main())"
    args = [sys.executable, "-c", code, "solve", str(trace), "--time-limit", str(time_limit), "-o", str(plan)]
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    subprocess.run(args, check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.monotonic() - start, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def phases(trace_path: Path, plan_path: Path, time_limit: float) -> str:
    """One table line: the in-process wall time of each phase, the solver and its arena against the bound."""
    t0 = time.monotonic()
    trace = load(trace_path)
    t1 = time.monotonic()
    problem = problem_from_trace(trace)
    t2 = time.monotonic()
    plan = solve(problem, time_limit=time_limit)  # returns the plan after the verifier accepted it
    t3 = time.monotonic()
    write_plan(plan, plan_path)
    t4 = time.monotonic()
    verify = (t3 - t2) - plan.seconds
    return (
        f"{t1 - t0:6.2f} {t2 - t1:7.2f} {plan.seconds:6.2f} {verify:7.2f} {t4 - t3:6.2f} {t4 - t0:6.2f}  "
        f"{plan.solver} {plan.arena / plan.bound:.4f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buffers", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--time-limit", type=float, default=5.0)
    args = parser.parse_args()
    print(f"# load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; --time-limit {args.time_limit:g}")
    print(f"{'buffers':>9} {'write':>6} {'command':>8} {'cpu':>5}  {'read':>6} {'problem':>7} {'solve':>6} "
          f"{'verify':>7} {'write':>6} {'total':>6}  solver arena/bound")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.buffers:
            trace, plan = Path(tmp) / f"{n}.trace.json", Path(tmp) / f"{n}.plan.json"
            start = time.monotonic()
            write_trace(trace, step_like(n))
            written = time.monotonic() - start
            wall, cpu = command(trace, plan, args.time_limit)
            print(f"{n:>9,} {written:6.2f} {wall:8.2f} {cpu:5.2f}  {phases(trace, plan, args.time_limit)}", flush=True)


if __name__ == "__main__":
    main()
