"""The result of a replay: adoption, the allocator's counters, the measured peak and the bitwise comparison."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from memplan.units import human_bytes


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

    def text(self) -> str:
        lines = [
            f"replayed {self.steps} step(s) of {self.workload} on {self.device}",
            f"  arena            {human_bytes(self.arena_bytes, unit='MiB')} ({self.arena_bytes} B; "
            f"plan bound {self.bound} B)",
            f"  adopted          {self.adopted_count} of {self.reserved_count} reserved slot(s), "
            f"{self.adopted_bytes} of {self.reserved_bytes} B (storages that exist for the whole step, moved "
            f"into the arena before the steps)",
            f"  outside          {self.outside_bytes} B (resident storages still held outside the arena)",
            f"  planned          {self.planned_count} allocation(s) ({self.planned_per_step} per step)",
            f"  fallbacks        {self.fallback_count} allocation(s), {self.fallback_bytes} B, at most "
            f"{self.fallback_peak} B live at once (in use {self.refused_in_use}, size {self.size_mismatch}, "
            f"extra {self.extra}, no slot to adopt {self.no_slot}; planned but missing {self.missing})",
            f"  arena top        {human_bytes(self.arena_top_peak, unit='MiB')} ({self.arena_top_peak} B: "
            f"highest arena byte held by a live block, adopted or planned)",
            f"  peak             {human_bytes(self.peak_bytes, unit='MiB')} ({self.peak_bytes} B: "
            f"most of arena top + fallback live at once, plus outside)",
            f"  bitwise equal    {'yes' if self.bitwise_equal else f'NO: first difference at {self.first_difference}'}"
            f" (loss, every gradient, parameters after {self.steps} step(s); reference: {self.reference})",
        ]
        return "\n".join(lines)
