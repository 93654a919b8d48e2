"""The plan allocator behind PyTorch's CPU allocator for a block of replayed steps.

`with CPUPlanAllocator(schedule) as alloc:` installs it (c10::SetCPUAllocator) and restores the
previous allocator on exit; `with alloc.adopt():` opens the adoption of reserved slots and
`with alloc.step():` one planned step. Tensors made inside keep their own deleter, so they stay
valid after the steps and after the plan is released.
"""

from __future__ import annotations

from contextlib import contextmanager

from memplan.planner.layers import fusion
from memplan.planner.replay import build
from memplan.planner.replay.native import INVALID_PLAN, INVALID_PLAN_MESSAGE, STATS_FIELDS
from memplan.planner.replay.schedule import ReplayError, Schedule


class CPUPlanAllocator:
    """One plan's arena on the CPU; counters readable with stats() until the context exits."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule
        self.ext = build.cpu_extension()
        self.handle = 0
        self.arena_base = 0  # address of the arena's first byte while the plan is alive
        self.final_stats: dict[str, int] | None = None

    def __enter__(self) -> CPUPlanAllocator:
        s = self.schedule
        self.handle = self.ext.create(s.offsets, s.sizes, s.reserved_offsets, s.reserved_sizes, s.arena, s.alignment)
        if self.handle == INVALID_PLAN:
            raise ReplayError(INVALID_PLAN_MESSAGE)
        if self.handle == 0:
            raise ReplayError(f"cannot allocate an arena of {s.arena} bytes")
        self.arena_base = self.ext.arena_base(self.handle)
        self.ext.install()
        return self

    def step(self):
        """The block inside is one planned step."""
        return self._open(self.ext.begin_step, self.ext.end_step)

    def adopt(self):
        """Allocations in the block inside take the reserved slots of their exact size."""
        return self._open(self.ext.begin_adopt, self.ext.end_adopt)

    @contextmanager
    def _open(self, begin, end):
        if not begin(self.handle):
            raise ReplayError("a planned step or adoption is already open")
        try:
            with fusion.eager():  # the eager math, as the trace recorded it (planner/layers/fusion.py)
                yield
        finally:
            end(self.handle)

    def stats(self) -> dict[str, int]:
        if self.final_stats is not None:
            return dict(self.final_stats)
        return dict(zip(STATS_FIELDS, self.ext.stats(self.handle)))

    def __exit__(self, *exc) -> None:
        self.ext.restore()
        self.final_stats = self.stats()
        self.ext.release(self.handle)
