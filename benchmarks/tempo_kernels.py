"""Step time of memplan's tempo layers with their elementwise math fused by torch.compile, and eagerly, against
the baseline's, on a GPT-2-small-shaped model (h 768, 12 heads; fewer layers and a small vocabulary by default so
a CPU step takes under a second) with real tensors.

The three steps run interleaved (one of each in turn, planner/cost/timing.py), after warm-up rounds that create
the optimizer state and compile the kernels; each ratio is taken round by round (tempo's run i over the baseline's
run i, which ran side by side) and printed as the median with the lowest and highest, then as the ratio of the
two medians and of the two fastest runs (on a shared machine, other work only ever adds time). The eager side runs the
same tempo model under `fusion.eager()` (what MEMPLAN_FUSED=0 gives everywhere).

    .venv/bin/python benchmarks/tempo_kernels.py
    .venv/bin/python benchmarks/tempo_kernels.py --layers 12 --seq 256 --dtype bf16 --rounds 7
    python benchmarks/tempo_kernels.py --device cuda --layers 12 --seq 1024 --batch 8 --dtype bf16
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from memplan.planner.cost import time_workloads
from memplan.planner.layers import fusion, patch
from memplan.planner.workloads import gpt2
from memplan.traces.inputs.workload import Workload

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass
class EagerMath(Workload):
    """A workload whose step runs the tempo layers' math eagerly (`fusion.eager()`)."""

    def step(self) -> torch.Tensor:
        with fusion.eager():
            return super().step()


def build(mode: str, args: argparse.Namespace) -> Workload:
    """The GPT-2-shaped workload of the arguments, patched with `mode`, its weights and tokens from one seed."""
    config = dataclasses.replace(gpt2.SMALL, vocab_size=args.vocab, layers=args.layers)
    workload = gpt2.build_workload(
        batch_size=args.batch, seq_len=args.seq, dtype=DTYPES[args.dtype], device=args.device, config=config
    )
    patch(workload.model, mode)
    return workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    second = build("tempo", args)  # a model of its own, the same weights
    eager = EagerMath(**{f.name: getattr(second, f.name) for f in dataclasses.fields(Workload)})
    workloads = {"baseline": build("baseline", args), "tempo fused": build("tempo", args), "tempo eager": eager}
    supported = fusion.supported(torch.device(args.device).type)
    print(
        f"GPT-2 shape h 768, 12 heads, {args.layers} layers, vocab {args.vocab}, batch {args.batch}, seq {args.seq},"
        f" {args.dtype}, {args.device}, {args.threads} thread(s); fused kernels here: {'yes' if supported else 'no'}"
    )
    times = time_workloads(workloads, device=args.device, repeats=args.rounds, warmup=args.warmup)
    base = times["baseline"]
    for name, t in times.items():
        line = f"{name:12s} median {t.median * 1e3:8.1f} ms  (runs {t.low * 1e3:.1f} .. {t.high * 1e3:.1f})"
        if name != "baseline":
            ratios = [run / b for run, b in zip(t.runs, base.runs)]
            line += f"  ratio to baseline {statistics.median(ratios):.3f} ({min(ratios):.3f} .. {max(ratios):.3f})"
            line += f", of the medians {t.median / base.median:.3f}, of the fastest runs {t.low / base.low:.3f}"
        print(line)


if __name__ == "__main__":
    main()
