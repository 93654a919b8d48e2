"""The result of a replay: adoption, the allocator's counters, the measured peak and the bitwise comparison."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class ReplayReport:
    """What `memplan replay` measured; bytes and counts over all replayed steps."""

    workload: str
    device: str
    steps: int
    reference: str  # the allocator of the reference run
    planned_per_step: int  # allocations the plan places in one step
    arena_bytes: int  # the plan's arena, reserved for the replay
    bound: int  # the plan's lower bound (max-live of its trace)
    reserved_count: int  # slots the plan gives buffers that exist for the whole step
    reserved_bytes: int  # their requested bytes
    adopted_count: int  # resident storages moved into a reserved slot before the steps
    adopted_bytes: int  # their bytes
    outside_bytes: int  # resident storages' bytes still held outside the arena (no slot, held elsewhere)
    planned_count: int  # step allocations served at their planned offset
    fallback_count: int  # requests (in a step or adoption) served by the system allocator instead
    fallback_bytes: int
    fallback_peak: int  # most fallback bytes live at once
    refused_in_use: int  # fallbacks whose planned or reserved range overlapped a live block
    size_mismatch: int  # fallbacks whose size differed from the plan's
    extra: int  # fallbacks beyond the plan's allocations of a step
    no_slot: int  # adoption fallbacks: no reserved slot of that size left
    missing: int  # planned allocations that never came
    arena_top_peak: int  # highest arena byte held by a live block (adopted or planned)
    peak_bytes: int  # most of (arena top + fallback bytes live) at once, plus outside_bytes
    loss_equal: bool
    grads_equal: bool
    params_equal: bool
    first_difference: str | None
    plan_step_seconds: list[float]
    reference_step_seconds: list[float]

    @property
    def bitwise_equal(self) -> bool:
        return self.loss_equal and self.grads_equal and self.params_equal

    def summary(self) -> dict:
        """The JSON-ready summary (every field plus bitwise_equal)."""
        return {**asdict(self), "bitwise_equal": self.bitwise_equal}
