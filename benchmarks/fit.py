"""Largest BERT-Large batch fitting 11 GiB and 16 GiB, EXTRAPOLATED from 1- and 2-layer traces.

Full 24-layer BERT-Large traces at large batch do not fit a 2-core CPU machine in time, so per mode, dtype,
sequence length and batch size b this traces the BERT-Large shape (hidden 1024, 16 heads, vocabulary 30522)
with 1 and with 2 layers. For each phase group (forward+backward, then the optimizer step, whose peaks move
differently with depth) and each allocator model (the caching allocator's simulated peak reserved; the plan's
arena = most bytes live, which the solver reaches) it takes per_layer(b) = M2(b) - M1(b) and
fixed(b) = M1(b) - per_layer(b), predicts M24(b) = fixed(b) + 24 per_layer(b), fits each group's M24 as affine
in b over the traced batches and prints the largest b with every group within each memory size.
Weights, gradients and AdamW state are in the model dtype (no fp32 master copy); the caching allocator's
figure is its peak without a capacity (no OOM retry), assumes its per-phase reserve adds up per layer, and is
raised to the plan's where the extrapolation falls below the bytes live (no allocator reserves less), both
at the traced batches and in the answer (the caching batch is never above the plan's).

Example: .venv/bin/python benchmarks/fit.py --seq 128 --seq 512 --dtype bfloat16 --dtype float32
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository, not benchmarks/ (whose solvers.py shadows)

from planner.alloc_conf import parse_alloc_conf  # noqa: E402
from planner.caching_allocator import simulate_caching  # noqa: E402
from planner.layers import MODES, patch  # noqa: E402
from planner.problem import problem_from_trace  # noqa: E402
from planner.workloads.bert import LARGE, build_workload  # noqa: E402
from solvers import solve  # noqa: E402
from traces.capture import capture_step  # noqa: E402

GiB = 1 << 30
PAPER = ("Tempo paper (REFERENCE §2): BERT-Large pre-training up to 2x batch (4x RTX 2080 Ti 11 GB; "
         "4x V100 16 GB); README fine-tuning s=384: 2080 Ti fp32 4->6, fp16 8->11; V100 fp32 8->13, fp16 16->22")


PHASES = ("fwd+bwd", "optimizer")


@dataclass
class Measured:
    """One traced step: per phase group, caching allocator peak reserved and plan memory; did the plan reach it."""

    caching: dict[str, int]
    plan: dict[str, int]
    plan_at_bound: bool


def measure(layers: int, batch: int, seq: int, dtype: str, mode: str, conf, time_limit: float) -> Measured:
    """Trace one step of BERT-Large with `layers` layers; figures before and from the optimizer step.

    The plan's memory in a phase is the most bytes live in it (sizes rounded to the plan's 512 B), which is
    the plan's arena whenever the solver reaches its lower bound (checked: plan_at_bound).
    """
    def build():
        workload = build_workload(batch, seq, getattr(torch, dtype), "cpu", config=replace(LARGE, layers=layers))
        patch(workload.model, mode)  # as load_workload does for a model file returning a Workload
        return workload

    trace = capture_step(build, meta={"layers": mode, "batch": batch, "seq": seq})
    problem = problem_from_trace(trace)
    plan = solve(problem, time_limit=time_limit)
    delta = np.zeros(trace.end + 1, np.int64)
    aligned = (trace.size + 511) // 512 * 512
    np.add.at(delta, trace.alloc, aligned)
    np.add.at(delta, trace.free, -aligned)
    live = np.cumsum(delta)[:-1]
    reserved = simulate_caching(trace, conf).reserved
    starts = [int(t) for t, ph in zip(trace.alloc, trace.phase) if ph == "optimizer" and t > 0]
    t_opt = min(starts, default=trace.end)
    groups = {"fwd+bwd": slice(0, t_opt), "optimizer": slice(t_opt, trace.end)}
    return Measured({g: int(reserved[s].max(initial=0)) for g, s in groups.items()},
                    {g: int(live[s].max(initial=0)) for g, s in groups.items()},
                    plan.arena == plan.bound)


def largest_batch(batches: list[int], memory24: dict[str, list[int]], capacity: int) -> int:
    """Largest b with every phase group's 24-layer memory, affine in b over the traced batches, within capacity."""
    best = None
    for values in memory24.values():
        slope, intercept = np.polyfit(np.array(batches, float), np.array(values, float), 1)
        if intercept + slope > capacity:
            return 0
        if slope > 0:
            b = int(np.floor((capacity - intercept) / slope))
            best = b if best is None else min(best, b)
    return best if best is not None else -1  # -1: memory does not grow with the batch here


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, action="append", help="sequence lengths [128, 512]")
    ap.add_argument("--dtype", action="append", choices=["bfloat16", "float32"], help="dtypes [bfloat16, float32]")
    ap.add_argument("--mode", action="append", choices=MODES, help="layer modes [all four]")
    ap.add_argument("--batches", default=None,
                    help="traced batch sizes, e.g. 16,32 [2048/seq and twice that: large enough that activations, "
                         "not the optimizer state, set the 1- and 2-layer peaks as they do at 24 layers]")
    ap.add_argument("--memory-gib", type=float, action="append", help="memory sizes in GiB [11, 16]")
    ap.add_argument("--total-layers", type=int, default=LARGE.layers, help="layers extrapolated to [24]")
    ap.add_argument("--alloc-conf", default="", help="PYTORCH_CUDA_ALLOC_CONF for the simulated caching allocator")
    ap.add_argument("--time-limit", type=float, default=2.0, help="seconds per solve [2]")
    args = ap.parse_args(argv)
    seqs, dtypes = args.seq or [128, 512], args.dtype or ["bfloat16", "float32"]
    modes, memories = args.mode or list(MODES), args.memory_gib or [11.0, 16.0]
    conf, total = parse_alloc_conf(args.alloc_conf), args.total_layers
    start = time.monotonic()
    print(f"EXTRAPOLATED from 1- and 2-layer traces of BERT-Large (h=1024, a=16, vocab 30522) to {total} layers; "
          "AdamW state in the model dtype")
    header = ["dtype", "seq", "mode"] + [f"{a} {g:g}GiB" for g in memories for a in ("caching", "plan")] + \
             [f"{a} GiB/sample" for a in ("caching", "plan")] + ["traced b", f"plan {total}L at last b"]
    rows, at_bound, traced, raised = [], 0, 0, 0
    for dtype in dtypes:
        for seq in seqs:
            base = max(2048 // seq, 1)
            batches = [int(x) for x in args.batches.split(",")] if args.batches else [base, 2 * base]
            for mode in modes:
                pred = {a: {g: [] for g in PHASES} for a in ("caching", "plan")}
                for b in batches:
                    m1 = measure(1, b, seq, dtype, mode, conf, args.time_limit)
                    m2 = measure(2, b, seq, dtype, mode, conf, args.time_limit)
                    at_bound += m1.plan_at_bound + m2.plan_at_bound
                    traced += 2
                    for a in ("caching", "plan"):
                        for g in PHASES:
                            one, two = getattr(m1, a)[g], getattr(m2, a)[g]
                            per_layer = two - one
                            pred[a][g].append(one - per_layer + total * per_layer)
                    for g in PHASES:  # the caching allocator reserves at least what is live
                        if pred["caching"][g][-1] < pred["plan"][g][-1]:
                            pred["caching"][g][-1] = pred["plan"][g][-1]
                            raised += 1
                    print(f"  [{time.monotonic() - start:6.0f} s] {dtype} s={seq} {mode} b={b}: {total}L predicted "
                          + "; ".join(f"{a} " + " ".join(f"{g} {pred[a][g][-1] / GiB:.2f}" for g in PHASES)
                                      for a in ("caching", "plan")) + " GiB", file=sys.stderr, flush=True)
                row = [dtype, str(seq), mode]
                for g in memories:
                    plan_b = largest_batch(batches, pred["plan"], int(g * GiB))
                    # both lines are extrapolated; where they cross, the bytes live still bound the allocator
                    row += [str(min(largest_batch(batches, pred["caching"], int(g * GiB)), plan_b)), str(plan_b)]
                row += [f"{np.polyfit(batches, pred[a]['fwd+bwd'], 1)[0] / GiB:.3f}" for a in ("caching", "plan")]
                row += [",".join(map(str, batches)), f"{max(pred['plan'][g][-1] for g in PHASES) / GiB:.2f}"]
                rows.append(row)
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    print("largest batch (extrapolated, not traced at 24 layers):")
    for r in [header] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    print(f"caching figures raised to the plan's (most bytes live; its reserve does not add up per layer exactly) "
          f"in {raised} of {traced // 2 * len(PHASES)} predictions (per batch and phase group)")
    print(f"the plan reached its lower bound (arena = most bytes live) in {at_bound} of {traced} traces")
    print(PAPER)
    print(f"wall time {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
