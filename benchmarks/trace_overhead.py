"""Overhead of tracing: median time of a plain training step and of a traced one on the bundled BERT,
and their ratios (target: traced / plain <= 3).

Usage: .venv/bin/python benchmarks/trace_overhead.py [--preset tiny] [--batch 2] [--seq 128] [--repeats 15]
Two traced figures: the step run under tracing (profiler memory events + memplan's marks), and the
whole `capture_step(workload, warmup=False)`, which also reads the event tree and builds the labelled trace.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from planner.workloads.bert import PRESETS, build_workload
from traces.capture import capture_step
from traces.step_marks import marked_step


def median_seconds(fns: dict, repeats: int) -> dict[str, tuple[float, float]]:
    """Median wall-clock and process-CPU seconds of each function, run interleaved so that load from
    other processes hits every variant alike (CPU time is the steadier figure on a shared machine)."""
    wall: dict[str, list[float]] = {k: [] for k in fns}
    cpu: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in fns}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    workload = build_workload(args.batch, args.seq, config=PRESETS[args.preset])
    for _ in range(3):
        workload.step()

    def profiled_step():
        with marked_step(workload), profile(activities=[ProfilerActivity.CPU], profile_memory=True):
            workload.step()

    timings = median_seconds({"plain step": workload.step,
                              "step under tracing": profiled_step,
                              "capture_step (step + trace)": lambda: capture_step(workload, warmup=False)},
                             args.repeats)
    trace = capture_step(workload, warmup=False)
    print(f"bert preset {args.preset}, batch {args.batch}, seq {args.seq}, {args.threads} thread(s), "
          f"median of {args.repeats}; {len(trace.recorded)} allocations per step")
    print(f"{'':34} {'wall ms':>9} {'ratio':>6}   {'cpu ms':>9} {'ratio':>6}")
    plain = timings["plain step"]
    for label, (wall, cpu) in timings.items():
        print(f"{label:34} {wall * 1e3:9.2f} {wall / plain[0]:6.2f}   {cpu * 1e3:9.2f} {cpu / plain[1]:6.2f}")
    for label in ("step under tracing", "capture_step (step + trace)"):
        wall, cpu = timings[label]
        print(f"{label} / plain: {wall / plain[0]:.2f} wall, {cpu / plain[1]:.2f} cpu (target <= 3)")


if __name__ == "__main__":
    main()
