"""View of `memplan solve`: the plan's figures as text, a function of its summary (its --json)."""

from __future__ import annotations


def render_solve(s: dict) -> str:
    """Buffers, bound, arena, their ratio, the proof and the time, a line each, and where the plan went."""
    status = "optimal" if s["status"] == "optimal" else f"feasible (gap {100 * s['gap']:.3g}%)"
    outside = f" ({s['outside']} outside the step plan)" if s["scope"] != "all" else ""
    lines = [
        f"buffers      {s['buffers']}{outside}",
        f"bound        {s['bound']:,} B ({s['bound_source']})",
        f"arena        {s['arena']:,} B",
        f"arena/bound  {s['ratio']:.4f}",
        f"status       {status}",
        f"seconds      {s['seconds']:.2f} ({s['solver']})",
    ]
    if s["output"]:
        lines.append(f"plan         {s['output']}")
    return "\n".join(lines)
