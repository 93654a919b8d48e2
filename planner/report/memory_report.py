"""Views of one trace's Measurement (planner/simulate/measure.py): `memplan simulate`'s summary and text, the
per-event timeline CSV, and the trace's title and phases that the plots and the compare table show too."""

from __future__ import annotations

import csv
import io
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from memplan.planner.report.trace_text import no_change_mark
from memplan.planner.report.verdict_text import render_verdict
from memplan.planner.simulate.caching_allocator import OutOfMemory
from memplan.planner.simulate.measure import Measurement
from memplan.planner.simulate.verdict import Verdict
from memplan.traces.format import PHASES, Trace
from memplan.traces.ranks.family import ranks_label, stands_for
from memplan.traces.unrecorded import unrecorded_text
from memplan.units import human_bytes


def trace_title(trace: Trace, name: str) -> str:
    """A trace's title from its meta (model, layers, rank/world size), else its file name."""
    meta = trace.meta
    parts = [str(meta[k]) for k in ("model", "layers") if meta.get(k)]
    if meta.get("layers") and meta.get("patch"):
        parts[-1] += no_change_mark(meta["patch"]["mode"], meta["patch"]["changed"])
    if meta.get("rank") is not None and meta.get("world_size") is not None:
        parts.append(f"{ranks_label(stands_for(meta))}/{meta['world_size']}")
    return " · ".join(parts) if parts else Path(name).name


def phase_at_times(trace: Trace) -> np.ndarray:
    """Index into PHASES of the phase each logical time falls in: that of the latest allocation so far."""
    out = np.full(trace.end, PHASES.index("other"), dtype=np.int64)
    rec = trace.recorded
    if not len(rec):
        return out
    codes = np.array([PHASES.index(trace.phase[i]) for i in rec], dtype=np.int64)
    rank = np.full(trace.end, -1, dtype=np.int64)
    rank[trace.alloc[rec]] = np.arange(len(rec))  # recorded is in allocation order
    latest = np.maximum.accumulate(rank)
    seen = latest >= 0
    out[seen] = codes[latest[seen]]
    return out


def phase_at(trace: Trace, t: int) -> str:
    """The phase logical time t falls in ("other" for an empty trace)."""
    return PHASES[phase_at_times(trace)[t]] if trace.end else "other"


@dataclass(frozen=True)
class PlanSummary:
    """The plan's figures in the `memplan simulate` summary; bytes."""

    path: str | None  # the plan file
    scope: str  # which buffers the plan places: all, or step (those not held for the whole window)
    arena: int
    outside_peak: int  # most bytes held outside the plan at once
    total_peak: int  # arena + outside_peak
    status: str  # optimal or feasible
    gap: float  # arena / the solver's bound - 1
    bound: int  # the solver's lower bound
    solver: str
    peak_in_use: int  # most aligned bytes of the arena in use at once
    fits_capacity: bool | None  # total_peak <= --capacity, None without a capacity


@dataclass(frozen=True)
class CachingSummary:
    """The simulated caching allocator's figures in the `memplan simulate` summary; bytes."""

    alloc_conf: str  # the PYTORCH_CUDA_ALLOC_CONF string simulated ("" for the defaults)
    tie_break: str
    capacity: int | None
    peak_allocated: int
    peak_reserved: int
    fragmentation_at_peak: float  # 1 - allocated / reserved when reserved peaks
    segment_allocs: int
    oom: OutOfMemory | None


@dataclass(frozen=True)
class RepeatedSummary:
    """The caching allocator's peaks on the step's last run when the step is run `steps` times in a row, as a
    training loop reaches it (planner/simulate/repeat.py); bytes."""

    steps: int
    peak_allocated: int
    peak_reserved: int


@dataclass(frozen=True)
class SimulateSummary:
    """What `memplan simulate` prints: the trace's peak, the bound, the plan and the caching allocator."""

    trace: str  # the trace's name (its path)
    buffers: int
    events: int  # the trace's end: one past its last logical time
    peak_live: int
    peak_live_time: int
    peak_live_phase: str
    bound: int  # max-live lower bound on any plan's arena
    plan: PlanSummary | None  # None without --plan
    caching: CachingSummary
    timeline: str | None  # the timeline CSV written, if any
    verdict: Verdict | None = None  # whether the step fits the GPU of --gpu; None without it
    repeated: RepeatedSummary | None = None  # with --steps N > 1: the peaks of the step's N-th run in a row
    unrecorded: dict | None = None  # storages the step read that the trace lacks (its meta "unrecorded"), if any

    def to_dict(self) -> dict:
        """The JSON document of `memplan simulate --json` (keys documented in docs/cli.md)."""
        return asdict(self)


def report_summary(report: Measurement, timeline: str | None = None) -> SimulateSummary:
    """The summary of `memplan simulate` for one report (and the timeline file written, if any)."""
    trace, sim = report.trace, report.caching
    peak, peak_t = trace.peak()
    plan = None
    if report.plan is not None:
        pm = report.plan_memory
        plan = PlanSummary(
            path=report.plan_name,
            scope=report.plan.scope,
            arena=pm.arena,
            outside_peak=pm.peak_outside,
            total_peak=pm.peak_total,
            status=report.plan.status,
            gap=report.plan.gap,
            bound=report.plan.bound,
            solver=report.plan.solver,
            peak_in_use=pm.peak_in_use,
            fits_capacity=None if report.capacity is None else pm.peak_total <= report.capacity,
        )
    return SimulateSummary(
        trace=report.name,
        buffers=len(trace),
        events=trace.end,
        peak_live=peak,
        peak_live_time=peak_t,
        peak_live_phase=phase_at(trace, peak_t),
        bound=report.bound,
        plan=plan,
        caching=CachingSummary(
            alloc_conf=report.alloc_conf,
            tie_break=report.tie_break,
            capacity=report.capacity,
            peak_allocated=int(sim.peak_allocated),
            peak_reserved=int(sim.peak_reserved),
            fragmentation_at_peak=float(sim.fragmentation_at_peak),
            segment_allocs=int(sim.segment_allocs),
            oom=sim.oom,
        ),
        timeline=timeline,
        verdict=report.verdict,
        unrecorded=trace.meta.get("unrecorded"),
    )


def report_text(s: SimulateSummary) -> str:
    """The human-readable summary of `memplan simulate`."""
    ratio = lambda n: f" ({n / s.bound:.3f}x bound)" if s.bound else ""  # noqa: E731
    lines = [
        f"trace              {s.trace} ({s.buffers:,} buffers, {s.events:,} events)",
        f"peak live          {human_bytes(s.peak_live)} at event {s.peak_live_time:,} ({s.peak_live_phase})",
        f"max-live bound     {human_bytes(s.bound)}",
    ]
    if s.unrecorded:
        lines.append(f"warning: {unrecorded_text(s.unrecorded)}")
    p = s.plan
    if p is None:
        lines.append("plan arena         - (pass --plan PLAN)")
    else:
        gap = "" if p.status == "optimal" else f", gap {p.gap:.2%} to its bound {human_bytes(p.bound)}"
        whole = p.scope == "all"  # a step plan's arena is only part of the footprint: compare the total
        lines.append(
            f"plan arena         {human_bytes(p.arena)}{ratio(p.arena) if whole else ''} [{p.status}{gap}; {p.solver}]"
        )
        if not whole:
            lines.append(
                f"  outside plan     {human_bytes(p.outside_peak)} (scope {p.scope}: parameters, "
                f"optimizer state, inputs), {human_bytes(p.total_peak)}{ratio(p.total_peak)} in all"
            )
        if p.fits_capacity is not None:
            lines.append(f"  within capacity  {'yes' if p.fits_capacity else 'NO'}")
    c = s.caching
    conf = c.alloc_conf or "default"
    cap = f", capacity {human_bytes(c.capacity)}" if c.capacity else ""
    lines += [
        f"caching allocator  (alloc-conf: {conf}{cap}; equal sizes: {c.tie_break.replace('_', ' ')} first; the step "
        "from an empty cache)",
        f"  peak allocated   {human_bytes(c.peak_allocated)}",
        f"  peak reserved    {human_bytes(c.peak_reserved)}{ratio(c.peak_reserved)}",
        f"  fragmentation    {c.fragmentation_at_peak:.1%} of reserved at its peak",
        f"  segment allocs   {c.segment_allocs:,}",
        f"  out of memory    {oom_text(c.oom)}",
    ]
    if s.repeated is not None:
        r = s.repeated
        lines += [
            f"  {f'run {r.steps} times':<17}the last run, as a loop reaches it: peak allocated "
            f"{human_bytes(r.peak_allocated)}, peak reserved {human_bytes(r.peak_reserved)}{ratio(r.peak_reserved)}"
        ]
    if s.timeline:
        lines.append(f"timeline           {s.timeline}")
    if s.verdict is not None:
        lines.append(render_verdict(s.verdict.to_dict()))
    return "\n".join(lines)


def oom_text(oom: OutOfMemory | None) -> str:
    """Where the simulated allocator ran out of memory, or "no"."""
    if oom is None:
        return "no"
    return (
        f"YES at event {oom.time:,}: buffer {oom.buffer} of {human_bytes(oom.size)} could not be served ({oom.details})"
    )


TIMELINE_COLUMNS = ("time", "phase", "live", "allocated", "reserved", "plan_arena", "plan_in_use", "plan_outside")


def timeline_csv(report: Measurement) -> str:
    """Per-event series as CSV (TIMELINE_COLUMNS); the plan columns are empty without a plan."""
    end = report.trace.end
    columns = [
        range(end),
        np.array(PHASES)[phase_at_times(report.trace)].tolist(),
        report.live.tolist(),
        report.caching.allocated.tolist(),
        report.caching.reserved.tolist(),
    ]
    pm = report.plan_memory
    columns += [[""] * end] * 3 if pm is None else [[pm.arena] * end, pm.in_use.tolist(), pm.outside.tolist()]
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(TIMELINE_COLUMNS)
    w.writerows(zip(*columns))
    return out.getvalue()
