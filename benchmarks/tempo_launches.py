"""Kernel launches and host reads of each tempo layer's forward + backward against its native counterpart's, and of
whole training steps in each layer mode, counted on fake CUDA (planner/cost/launches.py): no GPU needed.

On a GPU a tempo step was host-bound (docs/gpu-validation.md): each launch costs the host its Python and dispatch,
each host read (`nonzero`, `item`) waits for the GPU's queue. The counts are aten ops that compute on the device (a
fused kernel as the kernels it was designed to be); a layer is counted after one uncounted call, a step after one
uncounted step (the optimizer's state made).

    .venv/bin/python benchmarks/tempo_launches.py
    .venv/bin/python benchmarks/tempo_launches.py --eager          # the eager math counted too (MEMPLAN_FUSED=0)
    .venv/bin/python benchmarks/tempo_launches.py --models gpt2 --preset small --batch 8 --seq 1024
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from tempo_overhead import layers  # this folder's: the same layer pairs as the host-cost benchmark

from memplan.modes import AS_BUILT, BASELINE, TEMPO
from memplan.planner.cost.launches import layer_launches, step_launches
from memplan.step import StepSpec

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODELS = {"bert": "examples/bert.py", "gpt2": "examples/gpt2.py", "llama": "examples/llama.py"}


def layer_table(shape: tuple[int, ...], heads: int, dtype: torch.dtype, eager: bool) -> list[str]:
    """One line per layer: native and tempo launches (fused, and eager when asked), their ratio, tempo's reads."""
    lines = [f"{'layer':18s} {'native':>7s} {'tempo':>7s} {'ratio':>6s} {'reads':>6s}" + ("  eager" * eager)]
    for name in layers(shape[-1], heads):

        def make(i: int, name: str = name):
            return lambda: layers(shape[-1], heads)[name][i]

        native, tempo = (layer_launches(make(i), shape, dtype) for i in (0, 1))
        line = f"{name:18s} {native.total:7d} {tempo.total:7d} {tempo.total / native.total:6.2f} "
        line += f"{sum(tempo.reads.values()):6d}"
        if eager:
            line += f"  {layer_launches(make(1), shape, dtype, fused=False).total}"
        lines.append(line)
    return lines


def step_table(models: list[str], batch: int, seq: int, dtype: str) -> list[str]:
    """One line per model and mode: a training step's launches (and per layer), its ratio to the baseline's, its
    reads."""
    lines = [f"{'step':22s} {'launches':>9s} {'vs baseline':>12s} {'reads':>6s}  most launched"]
    for model in models:
        counts = {}
        for mode in (AS_BUILT, BASELINE, TEMPO):
            step = StepSpec(str(ROOT / MODELS[model]), batch=batch, seq=seq, dtype=dtype, mode=mode)
            counts[mode] = step_launches(step)
        for mode, count in counts.items():
            top = ", ".join(f"{op} {n}" for op, n in count.launches.most_common(4))
            ratio = count.total / counts[BASELINE].total
            reads = sum(count.reads.values())
            lines.append(f"{model + ' ' + mode:22s} {count.total:9d} {ratio:11.3f}x {reads:6d}  {top}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=3, default=(8, 512, 1024), help="a layer's input: batch seq width")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--eager", action="store_true", help="count the tempo layers' eager math too")
    parser.add_argument("--models", default="bert,gpt2,llama", help="model files whose steps are counted")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--preset", default="tiny", help="the model files' MEMPLAN_PRESET (gpt2: small, medium)")
    parser.add_argument("--no-layers", dest="layers", action="store_false", help="count the steps only")
    args = parser.parse_args()
    os.environ["MEMPLAN_PRESET"] = args.preset
    shape, dtype = tuple(args.shape), DTYPES[args.dtype]
    if args.layers:
        print(f"launches of one forward + backward on fake CUDA, input {shape}, {args.heads} heads, {args.dtype}")
        print("\n".join(layer_table(shape, args.heads, dtype, args.eager)))
    step_dtype = "bfloat16" if args.dtype == "bf16" else "float32"
    models = [m for m in args.models.split(",") if m]
    print(f"\nlaunches of one training step on fake CUDA ({args.preset} preset), b {args.batch}, s {args.seq}")
    print("\n".join(step_table(models, args.batch, args.seq, step_dtype)))


if __name__ == "__main__":
    main()
