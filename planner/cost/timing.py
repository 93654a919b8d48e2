"""Measured wall time of one training step of a model file: the time side of a memory/compute trade-off.

FLOPs (planner/cost/flops.py) say how much work recomputation adds; only a clock shows what that work costs
on a device, where memory-bound elementwise work and matmuls run at very different rates. The step runs
on real tensors with the torch threads the caller set. It is timed with `time.perf_counter` after
warm-up steps, which create the optimizer state and compile. On CUDA the device is synchronised around
each step, so the time covers its kernels and not only their launches. The median of several runs
damps the machine's noise; several workloads timed together run interleaved (one step of each in turn), so
a drift in the machine's speed falls on all of them alike and run i of each can be compared side by side.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from memplan.planner.cost.flops import CostError, checked_step
from memplan.step import StepSpec
from memplan.traces.compile import Compile, compile_model
from memplan.traces.inputs.model_file import load_workload
from memplan.traces.inputs.workload import Workload


@dataclass(frozen=True)
class StepTime:
    """Wall time of a training step: the median of the timed runs, and each run, in seconds."""

    median: float
    runs: list[float]

    @property
    def low(self) -> float:
        """The fastest run."""
        return min(self.runs)

    @property
    def high(self) -> float:
        """The slowest run."""
        return max(self.runs)


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels (CUDA); the CPU runs its ops as they are called."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_workload(step: StepSpec) -> Workload:
    """The step's workload built on real tensors to be timed, compiled if the step says so (the first warm-up step
    compiles it)."""
    if step.fake:
        raise CostError("a step is timed on real tensors: fake ones compute nothing")
    workload = load_workload(step)
    if step.compile is not None:
        compile_model(workload.model, Compile(step.compile))
    return workload


def time_step(step: StepSpec, *, repeats: int = 5, warmup: int = 2) -> StepTime:
    """Wall time of one training step (on real tensors, compiled as the step says): `warmup` untimed steps, then
    the median of `repeats` timed ones."""
    _check_runs(repeats, warmup)
    workload = timed_workload(step)
    # Warm-up steps (the optimizer state created, the model compiled), then the timed ones.
    return time_workloads({"step": workload}, device=step.device, repeats=repeats, warmup=warmup)["step"]


def _check_runs(repeats: int, warmup: int) -> None:
    if repeats < 1 or warmup < 0:
        raise CostError(f"repeats {repeats}, warmup {warmup}: time at least 1 step after 0 or more warm-up steps")


def time_workloads(
    workloads: Mapping[str, Workload], *, device: str = "cpu", repeats: int = 5, warmup: int = 1
) -> dict[str, StepTime]:
    """Wall time of each workload's training step, the steps interleaved (one of each in turn) so that drift in the
    machine's speed falls on all of them alike: `warmup` untimed rounds, then the median of `repeats` timed ones.
    Each StepTime's runs are in round order, so run i of two workloads ran side by side."""
    _check_runs(repeats, warmup)
    dev = torch.device(device)
    for _ in range(warmup):
        for workload in workloads.values():
            checked_step(workload, "warm-up step")
    runs: dict[str, list[float]] = {name: [] for name in workloads}
    for _ in range(repeats):
        for name, workload in workloads.items():
            _synchronize(dev)
            start = time.perf_counter()
            checked_step(workload, "timed step")
            _synchronize(dev)
            runs[name].append(time.perf_counter() - start)
    return {name: StepTime(statistics.median(times), times) for name, times in runs.items()}
