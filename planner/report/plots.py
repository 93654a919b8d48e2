"""Memory timeline figures (PNG or SVG) drawn from Measurements.

One panel per trace, all on one y scale: live bytes stacked by category with the phases shaded and
named, the caching allocator's reserved and allocated bytes and the plan's footprint as lines. With
`address_space`, a second row draws each plan's buffers as rectangles (lifetime by offset).
Traces longer than MAX_POINTS events are max-pooled so that peaks stay visible and drawing stays fast.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PolyCollection
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter

from memplan.errors import MemplanError
from memplan.files import atomic_write
from memplan.planner.report.memory_report import phase_at_times, trace_title
from memplan.planner.simulate.measure import Measurement
from memplan.traces.format import CATEGORIES, PHASES, Trace, live_bytes
from memplan.units import byte_unit, human_bytes

MAX_POINTS = 20_000
EVENTS_FORMAT = FuncFormatter(lambda v, _: f"{v:,.0f}")
CATEGORY_COLORS = {
    "parameter": "#4c72b0",
    "gradient": "#dd8452",
    "optimizer": "#8172b3",
    "activation": "#55a868",
    "input": "#937860",
    "temporary": "#da8bc3",
    "workspace": "#8c8c3c",
    "communication": "#64b5cd",
    "unknown": "#a0a0a0",
}
PHASE_COLORS = {"forward": "#e8f1fa", "backward": "#fdf0e4", "optimizer": "#eef6e9"}
RESERVED_COLOR, ALLOCATED_COLOR, PLAN_COLOR = "#1a1a1a", "#606060", "#d62728"
FORMATS = {".png": "png", ".svg": "svg"}


class PlotError(MemplanError):
    """A figure cannot be drawn as asked (unknown file type, address space without a plan)."""


def figure_format(path: str | os.PathLike) -> str:
    """The image format for `path` (png or svg), or PlotError naming what is accepted."""
    fmt = FORMATS.get(Path(path).suffix.lower())
    if fmt is None:
        raise PlotError(f"{os.fspath(path)}: the figure must end in .png or .svg")
    return fmt


def check_request(path: str | os.PathLike, address_space: bool, have_plan: bool) -> str:
    """The figure's format, after checking the request can be drawn (PlotError otherwise)."""
    fmt = figure_format(path)
    if address_space and not have_plan:
        raise PlotError("--address-space needs a plan: pass --plan PLAN for at least one trace")
    return fmt


def category_live(trace: Trace) -> dict[str, np.ndarray]:
    """Live bytes per logical time of each category present in the trace, in CATEGORIES order."""
    out = {}
    cats = np.array(trace.category, dtype=object)
    for cat in CATEGORIES:
        idx = np.nonzero(cats == cat)[0]
        if len(idx):
            out[cat] = live_bytes(trace.size[idx], trace.alloc[idx], trace.free[idx], trace.end)
    return out


def pool_points(total: np.ndarray, max_points: int) -> tuple[np.ndarray, int]:
    """Indices of the kept points (the maximum of `total` in each bin of w events) and w (1: all kept)."""
    n = len(total)
    if n <= max_points:
        return np.arange(n), 1
    w = -(-n // max_points)
    padded = np.full(-(-n // w) * w, np.iinfo(np.int64).min, dtype=np.int64)
    padded[:n] = total
    bins = padded.reshape(-1, w)
    return np.arange(bins.shape[0]) * w + bins.argmax(axis=1), w


def pool_max(values: np.ndarray, w: int) -> np.ndarray:
    """Maximum of `values` over consecutive bins of w events (values unchanged when w is 1)."""
    if w == 1:
        return values
    n = len(values)
    padded = np.full(-(-n // w) * w, np.iinfo(np.int64).min, dtype=np.int64)
    padded[:n] = values
    return padded.reshape(-1, w).max(axis=1)


def draw_timeline(ax, report: Measurement, scale: int) -> None:
    """Stacked live bytes by category, shaded phases, caching allocator and plan lines on one axis."""
    trace = report.trace
    live = report.live
    keep, w = pool_points(live, MAX_POINTS)
    x = keep.astype(float)
    step = "post" if w == 1 else None
    phases = phase_at_times(trace)
    codes = phases[keep]
    for code, phase in enumerate(PHASES):
        if phase in PHASE_COLORS and (codes == code).any():
            ax.fill_between(
                x,
                0,
                1,
                where=codes == code,
                step=step,
                transform=ax.get_xaxis_transform(),
                color=PHASE_COLORS[phase],
                linewidth=0,
                zorder=0,
            )
    label_phases(ax, phases, trace.end)
    lower = np.zeros(len(keep))
    for cat, series in category_live(trace).items():
        upper = lower + series[keep] / scale
        ax.fill_between(x, lower, upper, step=step, color=CATEGORY_COLORS[cat], linewidth=0, zorder=2)
        lower = upper
    drawstyle = "steps-post" if w == 1 else "default"
    sim = report.caching
    ax.plot(
        x,
        pool_max(np.asarray(sim.reserved, dtype=np.int64), w) / scale,
        color=RESERVED_COLOR,
        linewidth=1.4,
        drawstyle=drawstyle,
        zorder=4,
    )
    ax.plot(
        x,
        pool_max(np.asarray(sim.allocated, dtype=np.int64), w) / scale,
        color=ALLOCATED_COLOR,
        linewidth=1.0,
        linestyle=(0, (4, 2)),
        drawstyle=drawstyle,
        zorder=4,
    )
    if report.plan_memory is not None:  # the arena, plus what a step plan leaves outside it
        ax.plot(
            x,
            pool_max(report.plan_memory.total, w) / scale,
            color=PLAN_COLOR,
            linewidth=1.6,
            drawstyle=drawstyle,
            zorder=5,
        )
    peak, peak_t = trace.peak()
    ax.plot([peak_t], [peak / scale], marker="v", color="black", markersize=5, zorder=6)
    where = peak_t / max(trace.end, 1)
    align = "right" if where > 0.85 else "left" if where < 0.15 else "center"
    ax.annotate(
        f"peak live {human_bytes(peak)}",
        (peak_t, peak / scale),
        textcoords="offset points",
        xytext=(0, 7),
        ha=align,
        fontsize=8,
        zorder=7,
        bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor="none", alpha=0.85),
    )
    stats = [f"reserved {human_bytes(sim.peak_reserved)}"]
    pm = report.plan_memory
    if pm is not None:
        outside = f" + {human_bytes(pm.peak_outside)} outside" if pm.peak_outside else ""
        stats.append(f"plan arena {human_bytes(pm.arena)}{outside}")
    ax.set_title(f"{trace_title(report.trace, report.name)}\n{' · '.join(stats)}", fontsize=10)
    ax.set_xlim(0, max(trace.end, 1))
    ax.xaxis.set_major_formatter(EVENTS_FORMAT)
    ax.set_xlabel("logical time (allocation and free events)")
    ax.grid(axis="y", color="#dddddd", linewidth=0.6, zorder=1)


def label_phases(ax, codes: np.ndarray, end: int) -> None:
    """Name each phase span wide enough to hold its label, at the top of the axis."""
    if end == 0:
        return
    starts = np.concatenate(([0], np.nonzero(np.diff(codes))[0] + 1))
    stops = np.concatenate((starts[1:], [end]))
    for a, b in zip(starts, stops):
        phase = PHASES[codes[a]]
        if phase in PHASE_COLORS and b - a >= 0.08 * end:
            ax.text(
                (a + b) / 2,
                0.985,
                phase,
                transform=ax.get_xaxis_transform(),
                ha="center",
                va="top",
                fontsize=8,
                color="#555555",
                zorder=7,
            )


def draw_address_space(ax, report: Measurement, scale: int) -> None:
    """The plan's buffers as rectangles (x: lifetime, y: offset) coloured by category, with the arena."""
    trace, pm = report.trace, report.plan_memory
    offsets = np.asarray(report.plan.offsets, dtype=np.int64)
    idx = np.nonzero((trace.size > 0) & (trace.alloc < trace.free) & (offsets >= 0))[0]  # -1: outside the plan
    x0, x1 = trace.alloc[idx].astype(float), trace.free[idx].astype(float)
    y0 = offsets[idx] / scale
    y1 = (offsets[idx] + trace.size[idx]) / scale
    verts = np.stack(
        [np.stack([x0, y0], 1), np.stack([x0, y1], 1), np.stack([x1, y1], 1), np.stack([x1, y0], 1)], axis=1
    )
    # neighbours of one category get slightly different shades so that single buffers stand out
    shade = 1.0 - 0.12 * (np.arange(len(idx)) % 3)[:, None]
    palette = np.array([to_rgb(CATEGORY_COLORS[c]) for c in CATEGORIES])
    code = {c: k for k, c in enumerate(CATEGORIES)}
    colors = palette[np.array([code[trace.category[i]] for i in idx], dtype=np.int64)].reshape(-1, 3) * shade
    edge = dict(edgecolors="white", linewidths=0.3) if len(idx) <= 3000 else dict(edgecolors="none")
    rects = PolyCollection(verts, facecolors=colors, antialiased=len(idx) <= 3000, **edge)
    ax.add_collection(rects, autolim=False)  # limits are set below; autoscaling a million paths is slow
    ax.axhline(pm.arena / scale, color=PLAN_COLOR, linewidth=1.2)
    plan = report.plan
    status = plan.status if plan.status == "optimal" else f"{plan.status}, gap {plan.gap:.2%}"
    ax.set_title(f"plan address space: arena {human_bytes(pm.arena)} ({status})", fontsize=10)
    ax.set_xlim(0, max(trace.end, 1))
    ax.set_ylim(0, pm.arena / scale * 1.04 if pm.arena else 1)
    ax.xaxis.set_major_formatter(EVENTS_FORMAT)
    ax.set_xlabel("logical time (allocation and free events)")


def plot_reports(reports: list[Measurement], path: str | os.PathLike, address_space: bool = False) -> None:
    """Draw the timelines of `reports` side by side (and their plans' address space) into `path`."""
    fmt = check_request(path, address_space, any(r.plan is not None for r in reports))
    largest = max(
        max(
            int(r.live.max(initial=0)),
            int(r.caching.peak_reserved),
            r.plan_memory.peak_total if r.plan_memory is not None else 0,
        )
        for r in reports
    )
    unit, scale = byte_unit(largest, smallest="KiB")
    rows, cols = (2 if address_space else 1), len(reports)
    fig = Figure(figsize=(min(6.4 * cols, 22), 4.6 * rows + 0.9), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    for j, report in enumerate(reports):
        ax = axes[0][j]
        draw_timeline(ax, report, scale)
        if j:
            ax.sharey(axes[0][0])
            ax.tick_params(labelleft=False)
        if address_space:
            ax2 = axes[1][j]
            if report.plan is None:
                ax2.axis("off")
                ax2.text(0.5, 0.5, "no plan for this trace", ha="center", va="center", transform=ax2.transAxes)
            else:
                draw_address_space(ax2, report, scale)
    axes[0][0].set_ylim(bottom=0, top=largest / scale * 1.08)
    axes[0][0].set_ylabel(f"memory ({unit})")
    if address_space:
        plotted = [axes[1][j] for j, r in enumerate(reports) if r.plan is not None]
        for ax2 in plotted[1:]:
            ax2.sharey(plotted[0])
        widest = max(r.plan_memory.arena for r in reports if r.plan is not None)
        plotted[0].set_ylim(0, widest / scale * 1.04 if widest else 1)  # shared: room for the widest arena
        plotted[0].set_ylabel(f"offset in the arena ({unit})")
    handles = legend_handles(reports)
    ncol = min(len(handles), max(3, int(fig.get_figwidth() / 1.9)))
    fig.legend(handles=handles, loc="outside lower center", ncol=ncol, fontsize=8, frameon=False)
    if cols > 1 or address_space:
        fig.suptitle("Device memory over one training step", fontsize=12)
    write_figure(fig, path, fmt, dpi=110)


def write_figure(fig: Figure, path: str | os.PathLike, fmt: str, dpi: int) -> None:
    """Render `fig` as `fmt` and write it atomically (a failed write leaves no half figure)."""
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=dpi)
    atomic_write(path, buf.getvalue())


def legend_handles(reports: list[Measurement]) -> list:
    """Legend entries: the categories present, the phases, and the lines drawn."""
    present = {c for r in reports for c in r.trace.category}
    handles = [Patch(color=CATEGORY_COLORS[c], label=c) for c in CATEGORIES if c in present]
    phases = {p for r in reports for p in r.trace.phase}
    handles += [Patch(color=PHASE_COLORS[p], label=f"{p} phase") for p in PHASE_COLORS if p in phases]
    handles += [
        Line2D([], [], color=RESERVED_COLOR, linewidth=1.4, label="caching allocator: reserved"),
        Line2D(
            [], [], color=ALLOCATED_COLOR, linewidth=1.0, linestyle=(0, (4, 2)), label="caching allocator: allocated"
        ),
    ]
    if any(r.plan_memory is not None for r in reports):
        outside = any(r.plan_memory is not None and r.plan_memory.peak_outside for r in reports)
        handles.append(
            Line2D(
                [], [], color=PLAN_COLOR, linewidth=1.6, label="plan: arena + outside it" if outside else "plan: arena"
            )
        )
    return handles
