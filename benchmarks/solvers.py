"""Solver figures: for every instance, buffers, bound, arena, arena / bound, status, solver and seconds.

Usage: .venv/bin/python benchmarks/solvers.py DIR_OR_FILE... [--time-limit S] [--method auto|greedy|cpsat]
                                              [--no-capacity] [--bert PRESET --batch B --seq S]
A CSV named NAME.CAPACITY.csv (MiniMalloc's challenging set) is solved in "fits in CAPACITY" mode unless
--no-capacity; other CSVs and traces are minimised. --bert captures a step of the bundled BERT first.
Every plan is checked by the independent verifier before its row is printed.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from memplan.planner.jobs.solve_file import load_problem
from memplan.planner.verify import verify_plan
from memplan.solvers import CapacityError, solve


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
        f"{status:24s} {plan.solver:32s} {time.monotonic() - t:7.2f}{fits}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*")
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--method", default="auto", choices=["auto", "greedy", "cpsat"])
    ap.add_argument("--no-capacity", action="store_true", help="minimise even NAME.CAPACITY.csv instances")
    ap.add_argument("--bert", choices=["tiny", "base", "large"], help="also capture and solve a bundled BERT step")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args()
    print(
        f"{'instance':28s} {'buffers':>7s}  {'bound':>15s}  {'arena':>15s}  {'arena/bnd':>9s}  "
        f"{'status':24s} {'solver':32s} {'seconds':>7s}"
    )
    for path in instances(args.paths):
        m = re.fullmatch(r".*\.(\d+)\.csv", path.name)
        capacity = int(m.group(1)) if m and not args.no_capacity else None
        row(path.name, load_problem(str(path)), capacity, args)
    if args.bert:
        row(f"bert-{args.bert} b{args.batch} s{args.seq}", bert_problem(args.bert, args.batch, args.seq), None, args)


if __name__ == "__main__":
    main()
