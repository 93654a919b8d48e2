"""The trade-off figure of `memplan tradeoff`: memory against extra compute, one point per configuration.

Left panel: plan arena (filled) and the caching allocator's peak reserved (hollow) against extra FLOPs in
percent of the model as built; right panel: the same against step time relative to it (real traces
only). The Pareto frontier of each panel is a dashed staircase through its points; every point is named.
Drawn from `TradeoffResult.summary()`, plain data.
"""

from __future__ import annotations

import os

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from memplan.planner.report.plots import figure_format, write_figure
from memplan.traces.units import byte_unit

POINT_COLOR, COMPILE_COLOR, FRONTIER_COLOR = "#4c72b0", "#dd8452", "#d62728"


def frontier_line(pairs: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """The staircase through frontier points (compute, memory), sorted by compute."""
    xs, ys = [], []
    for x, y in sorted(pairs):
        if xs:
            xs.append(x)
            ys.append(ys[-1])
        xs.append(x)
        ys.append(y)
    return xs, ys


def draw_panel(ax, points: list[dict], compute: str, frontier: str, xlabel: str, unit: tuple[str, int]) -> None:
    """One panel: every point at (its compute, its arena), hollow reserved markers, the frontier, names."""
    name, scale = unit
    names: dict[tuple[float, float], list[str]] = {}  # points drawn at one place share one label
    for p in points:
        color = COMPILE_COLOR if p["compile_budget"] is not None else POINT_COLOR
        x, y = p[compute], p["plan_arena"] / scale
        ax.plot([x, x], [y, p["caching_reserved"] / scale], color=color, lw=0.8, alpha=0.5)
        ax.scatter([x], [p["caching_reserved"] / scale], facecolors="none", edgecolors=color, s=28, zorder=3)
        ax.scatter([x], [y], color=color, s=36, zorder=4)
        names.setdefault((round(x, 6), round(y, 6)), []).append(p["name"])
    for (x, y), together in names.items():
        ax.annotate(", ".join(together), (x, y), xytext=(4, -10), textcoords="offset points", fontsize=7)
    xs, ys = frontier_line([(p[compute], p["plan_arena"] / scale) for p in points if p[frontier]])
    ax.plot(xs, ys, ls="--", color=FRONTIER_COLOR, lw=1.2, label="Pareto frontier (plan arena)")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"memory ({name}): plan arena (filled), caching reserved (hollow)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")


def plot_tradeoff(summary: dict, path: str | os.PathLike) -> None:
    """Write the trade-off figure of a tradeoff summary to `path` (.png or .svg)."""
    fmt = figure_format(path)
    points = summary["points"]
    reference = points[0]
    flops_points = [p | {"extra_percent": 100 * p["extra_flops"] / reference["flops"]} for p in points]
    timed = [p for p in points if p["time_ratio"] is not None]
    unit = byte_unit(max(max(p["caching_reserved"], p["plan_arena"]) for p in points), smallest="KiB")
    fig = Figure(figsize=(13 if timed else 7, 5.5))
    panels = fig.subplots(1, 2 if timed else 1, squeeze=False)[0]
    draw_panel(panels[0], flops_points, "extra_percent", "pareto_flops", "extra FLOPs (% of the model as built)", unit)
    if timed:
        draw_panel(panels[1], timed, "time_ratio", "pareto_time", "step time (x the model as built, CPU median)", unit)
    fig.suptitle(
        f"{os.path.basename(summary['model_file'])}: batch {summary['batch']}, seq {summary['seq']}, "
        f"{summary['dtype']}, {summary['capture']} traces",
        fontsize=10,
    )
    fig.tight_layout()
    FigureCanvasAgg(fig)
    write_figure(fig, path, fmt, dpi=130)
