"""The whole-program verdict against real H200 runs at the edge of memory (SHARED_DIR/traces/h200-programs).

Usage: .venv/bin/python benchmarks/h200_programs.py [SHARED_DIR] [--no-fit]
The program (an HF Llama-3.2-1B-shaped loop, sequence 4096, bf16 autocast, AdamW; PROGRAMS.md) is rebuilt as
examples/configs/llama-3.2-1b.json and traced here on fake CUDA for the H200. For each real run: the measured step's
peak allocated and max reserved (after the reset before it) against the real ones, and the verdict (fits, or the
request it runs out at and where) against what the run did, judged on the H200 with the memory the run measured
outside the caching allocator. Then `fit`'s largest batch for each allocator setting against the largest that ran
(default: 7, since 8 ran out of memory; expandable segments: 8, since 9 ran out), with the wall time of each trace.
Targets (issue 46): peak allocated within 0.1%, reserved within 1%, no "fits" where the GPU ran out.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch

from memplan.planner.jobs.fit import fit_model
from memplan.units import format_size

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from test_h200_programs import CONFIG, programs, verdict  # noqa: E402  PROGRAMS.md's runs, read the tests' way

from memplan.step import StepSpec  # noqa: E402


def error(predicted: int, real: int) -> str:
    return f"{100 * (predicted - real) / real:+.4f}%"


def report(shared: Path, fit: bool = True) -> None:
    """Print each run's figures and verdict against the real run, then (with `fit`) fit's batch per allocator."""
    torch.set_num_threads(1)
    runs = programs(shared)
    notes = (shared / "traces" / "h200-programs" / "PROGRAMS.md").read_text().replace("\n", " ")
    unshared = [int(b) for b in re.findall(r"The same loop at B = (\d+) with the default allocator ran out", notes)]
    print("batch  alloc conf                 real    step peak allocated (error)      step max reserved (error)"
          "      verdict")  # fmt: skip
    for batch, run in sorted(runs.items()):
        started = time.perf_counter()
        _, v = verdict(batch, run)
        seconds = time.perf_counter() - started
        said = "fits" if v.fits else f"OOM in {v.oom.where} at a request of {format_size(v.oom.size)}"
        real = "ran" if run["ran"] else "OOM"
        figures = (f"{v.step_peak_allocated:,} ({error(v.step_peak_allocated, run['allocated'])})  "
                   f"{v.step_peak_reserved:,} ({error(v.step_peak_reserved, run['reserved'])})")  # fmt: skip
        if not run["ran"]:  # an OOM run's maxima are the program's up to its failure, not a step's
            figures = f"(real maxima up to the failure: {run['allocated']:,} / {run['reserved']:,})"
        print(f"{batch:>5}  {run['conf'] or '(default)':<24} {real:>4}    {figures}  {said}  [{seconds:.1f} s]")
        if not v.fits:
            print(f"       memplan: {v.oom.message}")
    if not fit:
        return
    print()
    step = StepSpec(str(CONFIG), seq=4096, dtype="bf16-mixed", fake=True).on_gpu("H200")
    for conf in ("", "expandable_segments:True"):
        ran = [b for b, r in runs.items() if r["ran"] and r["conf"] == conf]
        failed = [b for b, r in runs.items() if not r["ran"] and r["conf"] == conf] + (unshared if not conf else [])
        outside = next(r["outside"] for r in runs.values() if r["conf"] == conf and r["ran"])
        started = time.perf_counter()
        result = fit_model(step, runs[7]["total"] - outside, modes=("as-built",), alloc_conf=conf, capture="fake")
        seconds = time.perf_counter() - started
        mode = result.modes[0]
        largest = f"largest that ran {max(ran)}" if ran else "none ran"
        print(f"fit, {conf or 'default allocator'}: batch {mode.batch['caching']} ({largest}; "
              f"ran out at {', '.join(map(str, failed)) or 'none recorded'}; "
              f"{mode.traces} traces, {seconds:.0f} s)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shared", nargs="?", default=str(ROOT.parent / "shared"))
    parser.add_argument("--no-fit", action="store_true", help="leave out fit's batch (2 minutes a setting)")
    args = parser.parse_args()
    report(Path(args.shared), fit=not args.no_fit)


if __name__ == "__main__":
    main()
