"""The trade-off figure of `memplan tradeoff`: memory against extra compute, one point per configuration.

Left panel: plan arena (filled) and the caching allocator's peak reserved (hollow) against extra FLOPs in
percent of the model as built; right panel: the same against step time relative to it (real traces only),
each point's ratio with a bar over its range across the timed rounds. Layer modes are blue, actions beyond
them (the fused loss, the optimizer choices, offload) purple, compile budgets orange, variant model files
green. The Pareto frontier of each panel is a dashed staircase through its points; every point is named, points
close together by one label.
Drawn from `TradeoffResult.summary()`, plain data.
"""

from __future__ import annotations

import os

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from memplan.planner.report.plots import figure_format, write_figure
from memplan.units import byte_unit

POINT_COLOR, COMPILE_COLOR, VARIANT_COLOR, FRONTIER_COLOR = "#4c72b0", "#dd8452", "#55a868", "#d62728"
ACTION_COLOR = "#8172b3"
FLOPS_AXIS = "extra FLOPs (% of the model as built)"
TIME_AXIS = "step time (x the model as built, CPU; median and range over interleaved rounds)"
LEADER = {"arrowstyle": "-", "lw": 0.4, "color": "0.55", "shrinkA": 0, "shrinkB": 3}  # a label's line to its point
NEAR = 0.02  # points this close (a fraction of the panel) are named by one label
LABEL_OFFSETS = tuple((dx, dy) for dy in (-9, 9, -22, 22, -35, 35) for dx in (6, -6))  # points, tried in order


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


def point_color(point: dict) -> str:
    """Layer modes blue, actions purple, compile budgets orange, variant model files green."""
    if point.get("variant"):
        return VARIANT_COLOR
    if point.get("action"):
        return ACTION_COLOR
    return COMPILE_COLOR if point["compile_budget"] is not None else POINT_COLOR


def clusters(spots: list[tuple[float, float, str]], width: float, height: float) -> list[tuple[float, float, str]]:
    """Points closer than NEAR of the panel's width and height share one label: (x, y, names), names two a line."""
    groups: list[list[tuple[float, float, str]]] = []
    for x, y, name in sorted(spots):
        near = [g for g in groups if abs(g[0][0] - x) <= NEAR * width and abs(g[0][1] - y) <= NEAR * height]
        if near:
            near[0].append((x, y, name))
        else:
            groups.append([(x, y, name)])
    labels = []
    for group in groups:
        names = [name for _, _, name in group]
        lines = [", ".join(names[i : i + 2]) for i in range(0, len(names), 2)]
        labels.append((group[0][0], group[0][1], "\n".join(lines)))
    return labels


def place_labels(ax, labels: list[tuple[float, float, str]]) -> None:
    """Each label beside its point with a thin line to it, at the first of LABEL_OFFSETS where it stays inside the
    panel and clear of the labels placed before it (the last offset when none is)."""
    renderer = ax.figure.canvas.get_renderer()
    panel = ax.get_window_extent(renderer)
    taken = []
    for x, y, text in labels:
        for dx, dy in LABEL_OFFSETS:
            style = {"fontsize": 7, "va": "center", "ha": "left" if dx > 0 else "right"}
            trial = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", **style)
            box = trial.get_window_extent(renderer).padded(2)
            trial.remove()
            inside = panel.x0 <= box.x0 and box.x1 <= panel.x1 and panel.y0 <= box.y0 and box.y1 <= panel.y1
            if (inside and not any(box.overlaps(other) for other in taken)) or (dx, dy) == LABEL_OFFSETS[-1]:
                break
        ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", arrowprops=LEADER, **style)
        taken.append(box)


def draw_panel(
    ax,
    points: list[dict],
    compute: str,
    frontier: str,
    xlabel: str,
    unit: tuple[str, int],
    spread: tuple[str, str] | None = None,
) -> list:
    """One panel: every point at (its compute, its arena), hollow reserved markers, the frontier, and with `spread`
    (the keys of the compute's low and high) a bar over each point's range; returns the labels to place once the
    layout is final."""
    name, scale = unit
    spots = []
    for p in points:
        color = point_color(p)
        x, y = p[compute], p["plan_arena"] / scale
        if spread is not None:
            low, high = p[spread[0]], p[spread[1]]
            ax.errorbar([x], [y], xerr=[[x - low], [high - x]], fmt="none", ecolor=color, elinewidth=1.0, capsize=3)
        ax.plot([x, x], [y, p["caching_peak_reserved"] / scale], color=color, lw=0.8, alpha=0.5)
        ax.scatter([x], [p["caching_peak_reserved"] / scale], facecolors="none", edgecolors=color, s=28, zorder=3)
        ax.scatter([x], [y], color=color, s=36, zorder=4)
        spots.append((x, y, p["name"]))
    xs, ys = frontier_line([(p[compute], p["plan_arena"] / scale) for p in points if p[frontier]])
    ax.plot(xs, ys, ls="--", color=FRONTIER_COLOR, lw=1.2, label="Pareto frontier (plan arena)")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"memory ({name}): plan arena (filled), caching reserved (hollow)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    ax.margins(x=0.08, y=0.12)  # room for the names at the edges
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    return clusters(spots, x1 - x0, y1 - y0)


def plot_tradeoff(summary: dict, path: str | os.PathLike) -> None:
    """Write the trade-off figure of a tradeoff summary to `path` (.png or .svg)."""
    fmt = figure_format(path)
    points = summary["points"]
    reference = points[0]
    flops_points = [p | {"extra_percent": 100 * p["extra_flops"] / reference["flops"]} for p in points]
    timed = [p for p in points if p["time_ratio"] is not None]
    unit = byte_unit(max(max(p["caching_peak_reserved"], p["plan_arena"]) for p in points), smallest="KiB")
    fig = Figure(figsize=(13 if timed else 7, 5.5))
    FigureCanvasAgg(fig)
    panels = fig.subplots(1, 2 if timed else 1, squeeze=False)[0]
    labels = [draw_panel(panels[0], flops_points, "extra_percent", "pareto_flops", FLOPS_AXIS, unit)]
    if timed:
        spread = ("time_ratio_low", "time_ratio_high")
        labels.append(draw_panel(panels[1], timed, "time_ratio", "pareto_time", TIME_AXIS, unit, spread))
    fig.suptitle(
        f"{os.path.basename(summary['model_file'])}: batch {summary['batch']}, seq {summary['seq']}, "
        f"{summary['dtype']}, {summary['capture']} traces",
        fontsize=10,
    )
    fig.tight_layout()
    for ax, panel_labels in zip(panels, labels):
        place_labels(ax, panel_labels)
    write_figure(fig, path, fmt, dpi=130)
