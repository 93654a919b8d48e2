"""View of `memplan replay`: what the replay measured, as text, a function of its summary (its --json)."""

from __future__ import annotations

from memplan.units import human_bytes


def render_replay(r: dict) -> str:
    """The arena, adoption, fallbacks, the measured peak and the bitwise comparison, a line each."""
    equal = "yes" if r["bitwise_equal"] else f"NO: first difference at {r['first_difference']}"
    lines = [
        f"replayed {r['steps']} step(s) of {r['workload']} on {r['device']}",
        f"  arena            {human_bytes(r['arena_bytes'], unit='MiB')} ({r['arena_bytes']} B; "
        f"plan bound {r['bound']} B)",
        f"  adopted          {r['adopted_count']} of {r['reserved_count']} reserved slot(s), "
        f"{r['adopted_bytes']} of {r['reserved_bytes']} B (storages that exist for the whole step, moved "
        f"into the arena before the steps)",
        f"  outside          {r['outside_bytes']} B (resident storages still held outside the arena)",
        f"  planned          {r['planned_count']} allocation(s) ({r['planned_per_step']} per step)",
        f"  fallbacks        {r['fallback_count']} allocation(s), {r['fallback_bytes']} B, at most "
        f"{r['fallback_peak']} B live at once (in use {r['refused_in_use']}, size {r['size_mismatch']}, "
        f"extra {r['extra']}, no slot to adopt {r['no_slot']}; planned but missing {r['missing']})",
        f"  arena top        {human_bytes(r['arena_top_peak'], unit='MiB')} ({r['arena_top_peak']} B: "
        f"highest arena byte held by a live block, adopted or planned)",
        f"  peak             {human_bytes(r['peak_bytes'], unit='MiB')} ({r['peak_bytes']} B: "
        f"most of arena top + fallback live at once, plus outside)",
        f"  bitwise equal    {equal}"
        f" (loss, every gradient, parameters after {r['steps']} step(s); reference: {r['reference']})",
    ]
    return "\n".join(lines)
