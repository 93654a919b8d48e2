"""`memplan check --html`: the whole program on one page, as it ran on the fake GPU: live bytes by category, the
caching allocator's reserved bytes as the program met them (its caught out-of-memory errors and `empty_cache` calls
included), the allocator's limit, each training step and each out-of-memory error marked, and the answer in words."""

from __future__ import annotations

import dataclasses
import os
import shlex

import numpy as np

from memplan.files import atomic_write
from memplan.planner.jobs.check import CheckError, CheckResult
from memplan.planner.report.check_text import render_check
from memplan.planner.report.html_data import Marks
from memplan.planner.report.html_report import render_html
from memplan.planner.simulate.measure import simulate_trace
from memplan.traces.format import INT_COLUMNS, STR_COLUMNS, Trace
from memplan.units import human_bytes

NOTE = (
    "Device memory over the whole program on the fake GPU, from its first allocation to where it stopped: live "
    "bytes stacked by category (the buffer under the pointer on hover), the caching allocator's reserved bytes as "
    "the program met them (dashed), the most it could reserve (red), each training step bracketed along the top and "
    "each out-of-memory error as a red line (the request it refused is not drawn: it was never held)."
)


def check_page(result: CheckResult) -> str:
    """The page of a checked program (CheckError when it recorded no program)."""
    program = result.program
    if program is None or result.series is None:
        raise CheckError("the program recorded nothing on the GPU, so there is no page to write")
    # 1. The program measured: the caching allocator at the GPU's capacity, its series replaced by the live one.
    limit = result.memory - result.budget["outside_bytes"]
    command = shlex.join(result.command)
    title = f"{command} on a fake {result.gpu}" + (f" (rank {result.rank})" if result.rank is not None else "")
    measured = simulate_trace(served(program.trace, result), title, alloc_conf=result.alloc_conf, capacity=limit)
    allocated, reserved = result.series
    peaks = {"peak_allocated": result.peak_allocated, "peak_reserved": result.peak_reserved}
    measured.caching = dataclasses.replace(measured.caching, allocated=allocated, reserved=reserved, **peaks)
    # 2. The marks: the steps, the errors raised, the limit, the answer.
    steps = tuple((s.start, s.end, f"step {k}") for k, s in enumerate(program.steps, start=1))
    events = tuple(
        (f.time, f"out of memory: {human_bytes(f.size)}" + (" (caught)" if f.caught else "")) for f in result.failures
    )
    marks = Marks(steps=steps, events=events, limit=limit, text=render_check(result.to_dict()))
    again = f"memplan check --gpu {result.gpu}" + (f" --alloc-conf {result.alloc_conf}" if result.alloc_conf else "")
    return render_html([measured], [f"{again} --html PAGE -- {command}"], f"memplan check: {title}", [marks], NOTE)


def served(trace: Trace, result: CheckResult) -> Trace:
    """`trace` without the requests the GPU refused (recorded, as the op asked for them, but never held)."""
    refused = {(f.time, f.size) for f in result.failures}
    keep = np.flatnonzero([(a, s) not in refused for a, s in zip(trace.alloc.tolist(), trace.size.tolist())])
    if len(keep) == len(trace):
        return trace
    columns = {name: getattr(trace, name)[keep] for name in INT_COLUMNS}
    labels = {name: [getattr(trace, name)[i] for i in keep] for name in STR_COLUMNS}
    return dataclasses.replace(trace, **columns, **labels, program=None)


def page_path(path: str | os.PathLike) -> str:
    """`path` when it names an HTML page (CheckError otherwise), checked before the program runs."""
    if os.path.splitext(os.fspath(path))[1].lower() not in (".html", ".htm"):
        raise CheckError(f"{os.fspath(path)}: the page must end in .html")
    return os.fspath(path)


def write_page(result: CheckResult, path: str | os.PathLike) -> None:
    """Write the checked program's page to `path` (a rank's, as its own process rendered it)."""
    atomic_write(path, result.page if result.page is not None else check_page(result))
