"""Fidelity of memplan's traces against real GPUs: the shared snapshots whose program is known.

Usage: .venv/bin/python benchmarks/fidelity.py [SHARED_DIR] [--contexts 128,512] [--no-real]
For each CS336 GPT-2-medium snapshot (the program and how it was recorded:
SHARED_DIR/traces/cuda-snapshots/PROGRAMS.md, sections 1 and 2; batch 4): the real peak allocated (requested
bytes) and reserved, read from the snapshot; then for a real CPU trace, a --fake trace, a --fake --device cuda
trace and, on a GPU, a real CUDA trace of the same step (examples/cs336_lm.py, memplan's rebuild of that
program from PROGRAMS.md): peak live and its error against the real peak, the caching-allocator simulator's
peak reserved against the real reserved, and how many of the snapshot's allocations the trace reproduces in
order by size (the longest common subsequence of the two size sequences; for a real trace also counting only
the buffers an op returned, not its kernels' own). Target: every error within 1%.
A last row traces the step under CPU autocast (bfloat16, CS336_AUTOCAST=bf16): the context-512 snapshot was
recorded with forward and loss under CUDA autocast (bf16), context 128 in fp32.
"""

from __future__ import annotations

import argparse
import difflib
import os
import time
from pathlib import Path

import torch

from memplan.errors import MemplanError
from memplan.planner.simulate.caching_allocator import simulate_caching
from memplan.step import StepSpec
from memplan.traces.format import Trace
from memplan.traces.snapshot import read_snapshot, snapshot_to_trace
from memplan.traces.trace_model import trace_step

ROOT = Path(__file__).resolve().parents[1]

BATCH = 4
SNAPSHOT = "traces/cuda-snapshots/gpt2_medium_ctx{}_training.pickle"


def sizes_in_order(trace: Trace, outputs_only: bool = False) -> list[int]:
    """Sizes of the step's allocations in order; with `outputs_only`, of those some op returned (not internal)."""
    return [int(trace.size[i]) for i in trace.recorded if not (outputs_only and trace.internal[i])]


def reproduced(snapshot: list[int], traced: list[int]) -> int:
    """How many of the snapshot's allocations the trace makes in the same order with the same size."""
    matcher = difflib.SequenceMatcher(a=snapshot, b=traced, autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks())


def row(
    label: str,
    trace: Trace | None,
    real_peak: int,
    real_reserved: int,
    real_sizes: list[int],
    seconds: float,
    note: str = "",
) -> None:
    if trace is None:
        print(f"  {label:22} {note}")
        return
    peak = trace.peak()[0]
    reserved = simulate_caching(trace).peak_reserved
    same = reproduced(real_sizes, sizes_in_order(trace))
    outputs = ""
    if trace.internal.any():  # a real trace: its kernels' own buffers left out too
        outputs = f" (op outputs only: {reproduced(real_sizes, sizes_in_order(trace, outputs_only=True)):,})"
    print(
        f"  {label:22} peak {peak:>15,} ({(peak / real_peak - 1) * 100:+.3f}%)   "
        f"simulated reserved {reserved:>15,} ({(reserved / real_reserved - 1) * 100:+.3f}%)   "
        f"in order {same:,}/{len(real_sizes):,} ({same / len(real_sizes):.1%}){outputs}   {seconds:.0f} s"
    )


def traced(context: int, fake: bool, device: str) -> tuple[Trace | None, float, str]:
    start = time.perf_counter()
    try:
        trace = trace_step(StepSpec(ROOT / "examples" / "cs336_lm.py", BATCH, context, device=device, fake=fake))
    except MemplanError as e:
        return None, 0.0, f"not run: {e}"
    return trace, time.perf_counter() - start, ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shared", nargs="?", default=str(ROOT.parent / "shared"))
    parser.add_argument("--contexts", default="128,512")
    parser.add_argument("--no-real", action="store_true", help="skip the real CPU traces (minutes, ~12-20 GB)")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    shared = Path(args.shared)
    os.environ.pop("MEMPLAN_PRESET", None)  # the snapshots' shape: the model file's default, medium
    for context in (int(c) for c in args.contexts.split(",")):
        path = shared / SNAPSHOT.format(context)
        snapshot = read_snapshot(path)
        real = snapshot_to_trace(snapshot, str(path))
        real_peak = real.peak()[0]
        real_reserved = sum(segment.size for segment in snapshot.segments)  # never shrinks: no empty_cache
        real_sizes = sizes_in_order(real)
        print(
            f"{path.name}: CS336 GPT-2-medium step, batch {BATCH}, context {context}; real peak allocated "
            f"{real_peak:,}, reserved {real_reserved:,}, {len(real_sizes):,} allocations recorded"
        )
        runs = [("real CPU trace", False, "cpu", "")] * (not args.no_real)
        runs += [("real CUDA trace", False, "cuda", "")] * torch.cuda.is_available()
        runs += [
            ("--fake", True, "cpu", ""),
            ("--fake --device cuda", True, "cuda", ""),
            ("--fake, autocast bf16", True, "cpu", "bf16"),
        ]
        for label, fake, device, autocast in runs:
            os.environ["CS336_AUTOCAST"] = autocast
            trace, seconds, note = traced(context, fake, device)
            row(label, trace, real_peak, real_reserved, real_sizes, seconds, note)


if __name__ == "__main__":
    main()
