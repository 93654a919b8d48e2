"""Per-rank activation bytes of one GPT-2 layer under tensor and sequence parallelism, next to REFERENCE §1.

For every parallel size t that fits this machine (t processes on gloo), every layer mode and both kinds
of parallelism, prints what one rank holds for backward for one layer, measured two ways (autograd's
saved tensors of one layer, and the tracer: a captured training step with two layers minus one), the
formula in its p-byte form, and measured / formula. Ranks are symmetric; the largest rank is shown.

With --llama70b, issue 33's scale instead: a Llama-3-70B-shaped model (the `70b` preset: 80 layers, hidden 8192, 64
heads, 8 k/v heads, ffn 28672, vocabulary 128256; FSDP2's bf16 mixed precision, batch 1 a rank, sequence 8192)
traced with `--nproc --fake --device cuda` (an H100) on FSDP2 over 64 ranks x TP 8 (512 ranks, examples/llama_fsdp2.py)
and on 4 pipeline stages (1F1B, 4 micro-batches of one sequence) x FSDP2 over 16 (64 ranks, examples/llama_pipeline.py
with MEMPLAN_DP=16): each in a fresh child process, its wall and CPU time and peak resident memory (target: at most 2
minutes and 4 GiB), and each distinct trace's ranks, peak live bytes and the caching allocator's peak reserved.

Usage: .venv/bin/python benchmarks/parallel.py [--sizes 1,2,4] [--seq 128] [--batch 2] [--hidden 256]
       [--heads 8] [--dtype float32|bfloat16] [--modes baseline,selective,tempo,tempo+selective]
       .venv/bin/python benchmarks/parallel.py --llama70b [--layers 80] [--only fsdp-tp|pp-fsdp]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from memplan.planner.parallel.checks import run_cases
from memplan.traces.ranks.launch import launch

P = {"float32": 4, "bfloat16": 2}
ROOT = Path(__file__).resolve().parents[1]
# issue 33's two layouts of the 70B shape: (name, model file, environment, ranks, batch a rank)
LAYOUTS = (
    ("fsdp-tp", "llama_fsdp2.py", {"MEMPLAN_TP": "8"}, 512, 1),
    ("pp-fsdp", "llama_pipeline.py", {"MEMPLAN_DP": "16", "MEMPLAN_MICROBATCHES": "4"}, 64, 4),
)
TRACE_RANKS = """
import json, resource, sys, tempfile, time, torch
torch.set_num_threads(1)
from memplan.planner.simulate.caching_allocator import simulate_caching
from memplan.step import StepSpec
from memplan.traces.ranks.launch import trace_ranks
from memplan.traces.format import load
model_file, nproc, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
start, cpu = time.perf_counter(), time.process_time()
with tempfile.TemporaryDirectory() as folder:
    step = StepSpec(model_file, batch=batch, seq=8192, fake=True, device="cuda")
    distinct = trace_ranks(step, f"{folder}/t.json.gz", nproc)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    rows = []
    for path, ranks, summary in distinct:
        trace = load(path)
        rows.append({"ranks": ranks, "peak": trace.peak()[0], "reserved": simulate_caching(trace).peak_reserved,
                     "buffers": len(trace)})
print(json.dumps({"seconds": seconds, "cpu": cpu, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "traces": rows}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=None, help="parallel sizes (default: 1, 2, 4 up to 2x the cores)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dtype", choices=sorted(P), default="float32")
    parser.add_argument("--modes", default="baseline,selective,tempo,tempo+selective")
    parser.add_argument("--llama70b", action="store_true", help="issue 33's 70B layouts instead (see above)")
    parser.add_argument("--layers", type=int, default=80, help="with --llama70b: the model's depth")
    parser.add_argument("--only", choices=[name for name, *_ in LAYOUTS], help="with --llama70b: one layout")
    args = parser.parse_args()
    if args.llama70b:
        llama70b(args.layers, args.only)
        return
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


def llama70b(layers: int, only: str | None) -> None:
    """Trace each 70B layout with --fake in a child process (its resident memory its own) and print its figures."""
    from memplan.traces.ranks.family import ranks_label
    from memplan.units import human_bytes

    print(f"Llama-3-70B shape, {layers} layers, FSDP2 bf16 mixed precision, sequence 8192, --fake --device cuda")
    for name, model_file, env, nproc, batch in LAYOUTS:
        if only not in (None, name):
            continue
        env = {**os.environ, **env, "MEMPLAN_PRESET": "70b", "MEMPLAN_LAYERS": str(layers)}
        env |= {"MEMPLAN_FSDP_PRECISION": "bf16", "OMP_NUM_THREADS": "1"}
        args = [sys.executable, "-c", TRACE_RANKS, str(ROOT / "examples" / model_file), str(nproc), str(batch)]
        done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode:
            print(f"{name}: failed\n{done.stderr[-2000:]}")
            continue
        result = json.loads(done.stdout.strip().splitlines()[-1])
        print(
            f"{name} ({nproc} ranks, batch {batch} a rank): {result['seconds']:.1f} s wall, {result['cpu']:.1f} s CPU, "
            f"peak RSS {human_bytes(result['rss'])}, {len(result['traces'])} distinct trace(s)"
        )
        for row in result["traces"]:
            print(
                f"  {ranks_label(row['ranks']):<16} peak live {human_bytes(row['peak']):>10} "
                f"({row['peak']:,} B), reserved {human_bytes(row['reserved']):>10}, {row['buffers']:,} buffers"
            )


if __name__ == "__main__":
    main()
