"""Bytes per layer measured by the tracer (stacks of L and L+1 layers) against REFERENCE §1's formulas."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from lanes import diagonal, named

from memplan.planner.layers import patch
from memplan.planner.layers.memory import LayerShape, held_for_backward
from memplan.planner.workloads import bert
from memplan.traces.capture import capture_step

H, A = 64, 4
SHAPES = {1: (16, 16), 4: (64, 4)}  # as/h -> (seq, batch)


def held_per_layer(mode: str, dtype: torch.dtype, seq: int, batch: int) -> int:
    held = []
    for layers in (1, 2):
        config = dataclasses.replace(bert.TINY, layers=layers, hidden=H, heads=A)

        def build(config=config):
            workload = bert.build_workload(batch_size=batch, seq_len=seq, dtype=dtype, config=config)
            patch(workload.model, mode)
            return workload

        held.append(held_for_backward(capture_step(build)))
    return held[1] - held[0]


@pytest.mark.parametrize(
    "mode, dtype, as_over_h",
    diagonal(
        named(["baseline", "tempo", "selective", "tempo+selective"]),
        {"fp32": torch.float32, "bf16": torch.bfloat16},
        named([1, 4]),
    ),
)
def test_layer_bytes_within_2_percent_of_formula(mode, dtype, as_over_h):
    seq, batch = SHAPES[as_over_h]
    assert A * seq // H == as_over_h
    formula = LayerShape(s=seq, b=batch, h=H, a=A, p=torch.finfo(dtype).bits // 8).formula(mode)
    measured = held_per_layer(mode, dtype, seq, batch)
    # The allowed excess is LayerNorm's mean/rstd (and the CPU generator state under selective recomputation).
    assert formula <= measured <= 1.02 * formula
