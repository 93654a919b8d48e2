"""Steps traced and counted once for the tests of a module: the product's trace_step and count_step_flops give the
same answer for the same StepSpec every time, so a module whose tests and jobs ask for the same steps again
(optimize's measurements at several memory sizes, a brute force over the assignments it also traces) shares them.

`shared_steps(module, ...)` patches each module's trace_step and count_step_flops (where it imports them) with one
cache for them all, for as long as the context is open; `steps.trace` and `steps.count` are the cached functions
for the test's own calls. Traces and counts are read, never changed, by what takes them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from memplan.planner.cost import flops as flops_module
from memplan.step import StepSpec
from memplan.traces.inputs import trace_model


@dataclass
class SharedSteps:
    """The traces and FLOP counts taken so far, by step."""

    traces: dict[StepSpec, object] = field(default_factory=dict)
    counts: dict[StepSpec, object] = field(default_factory=dict)

    def trace(self, step: StepSpec, **options):
        """trace_step(step), taken the first time it is asked for (`options` only say how to report progress)."""
        if step not in self.traces:
            self.traces[step] = trace_model.trace_step(step, **options)
        return self.traces[step]

    def count(self, step: StepSpec):
        """count_step_flops(step), counted the first time it is asked for."""
        if step not in self.counts:
            self.counts[step] = flops_module.count_step_flops(step)
        return self.counts[step]


@contextmanager
def shared_steps(*modules) -> Iterator[SharedSteps]:
    """One cache of traces and counts, patched into each of `modules` that calls trace_step or count_step_flops."""
    steps = SharedSteps()
    with pytest.MonkeyPatch.context() as patch:
        for module in modules:
            if hasattr(module, "trace_step"):
                patch.setattr(module, "trace_step", steps.trace)
            if hasattr(module, "count_step_flops"):
                patch.setattr(module, "count_step_flops", steps.count)
        yield steps
