"""Overhead of tracing: median time of a plain training step and of a recorded one on the bundled BERT,
and their ratios (target: recorded / plain <= 3); then a fake trace of the 7B Llama shape, its wall time
and peak memory (target: at most 2 minutes and 4 GiB); and the 8 fake ranks of GPT-2 medium with tensor
and sequence parallelism (`memplan trace --nproc 8 --fake`).

Usage: .venv/bin/python benchmarks/trace_overhead.py [--preset tiny] [--batch 2] [--seq 128] [--repeats 15]
Two real figures: the step under the step recorder (its memory reports, op callbacks and memplan's marks)
against a plain step, and a whole `capture_step` (build, warm-up, recorded step, labelled trace) against
building the workload and running two plain steps. The fake trace runs in a child process, so its peak
resident memory is its own: HF LlamaForCausalLM at the 7B shape, bf16, batch 1, sequence 2048.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from memplan.planner.workloads.bert import PRESETS, build_workload
from memplan.traces.capture import capture_step
from memplan.traces.recorder import recording
from memplan.traces.step_marks import marked_step

ROOT = Path(__file__).resolve().parents[1]

FAKE_7B = """
import json, os, resource, time, torch
torch.set_num_threads(1)
os.environ["MEMPLAN_PRESET"] = "7b"
from memplan.step import StepSpec
from memplan.traces.inputs.trace_model import trace_step
start = time.perf_counter()
trace = trace_step(StepSpec("examples/hf_llama.py", batch=1, seq=2048, dtype="bfloat16", fake=True))
print(json.dumps({"seconds": time.perf_counter() - start, "buffers": len(trace), "peak": trace.peak()[0],
                  "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""
FAKE_RANKS = """
import json, os, resource, tempfile, time, torch
torch.set_num_threads(1)
os.environ.update(MEMPLAN_PRESET="medium", MEMPLAN_PARALLEL="tp+sp")
from memplan.step import StepSpec
from memplan.traces.ranks.launch import trace_ranks
start = time.perf_counter()
with tempfile.TemporaryDirectory() as folder:
    step = StepSpec("examples/gpt2_parallel.py", batch=8, seq=1024, mode="baseline", fake=True)
    ranks = trace_ranks(step, f"{folder}/m.json.gz", 8, alike=False)  # every rank: the cost of tracing each
print(json.dumps({"seconds": time.perf_counter() - start, "peak": max(s["peak_bytes"] for _, _, s in ranks),
                  "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def child(code: str) -> dict:
    """Run `code` in a fresh Python (its peak resident memory is its own) and read its last JSON line."""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


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

    def build():
        return build_workload(args.batch, args.seq, config=PRESETS[args.preset])

    def build_and_two_plain_steps():
        workload = build()
        workload.step()
        workload.step()

    workload = build()
    for _ in range(3):
        workload.step()
    with recording(torch.device("cpu")) as recorder:
        recorded = build()
        recorded.step()

        def recorded_step():
            recorder.begin_step()
            with marked_step(recorded, recorder):
                recorded.step()
            recorder.end_step()

        step_timings = median_seconds(
            {"plain step": workload.step, "step under the recorder": recorded_step}, args.repeats
        )
    whole = median_seconds(
        {
            "build + 2 plain steps": build_and_two_plain_steps,
            "capture_step (build, warm-up, step, trace)": lambda: capture_step(build),
        },
        max(3, args.repeats // 3),
    )
    trace = capture_step(build)
    print(
        f"bert preset {args.preset}, batch {args.batch}, seq {args.seq}, {args.threads} thread(s), "
        f"median of {args.repeats}; {len(trace.recorded)} allocations per step"
    )
    print(f"{'':44} {'wall ms':>9} {'ratio':>6}   {'cpu ms':>9} {'ratio':>6}")
    for timings, base in ((step_timings, "plain step"), (whole, "build + 2 plain steps")):
        plain = timings[base]
        for label, (wall, cpu) in timings.items():
            print(f"{label:44} {wall * 1e3:9.2f} {wall / plain[0]:6.2f}   {cpu * 1e3:9.2f} {cpu / plain[1]:6.2f}")
    wall, cpu = step_timings["step under the recorder"]
    plain = step_timings["plain step"]
    print(f"step under the recorder / plain: {wall / plain[0]:.2f} wall, {cpu / plain[1]:.2f} cpu (target <= 3)")

    fake = child(FAKE_7B)
    print(
        f"fake trace, HF Llama 7B shape, bf16, batch 1, seq 2048: {fake['seconds']:.1f} s (target <= 120), "
        f"peak RSS {fake['rss'] / 2**30:.2f} GiB (target <= 4), {fake['buffers']} buffers, "
        f"peak live {fake['peak'] / 2**30:.2f} GiB"
    )
    ranks = child(FAKE_RANKS)
    print(
        f"8 fake ranks, GPT-2 medium tp+sp, fp32, batch 8, seq 1024: {ranks['seconds']:.1f} s, peak RSS "
        f"{ranks['rss'] / 2**30:.2f} GiB, largest rank peak live {ranks['peak'] / 2**30:.2f} GiB"
    )


if __name__ == "__main__":
    main()
