"""Step times of layer modes measured on real GPUs (measured_times.json): what a mode costs on that GPU, where
FLOPs miss it (a tempo step on an H200 was host-bound: 2.4x the baseline's time for a few percent more FLOPs).

A measurement is matched exactly: the GPU the step is planned for, the workload's name (its family, layers and
width: `gpt2-12x768`), sequence, batch and dtype. Its modes' times against its baseline's give each mode's added
seconds a layer, which `memplan optimize` prices the mode's layers at instead of their recompute FLOPs, and which
`memplan tradeoff` shows beside its points; anything unmatched keeps the FLOP estimate.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from memplan.modes import AS_BUILT, BASELINE

TABLE = Path(__file__).resolve().parent / "measured_times.json"
REFERENCES = (BASELINE, AS_BUILT)  # the mode a measurement's others are timed against, the first it has


@dataclass(frozen=True)
class MeasuredTimes:
    """One measurement: seconds per step of each mode measured for a GPU, model, shape and dtype, and whence."""

    date: str
    gpu: str
    torch: str
    model: str
    seq: int
    batch: int
    dtype: str
    seconds: dict[str, float]  # mode -> seconds per training step
    source: str

    @property
    def reference(self) -> str | None:
        """The mode the others are timed against (baseline, else as-built), or None without one."""
        return next((mode for mode in REFERENCES if mode in self.seconds), None)

    def added_per_layer(self, mode: str, layers: int) -> float | None:
        """Seconds `mode` adds a step per layer over the reference (as-built's time taken as the baseline's), or
        None when `mode` was not measured."""
        if mode not in self.seconds or self.reference is None or layers < 1:
            return None
        return (self.seconds[mode] - self.seconds[self.reference]) / layers

    def label(self) -> str:
        """What and where: `measured on H200, 2026-11-26, torch 2.11.0+cu130`."""
        return f"measured on {self.gpu}, {self.date}, torch {self.torch}"

    def describe(self) -> str:
        """The measurement in one line: its label, shape and each mode's milliseconds."""
        times = ", ".join(f"{mode} {seconds * 1e3:.1f} ms" for mode, seconds in self.seconds.items())
        return f"{self.label()}: {self.model} s{self.seq} b{self.batch} {self.dtype}: {times} ({self.source})"

    def as_dict(self) -> dict:
        """The measurement as plain data (a command's --json)."""
        return {
            "date": self.date,
            "gpu": self.gpu,
            "torch": self.torch,
            "model": self.model,
            "seq": self.seq,
            "batch": self.batch,
            "dtype": self.dtype,
            "seconds": dict(self.seconds),
            "source": self.source,
        }


@functools.cache
def measurements() -> tuple[MeasuredTimes, ...]:
    """Every measurement of the table, as read once."""
    rows = json.loads(TABLE.read_text())["measurements"]
    fields = MeasuredTimes.__dataclass_fields__
    return tuple(MeasuredTimes(**{k: v for k, v in row.items() if k in fields}) for row in rows)


def measured_times(gpu: str | None, model: str | None, seq: int, batch: int, dtype: str) -> MeasuredTimes | None:
    """The measurement for a step of workload `model` at `seq`, `batch` and `dtype` on GPU `gpu` (the catalogue's
    name), or None (no GPU named, or none measured there for that shape)."""
    if gpu is None or model is None:
        return None
    key = (gpu, model, seq, batch, dtype)
    return next((m for m in measurements() if (m.gpu, m.model, m.seq, m.batch, m.dtype) == key), None)
