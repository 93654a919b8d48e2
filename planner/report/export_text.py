"""The text of `memplan export`, a function of its JSON summary."""

from __future__ import annotations

from memplan.units import human_bytes


def render_export(s: dict) -> str:
    """`memplan export`'s text from its summary (its --json): the entries, the final segments, the peaks the
    entries imply, the file and how to open it."""
    actions = ", ".join(f"{count} {action}" for action, count in s["actions"].items())
    actions = f" ({actions})" if actions else ""
    missing = f" ({s['without_entry']} without an entry: 0 bytes, or no byte on the plan)" if s["without_entry"] else ""
    peak = "" if s["peak_entry"] is None else f" at entry {s['peak_entry']}"
    return (
        f"entries: {s['entries']}{actions} for {s['buffers']} buffers{missing}\n"
        f"addresses: {s['addresses']}\n"
        f"segments at the end: {s['segments']}, {human_bytes(s['reserved_bytes'])} reserved, "
        f"{human_bytes(s['allocated_bytes'])} allocated\n"
        f"peak: {human_bytes(s['peak_live_bytes'])} live in tensors{peak}, "
        f"{human_bytes(s['peak_reserved_bytes'])} reserved\n"
        f"written to {s['output']}: open it at https://pytorch.org/memory_viz, or\n"
        f"python -m torch.cuda._memory_viz trace_plot {s['output']} -o {s['output'].removesuffix('.pickle')}.html"
    )
