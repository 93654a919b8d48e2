"""Per-rank activation bytes of one GPT-2 layer under tensor and sequence parallelism, next to REFERENCE §1.

For every parallel size t that fits this machine (t processes on gloo), every layer mode and both kinds
of parallelism, prints what one rank holds for backward for one layer, measured two ways (autograd's
saved tensors of one layer, and the tracer: a captured training step with two layers minus one), the
formula in its p-byte form, and measured / formula. Ranks are symmetric; the largest rank is shown.

Usage: .venv/bin/python benchmarks/parallel.py [--sizes 1,2,4] [--seq 128] [--batch 2] [--hidden 256]
       [--heads 8] [--dtype float32|bfloat16] [--modes baseline,selective,tempo,tempo+selective]
"""

from __future__ import annotations

import argparse
import os
import time

from memplan.planner.parallel.checks import run_cases
from memplan.traces.distributed import launch

P = {"float32": 4, "bfloat16": 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=None, help="parallel sizes (default: 1, 2, 4 up to 2x the cores)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dtype", choices=sorted(P), default="float32")
    parser.add_argument("--modes", default="baseline,selective,tempo,tempo+selective")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    sizes = (
        [int(x) for x in args.sizes.split(",")]
        if args.sizes
        else [t for t in (1, 2, 4, 8) if t <= 2 * cores and args.heads % t == 0 and args.seq % t == 0]
    )
    modes = args.modes.split(",")
    shape = [args.seq, args.batch, args.hidden, args.heads, P[args.dtype]]
    print(
        f"one GPT-2 layer, s={args.seq} b={args.batch} h={args.hidden} a={args.heads} {args.dtype} "
        f"(p={P[args.dtype]}), gloo on {cores} cores; bytes per rank"
    )
    print(
        f"{'t':>2} {'parallel':<8} {'mode':<16} {'saved':>10} {'traced':>10} {'formula':>12} "
        f"{'saved/f':>8} {'traced/f':>8}"
    )
    for t in sizes:
        kinds = [False] if t == 1 else [False, True]
        cases = [
            {"check": check, "shape": shape, "mode": mode, "sequence_parallel": sp}
            for sp in kinds
            for mode in modes
            for check in ("bytes", "traced")
        ]
        start = time.perf_counter()
        per_rank = launch(run_cases, (cases,), nproc=t)
        seconds = time.perf_counter() - start
        for i in range(0, len(cases), 2):
            saved = max(r[i]["measured"] for r in per_rank)
            traced = max(r[i + 1]["measured"] for r in per_rank)
            formula = per_rank[0][i]["formula"]
            kind = "-" if t == 1 else "tp+sp" if cases[i]["sequence_parallel"] else "tp"
            print(
                f"{t:>2} {kind:<8} {cases[i]['mode']:<16} {saved:>10,} {traced:>10,} {formula:>12,.0f} "
                f"{saved / formula:>8.4f} {traced / formula:>8.4f}"
            )
        print(f"   ({t} process{'es' if t > 1 else ''}: {seconds:.1f} s)")


if __name__ == "__main__":
    main()
