"""`memplan solve` on generated traces of 10^5 and 10^6 buffers: the wall time of each phase, and of the command.

Usage: .venv/bin/python benchmarks/solve_large.py [--buffers N ...] [--time-limit S]
For each size (default 100,000 and 1,000,000) it writes a step-like trace (tests/large_trace.py: log-normal sizes,
geometric lifetimes, about 200 buffers live), then times `memplan solve TRACE --time-limit S -o PLAN` as a user
runs it (a new process: start-up and imports included), and the same work in this process phase by phase: reading
the trace, building the problem, the solve (what --time-limit bounds: the bound, the greedy placements or the
sweep, the improvement phases), the verifier's check of the plan, and writing the plan. The load average at the
start says how busy the machine was; the CPU seconds under the wall ones, about what the wall would be on an idle
machine (the solve is one thread, but for the search's three on problems of at most 5,000 buffers).
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

from memplan.planner.plan import check_plan, write_plan  # noqa: E402
from memplan.planner.problem import problem_from_trace  # noqa: E402
from memplan.solvers import solve  # noqa: E402
from memplan.traces.format import load  # noqa: E402


def command(trace: Path, plan: Path, time_limit: float) -> tuple[float, float]:
    """Wall and CPU seconds of `memplan solve` in a new process (the memplan this script imports, by the same path)."""
    code = "import sys; from memplan.cli import main; sys.exit(main())"
    args = [sys.executable, "-c", code, "solve", str(trace), "--time-limit", str(time_limit), "-o", str(plan)]
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    subprocess.run(args, check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.monotonic() - start, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def phases(trace_path: Path, plan_path: Path, time_limit: float) -> tuple[list[float], list[float], str]:
    """The wall and CPU seconds of each phase in this process (read, problem, solve, verify, write, total), and
    the solver with its arena against the bound. solve() ends with the verifier's check of its plan: the check is
    timed again on its own and taken off the solve's time."""
    clocks = [(time.monotonic(), time.process_time())]
    trace = load(trace_path)
    clocks.append((time.monotonic(), time.process_time()))
    problem = problem_from_trace(trace)
    clocks.append((time.monotonic(), time.process_time()))
    plan = solve(problem, time_limit=time_limit)  # returns the plan after the verifier accepted it
    clocks.append((time.monotonic(), time.process_time()))
    write_plan(plan, plan_path)
    clocks.append((time.monotonic(), time.process_time()))
    check_plan(plan, problem)
    clocks.append((time.monotonic(), time.process_time()))
    rows = []
    for k in (0, 1):  # wall, then CPU
        read, build, solving, writing, check = (clocks[i + 1][k] - clocks[i][k] for i in range(5))
        rows.append([read, build, solving - check, check, writing, clocks[4][k] - clocks[0][k]])
    return rows[0], rows[1], f"{plan.solver} {plan.arena / plan.bound:.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buffers", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--time-limit", type=float, default=5.0)
    args = parser.parse_args()
    print(f"# load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; --time-limit {args.time_limit:g}")
    print(f"{'buffers':>9} {'':>5} {'write':>6} {'command':>8}  {'read':>6} {'problem':>7} {'solve':>6} "
          f"{'verify':>7} {'write':>6} {'total':>6}  solver arena/bound")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.buffers:
            trace, plan = Path(tmp) / f"{n}.trace.json", Path(tmp) / f"{n}.plan.json"
            start = time.monotonic()
            write_trace(trace, step_like(n))
            written = time.monotonic() - start
            wall, cpu = command(trace, plan, args.time_limit)
            walls, cpus, answer = phases(trace, plan, args.time_limit)
            print(f"{n:>9,} {'wall':>5} {written:6.2f} {wall:8.2f}  " + " ".join(f"{x:6.2f}" for x in walls), answer)
            print(f"{'':>9} {'cpu':>5} {'':>6} {cpu:8.2f}  " + " ".join(f"{x:6.2f}" for x in cpus), flush=True)


if __name__ == "__main__":
    main()
