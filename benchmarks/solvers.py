"""Solver figures: for every instance, buffers, bound, arena, arena / bound, status, solver, seconds and
where the bound comes from.

Usage: .venv/bin/python benchmarks/solvers.py DIR_OR_FILE... [--time-limit S] [--method auto|greedy|cpsat]
                                              [--no-capacity] [--bert PRESET --batch B --seq S] [--calibrate]
A CSV named NAME.CAPACITY.csv (MiniMalloc's challenging set) is solved in "fits in CAPACITY" mode unless
--no-capacity; other CSVs and traces are minimised. --bert captures a step of the bundled BERT first.
Every plan is checked by the independent verifier before its row is printed. --calibrate instead prints,
per instance, the rates solvers/budget.py converts seconds with (search and greedy steps, CP-SAT's
deterministic time per second): the budget's constants are set at or below the slowest of them.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from memplan.planner.jobs.solve_file import load_problem
from memplan.planner.verify import verify_plan
from memplan.solvers import CapacityError, solve
from memplan.solvers.bounds import lower_bound
from memplan.solvers.cpsat import cpsat_place
from memplan.solvers.greedy import greedy
from memplan.solvers.search import applicable, search_fit


def instances(args) -> list[Path]:
    out = []
    for item in args:
        path = Path(item)
        if path.is_dir():
            out += sorted(p for p in path.iterdir() if p.suffix == ".csv" or p.name.endswith((".json", ".json.gz")))
        else:
            out.append(path)
    return out


def bert_problem(preset: str, batch: int, seq: int):
    import torch

    from memplan.planner.problem import problem_from_trace
    from memplan.planner.workloads.bert import PRESETS, build_workload
    from memplan.traces.capture import capture_step

    torch.set_num_threads(1)
    t = time.monotonic()
    trace = capture_step(lambda: build_workload(batch, seq, config=PRESETS[preset]))
    print(
        f"# captured bert-{preset} batch {batch} seq {seq}: {len(trace)} buffers in {time.monotonic() - t:.1f} s",
        flush=True,
    )
    return problem_from_trace(trace)


def row(name: str, problem, capacity, args) -> None:
    t = time.monotonic()
    try:
        plan = solve(problem, method=args.method, time_limit=args.time_limit, capacity=capacity)
    except CapacityError as e:
        print(f"{name:28s} {len(problem):7d}  {'-':>15s}  FAILED: {e}  {time.monotonic() - t:7.2f}", flush=True)
        return
    verify_plan(problem, plan.offsets, plan.arena, plan.capacity)
    status = plan.status if plan.status == "optimal" else f"feasible (gap {100 * plan.gap:.3g}%)"
    fits = "" if capacity is None else ("  fits" if plan.arena <= capacity else "  OVER")
    print(
        f"{name:28s} {len(problem):7d}  {plan.bound:15,d}  {plan.arena:15,d}  {plan.arena / plan.bound:9.5f}  "
        f"{status:24s} {plan.solver:32s} {time.monotonic() - t:7.2f}{fits}  {plan.bound_source}",
        flush=True,
    )


def calibrate(name: str, problem) -> None:
    """Steps and deterministic time per wall second of each method on this instance, with nothing alongside."""
    bound, rates = lower_bound(problem), []
    t = time.monotonic()
    first = greedy(problem)
    rates.append(f"greedy {first.work / (time.monotonic() - t):9.3g} steps/s")
    if applicable(problem):
        t = time.monotonic()
        result = search_fit(problem, bound, 10**15, 2.0)
        rates.append(f"search {result.work / (time.monotonic() - t):9.3g} steps/s ({result.status})")
    t = time.monotonic()
    res = cpsat_place(problem, bound, 60.0, hint=first.offsets, deterministic_time=0.5)
    rates.append(f"cpsat {res.work / (time.monotonic() - t):6.3f} /s ({res.status})")
    print(f"{name:28s} {len(problem):7d}  " + "  ".join(rates), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*")
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--method", default="auto", choices=["auto", "greedy", "cpsat"])
    ap.add_argument("--no-capacity", action="store_true", help="minimise even NAME.CAPACITY.csv instances")
    ap.add_argument("--bert", choices=["tiny", "base", "large"], help="also capture and solve a bundled BERT step")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--calibrate", action="store_true", help="print each method's work rate instead of solving")
    args = ap.parse_args()
    if args.calibrate:
        for path in instances(args.paths):
            calibrate(path.name, load_problem(str(path)))
        return
    print(
        f"{'instance':28s} {'buffers':>7s}  {'bound':>15s}  {'arena':>15s}  {'arena/bnd':>9s}  "
        f"{'status':24s} {'solver':32s} {'seconds':>7s}  bound from"
    )
    for path in instances(args.paths):
        m = re.fullmatch(r".*\.(\d+)\.csv", path.name)
        capacity = int(m.group(1)) if m and not args.no_capacity else None
        row(path.name, load_problem(str(path)), capacity, args)
    if args.bert:
        row(f"bert-{args.bert} b{args.batch} s{args.seq}", bert_problem(args.bert, args.batch, args.seq), None, args)


if __name__ == "__main__":
    main()
