"""Each rank's trace of a distributed step, traced once for every test of a session that reads the same one: the
distributed tests (pipeline, ZeRO, FSDP2 x TP, FSDPMemTracker) ask for the same fake steps in several tests, and a
gloo step starts real processes. `conftest.traced_ranks` hands tests a `RankTraces`."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from memplan.step import StepSpec
from memplan.traces.format import Trace
from memplan.traces.ranks.family import traces_by_rank
from memplan.traces.ranks.launch import trace_ranks


class RankTraces:
    """Traces `trace_ranks` wrote, kept by (step, ranks, the MEMPLAN_* settings the model files read): the same
    step under the same settings is the same trace, so it is traced once; tests read the traces, never change them."""

    def __init__(self, folder: Callable[[], Path]) -> None:
        self.folder = folder  # a new empty folder for each traced step
        self.traced: dict[tuple, list[Trace]] = {}

    def __call__(self, step: StepSpec, nproc: int) -> list[Trace]:
        """Each rank's trace of `step` on `nproc` ranks (fake: one process; else real gloo processes), under the
        MEMPLAN_* settings in the environment now."""
        settings = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("MEMPLAN_")))
        key = (step, nproc, settings)
        if key not in self.traced:
            output = self.folder() / "trace.json.gz"
            trace_ranks(step, output, nproc)
            self.traced[key] = traces_by_rank(output)  # a trace standing for several alike ranks is each's
        return self.traced[key]
