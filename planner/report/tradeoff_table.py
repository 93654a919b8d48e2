"""View of `memplan tradeoff`: its table for the terminal, a function of the job's summary (its --json)."""

from __future__ import annotations

from memplan.planner.report.trace_text import no_change_mark
from memplan.units import human_bytes


def point_label(point: dict) -> str:
    """A point's name, marked when it is a layer mode that changed nothing in this model."""
    plain = point["compile_budget"] is None and point["variant"] is None
    return point["name"] + no_change_mark(point["layers"], point["changed"]) if plain else point["name"]


def time_cell(point: dict) -> str:
    """A point's step time against the model as built: the median ratio and its range over the rounds, or "-"."""
    if point["time_ratio"] is None:
        return "-"
    return f"{point['time_ratio']:.2f}x [{point['time_ratio_low']:.2f}-{point['time_ratio_high']:.2f}]"


def link_cell(point: dict) -> str:
    """An offloading point's host-link seconds, or "-"."""
    seconds = point.get("transfer_seconds")
    return "-" if seconds is None else f"{seconds:.3g} s"


def alike_lines(summary: dict) -> list[str]:
    """The points whose step times cannot be told apart (their ratio ranges overlap), one line each."""
    alike = [p for p in summary["points"] if p["time_like"]]
    if not alike:
        return []
    lines = [
        f"step times not distinguishable at {summary['repeats']} timed steps each (their ratio ranges overlap; "
        "more --repeats narrows them):"
    ]
    lines += [f"  {p['name']} ~ {', '.join(p['time_like'])}" for p in alike]
    return lines


def measured_cell(point: dict) -> str:
    """A point's step time measured on the step's GPU, or "-"."""
    seconds = point.get("measured_seconds")
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


def render_tradeoff(summary: dict) -> str:
    """The trade-off table for the terminal, each point's frontiers named, its step time with its range; then the
    points whose step times cannot be told apart."""
    points = summary["points"]
    linked = any(p.get("transfer_seconds") is not None for p in points)  # offload measured: its link time shown
    on_gpu = summary.get("measured") is not None  # step times measured on the step's GPU: their column shown
    gpu_column = f"on {summary['gpu']}" if on_gpu else ""
    lines = [
        f"{'configuration':<28}{'peak live':>12}{'plan arena':>12}{'caching res.':>14}"
        f"{'extra FLOPs':>13}{'step time [range]':>22}"
        + (f"{'host link':>11}" if linked else "")
        + (f"{gpu_column:>12}" if on_gpu else "")
        + "  frontier",
    ]
    for p in points:
        percent = 100 * p["extra_flops"] / points[0]["flops"]
        frontier = " ".join(k for k, on in (("FLOPs", p["pareto_flops"]), ("time", p["pareto_time"])) if on)
        link = f"{link_cell(p):>11}" if linked else ""
        link += f"{measured_cell(p):>12}" if on_gpu else ""
        lines.append(
            f"{point_label(p):<28}{human_bytes(p['peak_live']):>12}{human_bytes(p['plan_arena']):>12}"
            f"{human_bytes(p['caching_peak_reserved']):>14}{percent:>+12.1f}%{time_cell(p):>22}{link}  {frontier}"
        )
    if linked:
        lines.append(
            "host link: the seconds offload's copies take over the host link, to the host and back, when nothing "
            "overlaps them (the most they add to a GPU's step)"
        )
    if summary["timing"]:
        lines.append(
            f"step time: x the model as built, median of {summary['repeats']} rounds timed {summary['timing']} "
            "[the range of the ratio over the rounds]"
        )
    lines += alike_lines(summary)
    lines.append(f"traces: {summary['capture']} ({summary['capture_reason']})")
    lines += [f"note: {n}" for n in summary["notes"]]
    if summary["figure"]:
        lines.append(f"figure: {summary['figure']}")
    lines.append(f"wall time {summary['seconds']:.1f} s")
    return "\n".join(lines)
