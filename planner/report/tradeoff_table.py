"""View of `memplan tradeoff`: its table for the terminal, a function of the job's summary (its --json)."""

from __future__ import annotations

from memplan.planner.report.trace_text import no_change_mark
from memplan.units import human_bytes


def point_label(point: dict) -> str:
    """A point's name, marked when it is a layer mode that changed nothing in this model."""
    plain = point["compile_budget"] is None and point["variant"] is None
    return point["name"] + no_change_mark(point["layers"], point["changed"]) if plain else point["name"]


def render_tradeoff(summary: dict) -> str:
    """The trade-off table for the terminal, each point's frontiers named."""
    points = summary["points"]
    lines = [
        f"{'configuration':<28}{'peak live':>12}{'plan arena':>12}{'caching res.':>14}"
        f"{'extra FLOPs':>13}{'step time':>11}  frontier",
    ]
    for p in points:
        percent = 100 * p["extra_flops"] / points[0]["flops"]
        ratio = "-" if p["time_ratio"] is None else f"{p['time_ratio']:.2f}x"
        frontier = " ".join(k for k, on in (("FLOPs", p["pareto_flops"]), ("time", p["pareto_time"])) if on)
        lines.append(
            f"{point_label(p):<28}{human_bytes(p['peak_live']):>12}{human_bytes(p['plan_arena']):>12}"
            f"{human_bytes(p['caching_peak_reserved']):>14}{percent:>+12.1f}%{ratio:>11}  {frontier}"
        )
    lines.append(f"traces: {summary['capture']} ({summary['capture_reason']})")
    lines += [f"note: {n}" for n in summary["notes"]]
    if summary["figure"]:
        lines.append(f"figure: {summary['figure']}")
    lines.append(f"wall time {summary['seconds']:.1f} s")
    return "\n".join(lines)
