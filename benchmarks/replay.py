"""Step time with PyTorch's default CPU allocator against the plan allocator, per bundled workload.

For each workload: capture one step, solve a plan, then on one workload alternate rounds of
`--steps` steps with the default allocator and `--steps` steps with the plan allocator (installed for
the round, the resident storages adopted into its arena first; later default rounds run on them where
the last plan put them), and print the median step time of each, their ratio (target <= 1.05), the
arena against the plan's lower bound and the trace's max-live bytes, the measured peak (arena top +
fallback + outside), the bytes adoption left outside the arena, and the fallbacks.

Example: .venv/bin/python benchmarks/replay.py --batch 4 --seq 64 --steps 10 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
from contextlib import nullcontext
from pathlib import Path

import torch

from memplan.planner.problem import problem_from_trace
from memplan.planner.replay.adoption import adopt_resident
from memplan.planner.replay.cpu_session import CPUPlanAllocator
from memplan.planner.replay.fingerprint import RunPrints
from memplan.planner.replay.runner import run_steps, warm_up
from memplan.planner.replay.schedule import schedule_from
from memplan.solvers import solve
from memplan.step import StepSpec
from memplan.traces.capture import capture_step
from memplan.traces.inputs.model_file import load_workload

ROOT = Path(__file__).resolve().parents[1]


def bench(model: str, args) -> dict:
    os.environ["MEMPLAN_PRESET"] = args.preset

    def make():
        return load_workload(StepSpec(ROOT / "examples" / f"{model}.py", batch=args.batch, seq=args.seq))

    trace = capture_step(make)
    plan = solve(problem_from_trace(trace), method=args.method, time_limit=args.time_limit)
    schedule = schedule_from(plan, trace)
    workload = make()
    warm_up(workload)
    default_s, plan_s = [], []
    fallbacks = fallback_bytes = peak = outside = 0
    adopted = sum(schedule.reserved_sizes)
    for _ in range(args.rounds):
        default_s += run_steps(workload, args.steps, nullcontext, RunPrints())
        with CPUPlanAllocator(schedule) as alloc:
            left_outside = adopt_resident(workload, alloc, "cpu")
            plan_s += run_steps(workload, args.steps, alloc.step, RunPrints())
        stats = alloc.stats()
        fallbacks += stats["fallback_count"]
        fallback_bytes += stats["fallback_bytes"]
        peak = max(peak, stats["held_peak"] + left_outside)
        outside = max(outside, left_outside)
        adopted = min(adopted, stats["adopted_bytes"])
    d, p = statistics.median(default_s), statistics.median(plan_s)
    return {
        "workload": f"{workload.name} b{args.batch} s{args.seq}",
        "default_ms": 1e3 * d,
        "plan_ms": 1e3 * p,
        "ratio": p / d,
        "arena": plan.arena,
        "max_live": trace.peak()[0],
        "bound": plan.bound,
        "measured_peak": peak,
        "outside": outside,
        "fallbacks": fallbacks,
        "fallback_bytes": fallback_bytes,
        "planned_per_step": len(schedule),
        "adopted": adopted,
        "reserved": sum(schedule.reserved_sizes),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bert,gpt2", help="comma-separated bundled model files (examples/NAME.py)")
    ap.add_argument("--preset", default="tiny", help="MEMPLAN_PRESET of the model files")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10, help="steps per round and allocator")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--method", default="auto", help="solver method")
    ap.add_argument("--time-limit", type=float, default=10.0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"{'workload':<22} {'default ms':>10} {'plan ms':>9} {'ratio':>6} {'arena B':>11} {'bound B':>11} "
        f"{'max-live B':>11} {'peak B':>11} {'fallbacks':>9}"
    )
    for model in args.models.split(","):
        r = bench(model, args)
        print(
            f"{r['workload']:<22} {r['default_ms']:>10.2f} {r['plan_ms']:>9.2f} {r['ratio']:>6.3f} "
            f"{r['arena']:>11} {r['bound']:>11} {r['max_live']:>11} {r['measured_peak']:>11} {r['fallbacks']:>9}",
            flush=True,
        )
        print(
            f"  arena/bound {r['arena'] / r['bound']:.4f}, arena/max-live {r['arena'] / r['max_live']:.4f} "
            f"(bound: sizes rounded to the plan's alignment; max-live: requested sizes), planned allocations per step "
            f"{r['planned_per_step']}, fallback bytes {r['fallback_bytes']}; adopted {r['adopted']} of "
            f"{r['reserved']} reserved B, {r['outside']} B left outside the arena",
            flush=True,
        )


if __name__ == "__main__":
    main()
