"""Reversible GPT-2 against the baseline GPT-2 and GPT-2 with full checkpointing: peak live bytes, bytes held for
backward and step time, at GPT-2 small's layer shape and several depths.

The vocabulary is 1024, not GPT-2's 50257, so the language-model head (its logits and their gradient) does not
dominate the peak the layers are compared on. Targets at the deepest stack: the reversible model holds at most a
quarter of the baseline's bytes for backward, and its step takes at most 1.5x the baseline's.

    .venv/bin/python benchmarks/reversible.py
    .venv/bin/python benchmarks/reversible.py --layers 4 --seq 128 --steps 3
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import torch

from memplan.planner.cost import time_workloads
from memplan.planner.layers import patch
from memplan.planner.layers.memory import LayerShape, held_for_backward, reversible_formula
from memplan.planner.workloads import gpt2
from memplan.planner.workloads.reversible import build_gpt2_workload
from memplan.traces.capture import capture_step
from memplan.traces.inputs.workload import Workload

VOCABULARY = 1024
HELD_TARGET, TIME_TARGET = 0.25, 1.5  # reversible against baseline at the deepest stack


def checkpointed_workload(batch_size, seq_len, config) -> Workload:
    """The baseline GPT-2 with every layer checkpointed (`patch(model, "full")`)."""
    workload = gpt2.build_workload(batch_size, seq_len, config=config)
    patch(workload.model, "full")
    return workload


VARIANTS: dict[str, Callable[..., Workload]] = {
    "baseline": gpt2.build_workload,
    "full": checkpointed_workload,
    "reversible": build_gpt2_workload,
}


@dataclasses.dataclass(frozen=True)
class Measured:
    """One variant at one depth: peak live bytes and bytes held for backward of a traced step, median step time."""

    peak: int
    held: int
    seconds: float


def measure(config: gpt2.GPT2Config, batch: int, seq: int, steps: int) -> dict[str, Measured]:
    """Every variant of `config`: a traced step each, then their interleaved step times."""
    traces = {name: capture_step(lambda b=build: b(batch, seq, config=config)) for name, build in VARIANTS.items()}
    times = time_workloads({name: build(batch, seq, config=config) for name, build in VARIANTS.items()}, repeats=steps)
    return {n: Measured(trace.peak()[0], held_for_backward(trace), times[n].median) for n, trace in traces.items()}


def stack_against_formula(results: dict[int, dict[str, Measured]], shape: LayerShape) -> None:
    """The reversible stack's own bytes held for backward (the model's, less those of the model outside the layers:
    the baseline's extrapolated to zero layers) next to `reversible_formula`."""
    (shallow, first), (deep, second) = sorted(results.items())[:2]
    per_layer = (second["baseline"].held - first["baseline"].held) / (deep - shallow)
    outside = round(first["baseline"].held - shallow * per_layer)
    print(f"reversible stack alone (held less {outside:,} B outside the layers) against reversible_formula:")
    for layers, measured in results.items():
        formula = reversible_formula(shape, layers, extra=shape.s * shape.s * shape.p)  # the causal mask
        stack = measured["reversible"].held - outside
        print(f"{layers:>6} layers {stack:>14,} measured {formula.held:>14,} formula {stack / formula.held:>8.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 8, 12])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant, interleaved")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    small = gpt2.SMALL
    shape = LayerShape(s=args.seq, b=args.batch, h=small.hidden, a=small.heads, p=4)
    print(
        f"GPT-2 small's layer shape (h {small.hidden}, {small.heads} heads), vocabulary {VOCABULARY} (not "
        f"{small.vocab_size}: the LM head would dominate the peak), b={args.batch} s={args.seq} fp32, cpu, "
        f"{args.threads} thread(s), median of {args.steps} interleaved steps"
    )
    print(
        f"{'layers':>6} {'model':>10} {'peak live':>14} {'held for bwd':>14} {'step':>9} "
        f"{'peak/base':>9} {'held/base':>9} {'time/base':>9}"
    )
    results = {}
    for layers in args.layers:
        config = dataclasses.replace(small, vocab_size=VOCABULARY, layers=layers)
        results[layers] = measure(config, args.batch, args.seq, args.steps)
        base = results[layers]["baseline"]
        for name, m in results[layers].items():
            print(
                f"{layers:>6} {name:>10} {m.peak:>14,} {m.held:>14,} {m.seconds * 1e3:>7.0f}ms "
                f"{m.peak / base.peak:>9.3f} {m.held / base.held:>9.3f} {m.seconds / base.seconds:>8.3f}x",
                flush=True,
            )
    if len(results) > 1:
        stack_against_formula(results, shape)
    deepest = max(args.layers)
    base, rev = results[deepest]["baseline"], results[deepest]["reversible"]
    held_ratio, time_ratio = rev.held / base.held, rev.seconds / base.seconds
    verdict = "PASS" if held_ratio <= HELD_TARGET and time_ratio <= TIME_TARGET else "FAIL"
    print(
        f"{verdict}: at {deepest} layers the reversible model holds {held_ratio:.3f} of the baseline's bytes for "
        f"backward (target <= {HELD_TARGET}) and steps in {time_ratio:.3f}x its time (target <= {TIME_TARGET}x)"
    )


if __name__ == "__main__":
    main()
