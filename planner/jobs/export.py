"""`memplan export`: a trace file as a PyTorch memory snapshot file. Apart from planner/jobs/files.py so that the
command loads no plotting or solver code (it needs neither)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from memplan.errors import PlanError
from memplan.planner.plan import load_plan
from memplan.planner.simulate.snapshot_export import (
    check_snapshot_path,
    make_snapshot,
    snapshot_summary,
    write_snapshot,
)
from memplan.traces.format import load

Progress = Callable[[str], None]


def export_file(trace_file: str, output: str | None, plan_file: str | None, *, alloc_conf: str, tie_break: str,
                progress: Progress) -> dict:  # fmt: skip
    """`memplan export`: the trace as a PyTorch memory snapshot (default <trace>.pickle), its addresses from the
    simulated caching allocator or from the plan (checked against the trace first); returns the snapshot's summary."""
    name = Path(trace_file).name
    output = output or f"{name.removesuffix('.gz').removesuffix('.json').removesuffix('.trace')}.pickle"
    check_snapshot_path(output)  # before any work
    trace = load(trace_file)
    plan = load_plan(plan_file, trace) if plan_file else None  # verified against the trace
    progress(f"exporting {trace_file} ({len(trace):,} buffers) on {'the plan' if plan else 'the caching allocator'}")
    try:
        snapshot = make_snapshot(trace, plan, alloc_conf=alloc_conf, tie_break=tie_break, name=name)
    except PlanError as e:
        raise PlanError(f"{plan_file}: invalid for {trace_file}: {e}") from None
    write_snapshot(snapshot, output)
    progress(f"wrote {output}")
    return {**snapshot_summary(snapshot), "output": str(output)}
