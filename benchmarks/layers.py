"""Bytes per Transformer layer of each memory-saving mode next to REFERENCE §1's formulas, and CPU step-time ratios.

Part 1 measures the BERT-Large layer shape (h=1024, a=16) at s = 128 and 512: the bytes held for
backward by a stack of 2 layers minus a stack of 1 (captured with memplan's tracer, or counted
with saved-tensor hooks with --method saved), per mode and dtype, next to the formula.
Part 2 times training steps of a BERT per mode (median of several, interleaved), on the CPU or with
--device cuda on a GPU (both parts then run there).

    .venv/bin/python benchmarks/layers.py
    .venv/bin/python benchmarks/layers.py --seqs 128 --dtypes bf16 --method saved --steps 5
    python benchmarks/layers.py --device cuda --seqs 512 --time-shape 512 8 1024 16 24 --time-dtype bf16
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from memplan.planner.layers import MODES, patch
from memplan.planner.layers.memory import LayerShape, held_for_backward, saved_bytes
from memplan.planner.workloads import bert
from memplan.traces.capture import capture_step

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def held(mode: str, layers: int, seq: int, batch: int, dtype: torch.dtype, method: str, device: str) -> int:
    """Bytes one BERT-Large-shaped stack of `layers` holds for backward under `mode` (small vocabulary: it cancels)."""
    config = dataclasses.replace(bert.LARGE, vocab_size=1024, layers=layers)

    def build():
        workload = bert.build_workload(batch_size=batch, seq_len=seq, dtype=dtype, device=device, config=config)
        patch(workload.model, mode)
        return workload

    if method == "saved":
        workload = build()
        return saved_bytes(workload.model, workload.forward)
    return held_for_backward(capture_step(build, device))


def memory_table(seqs, dtypes, batch: int, method: str, device: str) -> None:
    print(
        f"bytes per layer, BERT-Large shape (h=1024, a=16), b={batch}, {device}, measured by {method} (L=2 minus L=1)"
    )
    print(
        f"{'s':>4} {'dtype':>5} {'mode':>16} {'measured':>12} {'formula':>12} {'meas/form':>9} {'saving':>7} "
        f"{'formula saving':>14}"
    )
    for seq in seqs:
        for name in dtypes:
            dtype = DTYPES[name]
            shape = LayerShape(s=seq, b=batch, h=1024, a=16, p=torch.finfo(dtype).bits // 8)
            base = None
            for mode in MODES:
                stacks = [held(mode, layers, seq, batch, dtype, method, device) for layers in (2, 1)]
                per_layer = stacks[0] - stacks[1]
                formula = shape.formula(mode)
                base = per_layer if base is None else base
                saving, formula_saving = 1 - per_layer / base, 1 - formula / shape.formula("baseline")
                print(
                    f"{seq:>4} {name:>5} {mode:>16} {per_layer:>12,} {formula:>12,} {per_layer / formula:>9.4f} "
                    f"{saving:>7.1%} {formula_saving:>14.1%}",
                    flush=True,
                )


def step_times(seq: int, batch: int, hidden: int, heads: int, layers: int, steps: int, dtype: str, device: str):
    config = dataclasses.replace(bert.TINY, hidden=hidden, heads=heads, layers=layers, max_positions=max(seq, 512))
    threads = f", {torch.get_num_threads()} thread(s)" if device == "cpu" else ""
    print(
        f"\n{device} step time, BERT h={hidden} a={heads} L={layers} s={seq} b={batch} {dtype}{threads}, "
        f"median of {steps} interleaved steps"
    )
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    workloads = {}
    for mode in MODES:
        workloads[mode] = bert.build_workload(
            batch_size=batch, seq_len=seq, dtype=DTYPES[dtype], device=device, config=config
        )
        patch(workloads[mode].model, mode)
        workloads[mode].step()
    times = {mode: [] for mode in MODES}
    for _ in range(steps):
        for mode, workload in workloads.items():
            sync()
            start = time.perf_counter()
            workload.step()
            sync()
            times[mode].append(time.perf_counter() - start)
    base = statistics.median(times["baseline"])
    for mode in MODES:
        median = statistics.median(times[mode])
        print(
            f"{mode:>16} {median * 1e3:8.1f} ms  {median / base:6.3f}x baseline  {batch * seq / median:10,.0f} tokens/s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--batch", type=int, default=1, help="micro-batch of the memory part")
    parser.add_argument("--method", choices=["tracer", "saved"], default="tracer")
    parser.add_argument("--steps", type=int, default=9, help="timed steps per mode (0 skips the timing part)")
    parser.add_argument(
        "--time-shape", type=int, nargs=5, default=[128, 4, 256, 4, 2], metavar=("S", "B", "H", "A", "L")
    )
    parser.add_argument("--time-dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    memory_table(args.seqs, args.dtypes, args.batch, args.method, args.device)
    if args.steps:
        step_times(*args.time_shape, steps=args.steps, dtype=args.time_dtype, device=args.device)


if __name__ == "__main__":
    main()
