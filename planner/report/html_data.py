"""The data one trace embeds in the HTML report: thinned series to draw, every buffer (packed binary columns, gzip,
base64) for exact figures on hover, the plan's largest rectangles, and the tables; a function of a Measurement."""

from __future__ import annotations

import base64
import gzip
from dataclasses import dataclass

import numpy as np

from memplan.errors import MemplanError
from memplan.planner.report.memory_report import phase_at_times, trace_title
from memplan.planner.report.plots import category_live, pool_max, pool_points
from memplan.planner.simulate.measure import Measurement
from memplan.traces.format import CATEGORIES, PHASES, Trace

SERIES_POINTS = 4000  # points per series drawn before zooming (the page recomputes exact series when zoomed in)
MAX_RECTANGLES = 20_000  # the plan's largest buffers drawn in the address space
TOP_BUFFERS = 20  # rows of the largest buffers at the peak
TOP_MODULES = 30  # rows of the per-module table
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Marks:
    """What a panel marks beyond its trace (a whole program's, from `memplan check`): the program's training steps,
    the out-of-memory errors raised in it, the memory the caching allocator had, and the answer in words."""

    steps: tuple[tuple[int, int, str], ...] = ()  # (start, end, label) windows of logical time
    events: tuple[tuple[int, str], ...] = ()  # (logical time, label): an error raised there
    limit: int | None = None  # bytes the caching allocator could reserve (the GPU's memory less what lies outside)
    text: str | None = None  # the answer, shown under the timeline


def intern(labels: list[str]) -> tuple[list[str], np.ndarray]:
    """The distinct labels (first-seen order) and each entry's index among them."""
    table: dict[str, int] = {}
    codes = np.fromiter((table.setdefault(x, len(table)) for x in labels), dtype=np.uint32, count=len(labels))
    return list(table), codes


def pack_buffers(trace: Trace) -> dict:
    """Every buffer as little-endian binary columns (alloc, free, size index, op, module as 32-bit; category * 4 +
    phase as a byte), gzipped and base64'd, with the tables the indices point into."""
    if trace.end > INT32_MAX:
        raise MemplanError(f"the HTML report takes traces of up to {INT32_MAX:,} events; this one has {trace.end:,}")
    sizes, size_idx = np.unique(trace.size, return_inverse=True)
    ops, op_idx = intern(trace.op)
    modules, module_idx = intern(trace.module)
    cat_code = {c: k for k, c in enumerate(CATEGORIES)}
    phase_code = {p: k for k, p in enumerate(PHASES)}
    kind = np.fromiter(
        (cat_code[c] * 4 + phase_code[p] for c, p in zip(trace.category, trace.phase)), dtype=np.uint8, count=len(trace)
    )
    columns = [trace.alloc.astype("<i4"), trace.free.astype("<i4"), size_idx.astype("<u4"), op_idx.astype("<u4")]
    raw = b"".join(c.tobytes() for c in (*columns, module_idx.astype("<u4"), kind))
    return {
        "n": len(trace),
        "blob": base64.b64encode(gzip.compress(raw, compresslevel=6, mtime=0)).decode("ascii"),
        "sizes": [int(s) for s in sizes],
        "ops": ops,
        "modules": modules,
    }


def phase_spans(trace: Trace) -> list[list[int]]:
    """[start, stop, phase index] of each run of one phase over logical time."""
    codes = phase_at_times(trace)
    if not len(codes):
        return []
    starts = np.concatenate(([0], np.nonzero(np.diff(codes))[0] + 1))
    stops = np.concatenate((starts[1:], [len(codes)]))
    return [[int(a), int(b), int(codes[a])] for a, b in zip(starts, stops)]


def series(m: Measurement) -> dict:
    """Live bytes per category, the caching allocator's reserved bytes and the plan's footprint at the kept times:
    each bin's maximum of the live total (plots.pool_points), so that peaks stay drawn."""
    keep, w = pool_points(m.live, SERIES_POINTS)
    out = {
        "t": keep.tolist(),
        "exact": w == 1,
        "cats": {c: s[keep].tolist() for c, s in category_live(m.trace).items()},
        "reserved": pool_max(np.asarray(m.caching.reserved, dtype=np.int64), w).tolist(),
        "plan": None if m.plan_memory is None else pool_max(m.plan_memory.total, w).tolist(),
    }
    return out


def largest_at(trace: Trace, t: int, count: int) -> list[int]:
    """The `count` largest buffers live at time t, largest first."""
    live = trace.live_at(t)
    order = np.argsort(-trace.size[live], kind="stable")[:count]
    return [int(i) for i in live[order]]


def module_rows(trace: Trace, peak_t: int, count: int) -> list[dict]:
    """Per module: bytes of forward buffers still live when backward begins (held for backward), temporaries and
    all bytes live at the peak; the `count` modules holding the most, largest first."""
    modules, code = intern(trace.module)
    backward = [trace.alloc[i] for i in trace.recorded if trace.phase[i] == "backward"]
    held = np.zeros(len(modules), dtype=np.int64)
    if backward:
        b0 = int(backward[0])
        fwd = np.array([p == "forward" for p in trace.phase], dtype=bool)
        mask = fwd & (trace.alloc <= b0) & (trace.free > b0)
        np.add.at(held, code[mask], trace.size[mask])
    live = (trace.alloc <= peak_t) & (trace.free > peak_t)
    temp = live & np.array([c == "temporary" for c in trace.category], dtype=bool)
    at_peak, temps = np.zeros(len(modules), dtype=np.int64), np.zeros(len(modules), dtype=np.int64)
    np.add.at(at_peak, code[live], trace.size[live])
    np.add.at(temps, code[temp], trace.size[temp])
    order = np.lexsort((-temps, -at_peak, -held))
    rows = [
        {"module": modules[k] or "(none)", "held": int(held[k]), "temporary": int(temps[k]), "live": int(at_peak[k])}
        for k in order
        if held[k] or at_peak[k]
    ]
    return rows[:count]


def address_space(m: Measurement, limit: int) -> dict | None:
    """The plan's arena and its `limit` largest placed buffers as [buffer, offset] (all when fewer)."""
    if m.plan is None:
        return None
    trace, plan = m.trace, m.plan
    offsets = np.asarray(plan.offsets, dtype=np.int64)
    placed = np.nonzero((trace.size > 0) & (trace.alloc < trace.free) & (offsets >= 0))[0]
    if len(placed) > limit:
        area = trace.size[placed] * (trace.free[placed] - trace.alloc[placed])
        placed = np.sort(placed[np.argsort(-area, kind="stable")[:limit]])
    status = plan.status if plan.status == "optimal" else f"{plan.status}, gap {plan.gap:.2%}"
    return {
        "arena": int(plan.arena),
        "status": status,
        "solver": plan.solver,
        "placed": int(np.count_nonzero(offsets >= 0)),
        "rects": [[int(i), int(offsets[i])] for i in placed],
    }


def panel_data(m: Measurement, marks: Marks | None = None) -> dict:
    """Everything the page shows of one measured trace, with what `marks` adds."""
    trace = m.trace
    peak, peak_t = trace.peak()
    return {
        "name": m.name,
        "title": trace_title(trace, m.name),
        "end": trace.end,
        "peak": peak,
        "peak_t": peak_t,
        "figures": m.figures(),
        "plan_peak": None if m.plan_memory is None else int(m.plan_memory.peak_total),
        "series": series(m),
        "phases": phase_spans(trace),
        "buffers": pack_buffers(trace),
        "largest": largest_at(trace, peak_t, TOP_BUFFERS),
        "modules": module_rows(trace, peak_t, TOP_MODULES),
        "address": address_space(m, MAX_RECTANGLES),
        "verdict": None if m.verdict is None else m.verdict.to_dict(),
        "steps": [] if marks is None else [list(s) for s in marks.steps],
        "events": [] if marks is None else [list(e) for e in marks.events],
        "limit": None if marks is None else marks.limit,
        "text": None if marks is None else marks.text,
    }
