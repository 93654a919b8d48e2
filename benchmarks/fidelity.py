"""Fidelity of memplan's traces against real GPUs: the project's own snapshots, then every shared snapshot whose
program PROGRAMS.md describes.

Usage: .venv/bin/python benchmarks/fidelity.py [SHARED_DIR] [--only NAME,...] [--real] [--timing] [--own-only]
First the project's own snapshots (tests/data/cuda-snapshots, recorded by benchmarks/record_snapshots.py on an
H200): each recorded step traced here by `--fake --device cuda` for that GPU, with its peak against the real one,
the simulator's reserved against the real step's from an emptied cache, and the real allocations it makes in order.
For each snapshot (SHARED_DIR/traces/cuda-snapshots: the CS336 GPT-2-medium step at context 128 in fp32 and at
context 512 under CUDA autocast bf16, batch 4, the course's own loss and AdamW, examples/cs336_lm.py; the xl step
at context 128 in fp32 and under autocast bf16, PyTorch's AdamW and cross-entropy, examples/cs336_xl.py): the real
peak allocated (requested bytes) and reserved, read from the snapshot; then memplan's prediction from this CPU
machine, `--fake --device cuda` (the GPU's rules: CUDA's autocast policy, AdamW's foreach path, cuBLAS's
workspaces): its peak live and the error against the real peak, the caching-allocator simulator's peak reserved
and its error against the real reserved, and how many of the snapshot's allocations the trace makes in the same
order with the same size (the longest common subsequence of the two size sequences). Target: every error within
1% (reserved within 2%). `--real` adds a real CPU trace of the medium steps (minutes, ~12-20 GB), `--timing`
the wall time of the xl step's `--fake` CPU trace against its `--fake --device cuda` trace (target: at most 2x).
`--programs` adds the whole-program verdict on the H200 runs at the edge of memory (benchmarks/h200_programs.py:
each run's step peaks and verdict against the real run, and fit's batch against the largest that ran).
The programs' torch took cuBLAS workspaces of 8,519,680 B per handle (the snapshots' two framed-less
active blocks of that size): CUBLAS_WORKSPACE_CONFIG=:4096:2:16:8 says so (torch 2.13 on an sm90 GPU takes 32 MiB).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from memplan.errors import MemplanError
from memplan.planner.simulate.caching_allocator import simulate_caching
from memplan.planner.simulate.fidelity import fidelity, predict, recorded_steps, reproduced, sizes_in_order
from memplan.step import StepSpec
from memplan.traces.format import Trace
from memplan.traces.inputs.snapshot import read_snapshot, snapshot_to_trace
from memplan.traces.inputs.trace_model import trace_step

ROOT = Path(__file__).resolve().parents[1]

BATCH = 4
SNAPSHOT_DIR = Path("traces") / "cuda-snapshots"


@dataclass(frozen=True)
class Program:
    """One shared snapshot and the model file that rebuilds its program."""

    snapshot: str  # file name under SHARED_DIR/traces/cuda-snapshots
    model_file: str  # under examples/
    seq: int
    autocast: str  # CS336_AUTOCAST: "bf16" (forward, and loss for the medium steps, under CUDA autocast) or ""


sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from cs336_lm import SNAPSHOTS  # noqa: E402  the table of the snapshots and their rebuilds

PROGRAMS = tuple(Program(name, *program) for name, program in SNAPSHOTS.items())


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


def traced(program: Program, fake: bool, device: str) -> tuple[Trace | None, float, str]:
    """The program's step traced by memplan, the seconds it took, and why not where it could not run."""
    os.environ["CS336_AUTOCAST"] = program.autocast
    start = time.perf_counter()
    try:
        trace = trace_step(
            StepSpec(ROOT / "examples" / program.model_file, BATCH, program.seq, device=device, fake=fake)
        )
    except MemplanError as e:
        return None, 0.0, f"not run: {e}"
    return trace, time.perf_counter() - start, ""


OWN_SNAPSHOTS = ROOT / "tests" / "data" / "cuda-snapshots"


def own_snapshots(only: set[str]) -> None:
    """The project's own snapshots (benchmarks/record_snapshots.py): each recorded step against its prediction."""
    print(f"{OWN_SNAPSHOTS.relative_to(ROOT)}: real CUDA steps against --fake --device cuda traced here; reserved "
          "against the same step started from an emptied cache")  # fmt: skip
    for recorded in recorded_steps(OWN_SNAPSHOTS, ROOT):
        if only and not any(recorded.name.startswith(name) for name in only):
            continue
        real = snapshot_to_trace(read_snapshot(recorded.snapshot), recorded.name)
        start = time.perf_counter()
        try:
            trace = predict(recorded)
        except MemplanError as e:
            print(f"  {recorded.name:32} not run: {e}")
            continue
        result = fidelity(real, trace, recorded.reserved_from_empty)
        baseline = simulate_caching(real).peak_reserved / recorded.reserved_from_empty - 1
        print(
            f"  {recorded.name:32} peak {result.peak:>13,} of {result.real_peak:>13,} ({result.peak_error:+.3%})  "
            f"reserved {result.reserved_error:+.3%} (on the real trace {baseline:+.3%})  "
            f"in order {result.in_order:,}/{result.allocations:,} "
            f"({result.in_order_share:.1%})  {time.perf_counter() - start:.0f} s",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shared", nargs="?", default=str(ROOT.parent / "shared"))
    parser.add_argument("--only", default="", help="comma-separated snapshot names (default: all four)")
    parser.add_argument("--real", action="store_true", help="add a real CPU trace of the medium steps")
    parser.add_argument("--timing", action="store_true", help="time the xl step's --fake CPU trace too")
    parser.add_argument("--own-only", action="store_true", help="the project's own snapshots alone")
    parser.add_argument("--programs", action="store_true", help="add the H200 whole programs (about 6 minutes)")
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    only = {name for name in args.only.split(",") if name}
    own_snapshots(only)
    if args.own_only:
        return
    os.environ.pop("MEMPLAN_PRESET", None)  # the snapshots' shape: the model files' defaults
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    for program in PROGRAMS:
        if only and not any(program.snapshot.startswith(name) for name in only):
            continue
        path = Path(args.shared) / SNAPSHOT_DIR / program.snapshot
        snapshot = read_snapshot(path)
        real = snapshot_to_trace(snapshot, str(path))
        real_peak = real.peak()[0]
        real_reserved = sum(segment.size for segment in snapshot.segments)  # never shrinks: no empty_cache
        real_sizes = sizes_in_order(real)
        print(
            f"{path.name}: {program.model_file} batch {BATCH}, context {program.seq}, "
            f"{'autocast bf16' if program.autocast else 'fp32'}; real peak allocated {real_peak:,}, "
            f"reserved {real_reserved:,}, {len(real_sizes):,} allocations recorded"
        )
        runs = [("--fake --device cuda", True, "cuda")]
        runs += [("real CUDA trace", False, "cuda")] * torch.cuda.is_available()
        runs += [("real CPU trace", False, "cpu")] * (args.real and program.model_file == "cs336_lm.py")
        runs += [("--fake (CPU)", True, "cpu")] * (args.timing and program.model_file == "cs336_xl.py")
        for label, fake, device in runs:
            trace, seconds, note = traced(program, fake, device)
            row(label, trace, real_peak, real_reserved, real_sizes, seconds, note)
    if args.programs:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)  # the H200 runs' torch 2.11 took its defaults
        from h200_programs import report

        report(Path(args.shared))


if __name__ == "__main__":
    main()
