"""The commands that read and write files only: `memplan import`, `simulate`, `plot`, `report` and `compare`. Each
returns its data (the command's JSON, or the typed summary or rows behind it); planner/report/ renders it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

from memplan.errors import MemplanError
from memplan.files import atomic_write
from memplan.gpus import GPU
from memplan.planner.plan import Plan, load_plan
from memplan.planner.report.compare import CompareRow, compare_traces
from memplan.planner.report.html_report import render_html
from memplan.planner.report.memory_report import RepeatedSummary, SimulateSummary, report_summary, timeline_csv
from memplan.planner.report.plots import check_request, plot_reports
from memplan.planner.simulate.alloc_conf import parse_alloc_conf
from memplan.planner.simulate.caching_allocator import simulate_caching
from memplan.planner.simulate.measure import simulate_trace
from memplan.planner.simulate.plan_footprint import match_plans
from memplan.planner.simulate.repeat import last_step_peaks, repeated
from memplan.traces.format import Trace, load, save
from memplan.traces.inputs.snapshot import import_snapshot, import_summary
from memplan.traces.ranks.family import load_traces

Progress = Callable[[str], None]


def import_file(snapshot: str, output: str | None, cuda_device: int | None, progress: Progress) -> dict:
    """`memplan import`: a CUDA memory snapshot as a trace, written to `output` (default <snapshot>.trace.json.gz)."""
    output = output or f"{Path(snapshot).stem}.trace.json.gz"
    progress(f"reading {snapshot}")
    trace = import_snapshot(snapshot, cuda_device)
    save(trace, output)
    progress(f"wrote {output}")
    return {**import_summary(trace), "output": str(output)}


def simulate_file(trace_file: str, plan_file: str | None, *, alloc_conf: str, tie_break: str, capacity: int | None,
                  timeline: str | None, progress: Progress, gpu: GPU | None = None,
                  steps: int = 1) -> SimulateSummary:  # fmt: skip
    """`memplan simulate`: the trace on the caching allocator (and its plan), with the timeline CSV if asked, the
    verdict on `gpu` when given, and with `steps` > 1 the peaks of the step's last run of `steps` in a row."""
    trace = load(trace_file)
    plan = load_plan(plan_file, trace) if plan_file else None
    progress(f"simulating {trace_file} ({len(trace):,} buffers, {trace.end:,} events)")
    report = simulate_trace(trace, trace_file, plan=plan, plan_name=plan_file, alloc_conf=alloc_conf,
                          capacity=capacity, tie_break=tie_break, gpu=gpu)  # fmt: skip
    if timeline:
        atomic_write(timeline, timeline_csv(report))
        progress(f"wrote {timeline}")
    summary = report_summary(report, timeline=timeline)
    if steps > 1:
        progress(f"simulating the step run {steps} times in a row")
        chained = simulate_caching(repeated(trace, steps), parse_alloc_conf(alloc_conf, tie_break), capacity)
        reserved, allocated = last_step_peaks(chained.reserved, chained.allocated, trace, steps)
        summary = dataclasses.replace(summary, repeated=RepeatedSummary(steps, allocated, reserved))
    return summary


def load_files(
    trace_files: Sequence[str], plan_files: Sequence[str]
) -> tuple[list[tuple[str, Trace]], list[tuple[str, Plan]]]:
    """The named traces and plans of a multi-trace command, in the order given (FILE.json.gz that is no file but has
    rank traces: its rank family, traces.ranks.family); each plan verified against the trace it was made for."""
    traces = load_traces(trace_files)
    return traces, [(f, load_plan(f, [t for _, t in traces])) for f in plan_files]


def plot_files(trace_files: Sequence[str], plan_files: Sequence[str], output: str, *, address_space: bool,
               alloc_conf: str, tie_break: str, progress: Progress) -> dict:  # fmt: skip
    """`memplan plot`: the traces side by side (each with the plan made for it) in one figure."""
    check_request(output, address_space, bool(plan_files))
    traces, plans = load_files(trace_files, plan_files)
    reports = []
    for (name, trace), given in zip(traces, match_plans(traces, plans)):
        progress(f"simulating {name} ({len(trace):,} buffers)")
        plan_name, plan = given if given else (None, None)
        reports.append(simulate_trace(trace, name, plan=plan, plan_name=plan_name, alloc_conf=alloc_conf,
                                    tie_break=tie_break))  # fmt: skip
    plot_reports(reports, output, address_space=address_space)
    progress(f"wrote {output}")
    names = [name for name, _ in traces]
    return {"output": output, "traces": names, "plans": list(plan_files), "address_space": address_space}


def report_files(trace_files: Sequence[str], plan_files: Sequence[str], output: str, *, gpu: GPU | None,
                 command: str, progress: Progress) -> dict:  # fmt: skip
    """`memplan report`: the traces side by side (each with the plan made for it, verified against it, and its
    verdict on `gpu` when given) in one self-contained HTML page; `command` is the line that reproduces it."""
    if Path(output).suffix.lower() not in (".html", ".htm"):
        raise MemplanError(f"{output}: the report must end in .html")
    traces, plans = load_files(trace_files, plan_files)
    reports = []
    for (name, trace), given in zip(traces, match_plans(traces, plans)):
        progress(f"simulating {name} ({len(trace):,} buffers)")
        plan_name, plan = given if given else (None, None)
        reports.append(simulate_trace(trace, name, plan=plan, plan_name=plan_name, gpu=gpu))
    page = render_html(reports, [command])
    atomic_write(output, page)
    progress(f"wrote {output}")
    names = [name for name, _ in traces]
    return {"output": output, "traces": names, "plans": list(plan_files), "bytes": len(page.encode())}


def compare_files(trace_files: Sequence[str], plan_files: Sequence[str], *, method: str, time_limit: float,
                  alloc_conf: str, tie_break: str, progress: Progress) -> list[CompareRow]:  # fmt: skip
    """`memplan compare`: one row per trace (a plan solved here for a trace without one)."""
    traces, plans = load_files(trace_files, plan_files)
    return compare_traces(traces, plans, alloc_conf=alloc_conf, method=method, time_limit=time_limit,
                          progress=progress, tie_break=tie_break)  # fmt: skip
