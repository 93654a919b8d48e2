"""Kernel launches of a layer's forward and backward, or of a whole training step, on fake CUDA: what a GPU's host
must issue (planner/layers/launches.py says how they are counted), on any machine.

A step on a GPU is host-bound when its host cannot issue the launches as fast as the GPU runs them; the count
tells, without a GPU, whether a layer mode adds launches, and the host reads (`nonzero`, `item`) that make the
host wait for the GPU's queue.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from memplan.planner.layers.launches import LaunchCount, counting
from memplan.step import StepSpec
from memplan.traces.capture import recording_session
from memplan.traces.inputs.model_file import load_workload


def count_launches(build: Callable[[], Any], run: Callable[[Any], Any], *, fused: bool = True) -> LaunchCount:
    """`build()` under fake CUDA tensors (uncounted), then `run(built)` counted: its launches and host reads on
    the device, the tempo layers' fused kernels taken to run (`fused`) or their eager math counted."""
    with recording_session("cuda", fake=True):
        built = build()
        with counting("cuda", fused) as count:
            run(built)
    return count


def forward_backward(module: Callable, x: torch.Tensor) -> None:
    """One forward and backward of `module` on an intermediate of `x` (as a layer meets its input in a model),
    its output's gradient ones, into gradients set to None first (as a training step's are)."""
    for t in [x, *(module.parameters() if isinstance(module, torch.nn.Module) else ())]:
        t.grad = None
    out = module(x * 1)
    out.backward(torch.ones_like(out))


def layer_launches(make: Callable[[], Callable], shape: tuple[int, ...], dtype: torch.dtype, fused: bool = True):
    """The launches of one forward and backward of the module `make()` returns (made on fake CUDA, in `dtype`) on
    a `shape` input, after one uncounted call (a layer's first call finds what later calls remember)."""

    def build():
        module = make()
        if isinstance(module, torch.nn.Module):
            module = module.to("cuda", dtype)
        x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
        forward_backward(module, x)
        return module, x

    return count_launches(build, lambda built: forward_backward(*built), fused=fused)


def step_launches(step: StepSpec, fused: bool = True) -> LaunchCount:
    """The launches of one training step of `step`'s model file (forward, backward, optimizer) on fake CUDA,
    after one uncounted step (the optimizer's state made)."""

    def build():
        workload = load_workload(step.replace(device="cuda", fake=True))
        workload.step()
        return workload

    return count_launches(build, lambda workload: workload.step(), fused=fused)
