"""How faithful a predicted trace is to a real one (a CUDA snapshot's): its peak, the simulator's peak reserved on it,
and how many of the real step's allocations it makes in the same order with the same size."""

from __future__ import annotations

import contextlib
import difflib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from memplan.gpus import gpu
from memplan.planner.simulate.caching_allocator import simulate_caching
from memplan.step import StepSpec
from memplan.traces.format import Trace, load
from memplan.traces.inputs.trace_model import trace_step
from memplan.traces.ranks.launch import rank_path, trace_ranks


@dataclass(frozen=True)
class Fidelity:
    """A prediction of one step against the real step."""

    real_peak: int  # bytes live at the real step's peak (requested bytes)
    peak: int  # the prediction's peak live
    real_reserved: int  # the real step's peak reserved bytes
    reserved: int  # the caching-allocator simulator's peak reserved on the prediction
    allocations: int  # the real step's allocations
    in_order: int  # of those, how many the prediction makes in the same order with the same size

    @property
    def peak_error(self) -> float:
        """The prediction's peak against the real one, as a fraction (+0.01: 1% over)."""
        return self.peak / self.real_peak - 1

    @property
    def reserved_error(self) -> float:
        return self.reserved / self.real_reserved - 1

    @property
    def in_order_share(self) -> float:
        return self.in_order / self.allocations if self.allocations else 1.0


def sizes_in_order(trace: Trace, outputs_only: bool = False) -> list[int]:
    """Sizes of the step's allocations in order; with `outputs_only`, of those some op returned (not internal)."""
    return [int(trace.size[i]) for i in trace.recorded if not (outputs_only and trace.internal[i])]


def reproduced(real: list[int], predicted: list[int]) -> int:
    """How many of the real sizes the predicted ones make in the same order (their longest common subsequence,
    as difflib's matching blocks count it)."""
    matcher = difflib.SequenceMatcher(a=real, b=predicted, autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks())


def fidelity(real: Trace, predicted: Trace, real_reserved: int) -> Fidelity:
    """The prediction against the real trace, whose step reserved `real_reserved` bytes at its peak."""
    real_sizes = sizes_in_order(real)
    return Fidelity(
        real_peak=real.peak()[0],
        peak=predicted.peak()[0],
        real_reserved=real_reserved,
        reserved=simulate_caching(predicted).peak_reserved,
        allocations=len(real_sizes),
        in_order=reproduced(real_sizes, sizes_in_order(predicted)),
    )


@dataclass(frozen=True)
class RecordedStep:
    """A real CUDA snapshot of one training step and how it was made (benchmarks/record_snapshots.py writes
    NAME.pickle and NAME.json)."""

    name: str
    snapshot: Path  # NAME.pickle: the recorded step, from the warm-up step's cache
    step: StepSpec  # the step as memplan traces it (on cuda, for the GPU it ran on)
    env: dict  # the model file's environment (MEMPLAN_PRESET, ...)
    nproc: int  # 1: the model file runs in a one-rank process group
    reserved_from_empty: int  # peak reserved of the step started from an emptied cache (the simulator's start)
    facts: dict  # the whole NAME.json


def recorded_steps(folder: str | Path, root: str | Path) -> list[RecordedStep]:
    """The recorded steps in `folder`, their model files under `root` (the repository), in name order."""
    steps = []
    for facts_path in sorted(Path(folder).glob("*.json")):
        facts = json.loads(facts_path.read_text())
        recording = facts["recording"]
        step = StepSpec(
            str(Path(root) / recording["model_file"]),
            recording["batch"],
            recording["seq"],
            recording["dtype"],
            device="cuda",
            mode=recording["layers"],
            gpu=gpu(facts["gpu"]),  # torch's name for it, one of the catalogue's aliases
            warmup=recording.get("warmup", True),
        )
        # the step from an emptied cache, as the simulator starts; a first step started from one
        reserved = facts["from_empty_cache" if step.warmup else "recorded_step"]["at_end"]["reserved_peak"]
        snapshot = facts_path.with_suffix(".pickle")
        steps.append(
            RecordedStep(facts_path.stem, snapshot, step, recording["env"], recording["nproc"], reserved, facts)
        )
    return steps


@contextlib.contextmanager
def _environment(values: dict) -> Iterator[None]:
    """os.environ with `values` set (a None value unset) for the block, then as it was."""
    saved = {name: os.environ.get(name) for name in values}

    def put(name: str, value: str | None) -> None:
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value

    try:
        for name, value in values.items():
            put(name, value)
        yield
    finally:
        for name, value in saved.items():
            put(name, value)


def predict(recorded: RecordedStep) -> Trace:
    """The recorded step traced here by `--fake --device cuda` for the GPU it ran on (a one-rank fake process group
    for a distributed model file), with the model file's environment and the cuBLAS workspace setting it ran with."""
    step = recorded.step.replace(fake=True)
    with _environment({**recorded.env, "CUBLAS_WORKSPACE_CONFIG": recorded.facts["cublas_workspace_config"]}):
        if not recorded.nproc:
            return trace_step(step)
        with tempfile.TemporaryDirectory() as folder:
            trace_ranks(step, Path(folder) / "rank.json.gz", recorded.nproc)
            return load(rank_path(Path(folder) / "rank.json.gz", 0))
