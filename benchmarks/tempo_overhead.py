"""Host-side cost of one call of each tempo layer: microseconds per forward + backward on tiny tensors (where the
arithmetic is negligible, so what is left is Python, autograd, dispatch and torch.compile's wrappers), against its
native counterpart, with the fused kernels and eagerly.

On a GPU a tempo step is host-bound when these costs exceed its kernels' time; on this CPU they show as they are.
The cases run interleaved (a batch of calls of each in turn, after warm-up calls that compile the kernels), and
each figure is the median over rounds of a batch's time per call.

    .venv/bin/python benchmarks/tempo_overhead.py
    .venv/bin/python benchmarks/tempo_overhead.py --rounds 15 --calls 100
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from memplan.planner.layers import fusion
from memplan.planner.layers.attention import baseline_attention, tempo_attention
from memplan.planner.layers.baseline import SwiGLU
from memplan.planner.layers.gated_mlp import GatedMLP
from memplan.planner.layers.gelu import InplaceGELU
from memplan.planner.layers.layernorm import InplaceLayerNorm
from memplan.planner.layers.rmsnorm import InplaceRMSNorm
from memplan.planner.layers.silu import InplaceSiLU

SHAPE = (4, 8, 64)  # batch, sequence, width: tiny, so compute is negligible
HEADS, DROPOUT = 2, 0.1


def attention_core(core: Callable, heads: int = HEADS) -> Callable[[torch.Tensor], torch.Tensor]:
    """An attention core (tempo's or the baseline's) with dropout, in training, its (batch, seq, width) input split
    into `heads` heads as q, k and v at once."""

    def run(x: torch.Tensor) -> torch.Tensor:
        split = x.reshape(*x.shape[:2], heads, -1).transpose(1, 2)
        return core(split, split, split, None, 0.25, DROPOUT, True)

    return run


def layers(width: int = SHAPE[-1], heads: int = HEADS) -> dict[str, tuple[Callable, Callable]]:
    """Layer name -> (native module, tempo module) of `width` channels (`heads` attention heads), the tempo one
    sharing the native one's parameters."""
    swiglu = SwiGLU(width, 2 * width)
    rmsnorm = nn.RMSNorm(width, eps=1e-6)
    return {
        "LayerNorm": (nn.LayerNorm(width), InplaceLayerNorm.from_layernorm(nn.LayerNorm(width))),
        "RMSNorm": (rmsnorm, InplaceRMSNorm.from_module(rmsnorm)),
        "GELU": (nn.GELU(), InplaceGELU()),
        "SiLU": (nn.SiLU(), InplaceSiLU()),
        "gated MLP": (swiglu, GatedMLP.from_module(swiglu)),
        "attention dropout": (attention_core(baseline_attention, heads), attention_core(tempo_attention, heads)),
    }


def call(module: Callable, x: torch.Tensor) -> None:
    """One forward and backward of `module` on an intermediate copy of `x` (as a layer meets its input in a
    model)."""
    leaf = x.clone().requires_grad_()
    module(leaf * 1).sum().backward()


def per_call(module: Callable, x: torch.Tensor, calls: int, eager: bool) -> float:
    """Seconds per call over a batch of `calls` calls, eagerly or with the fused kernels."""
    with fusion.eager() if eager else contextlib.nullcontext():
        start = time.perf_counter()
        for _ in range(calls):
            call(module, x)
        return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=50, help="calls a batch; a round runs one batch of each case")
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls of each case first (they compile)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randn(SHAPE)
    cases = {}
    built = layers()
    for name, (native, tempo) in built.items():
        cases[name, "native"] = (native, False)
        cases[name, "fused"] = (tempo, False)
        cases[name, "eager"] = (tempo, True)
    for module, eager in cases.values():
        per_call(module, x, args.warmup, eager)
    runs: dict[tuple[str, str], list[float]] = {key: [] for key in cases}
    for _ in range(args.rounds):
        for key, (module, eager) in cases.items():
            runs[key].append(per_call(module, x, args.calls, eager))
    supported = fusion.supported("cpu")
    print(
        f"us per forward+backward, input {SHAPE}, {args.threads} thread(s), median of {args.rounds} rounds of"
        f" {args.calls} calls; fused kernels here: {'yes' if supported else 'no'}"
    )
    print(f"{'layer':18s} {'native':>8s} {'fused':>8s} {'eager':>8s} {'fused/native':>13s} {'eager/native':>13s}")
    for name in built:
        native, fused, eager = (statistics.median(runs[name, kind]) * 1e6 for kind in ("native", "fused", "eager"))
        print(f"{name:18s} {native:8.0f} {fused:8.0f} {eager:8.0f} {fused / native:13.2f} {eager / native:13.2f}")


if __name__ == "__main__":
    main()
