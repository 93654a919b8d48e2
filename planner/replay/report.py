"""The result of a replay: the allocator's counters, the measured peak and the bitwise comparison."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class ReplayReport:
    """What `memplan replay` measured; bytes and counts over all replayed steps."""

    workload: str
    device: str
    steps: int
    reference: str              # the allocator of the reference run
    planned_per_step: int       # allocations the plan places in one step
    arena_bytes: int            # the plan's arena, reserved for the replay
    bound: int                  # the plan's lower bound (max-live of its trace)
    planned_count: int          # allocations served at their planned offset
    fallback_count: int         # allocations served by the system allocator instead
    fallback_bytes: int
    fallback_peak: int          # most fallback bytes live at once
    refused_in_use: int         # fallbacks whose planned range overlapped a live block
    size_mismatch: int          # fallbacks whose size differed from the plan's
    extra: int                  # fallbacks beyond the plan's allocations of a step
    missing: int                # planned allocations that never came
    arena_top_peak: int         # highest arena byte in use (slots of pre-existing buffers included)
    peak_bytes: int             # most of (arena top + fallback bytes live) at once
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
        mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
        lines = [
            f"replayed {self.steps} step(s) of {self.workload} on {self.device}",
            f"  arena            {mib(self.arena_bytes)} ({self.arena_bytes} B; plan bound {self.bound} B)",
            f"  planned          {self.planned_count} allocation(s) ({self.planned_per_step} per step)",
            f"  fallbacks        {self.fallback_count} allocation(s), {self.fallback_bytes} B "
            f"(in use {self.refused_in_use}, size {self.size_mismatch}, extra {self.extra}; "
            f"planned but missing {self.missing})",
            f"  peak             {mib(self.peak_bytes)} ({self.peak_bytes} B = arena top {self.arena_top_peak} "
            f"+ fallback live at that moment)",
            f"  bitwise equal    {'yes' if self.bitwise_equal else 'NO: first difference at ' + str(self.first_difference)}"
            f" (loss, every gradient, parameters after {self.steps} step(s); reference: {self.reference})",
        ]
        return "\n".join(lines)
