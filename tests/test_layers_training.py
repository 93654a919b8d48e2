"""100 training steps of the small BERT and the small Llama: memplan's layers follow the baseline's losses within 1%
at every step."""

from __future__ import annotations

import functools

import pytest
import torch

from memplan.planner.layers import patch
from memplan.planner.workloads import bert, llama

MODELS = {"bert": bert, "llama": llama}  # llama: RMSNorm, SwiGLU, rotary grouped-query attention


@functools.cache
def losses(model: str, mode: str, steps: int = 100) -> tuple[float, ...]:
    workload = MODELS[model].build_workload(batch_size=2, seq_len=16, seed=11, lr=1e-3)
    patch(workload.model, mode)
    torch.manual_seed(0)  # the same dropout masks in every run
    return tuple(float(workload.step()) for _ in range(steps))


@pytest.mark.parametrize(
    "model, mode",
    [
        ("bert", "tempo"),
        pytest.param("bert", "tempo+selective", marks=pytest.mark.slow),  # the fast lane: one mode per model
        pytest.param("llama", "tempo", marks=pytest.mark.slow),
        ("llama", "tempo+full"),
    ],
)
def test_losses_track_baseline_for_100_steps(model, mode):
    base, other = losses(model, "baseline"), losses(model, mode)
    assert base[-1] < 0.8 * base[0]  # it does train
    assert all(abs(o - b) <= 0.01 * abs(b) for b, o in zip(base, other))
