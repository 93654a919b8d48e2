"""A trace's summary: peak live bytes, when it happens, what is live then, and the largest buffers (as data; its
text is planner/report/trace_text.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from memplan.modes import AS_BUILT
from memplan.traces.format import CATEGORIES, Trace
from memplan.traces.host import host_summary


def changes_model(trace: Trace) -> bool:
    """Whether a traced step differs from the model as built: its layers patched, its loss fused, its optimizer
    rebuilt (the trace's meta says what each changed)."""
    loss_patch = trace.meta.get("loss_patch") or {}
    return bool(trace.meta["patch"]["changed"] or loss_patch.get("replaced") or trace.meta.get("optimizer_state"))


@dataclass(frozen=True)
class BufferSummary:
    """One buffer of a trace, as the summary lists it."""

    index: int  # its row in the trace
    size: int  # bytes requested
    alloc: int  # logical time it is allocated
    free: int  # logical time it is freed
    category: str
    phase: str
    module: str
    op: str


@dataclass(frozen=True)
class TraceSummary:
    """What `memplan trace` says of a trace (its --json keys are these fields)."""

    model: str  # the trace's meta: the workload's name, its layer mode, device, dtype, fake tensors or not
    layers: str
    device: str
    dtype: str
    fake: bool
    data_dependent: dict[str, int]  # fake traces: op -> how many values nobody knew were read as 0 (DATA_RULE)
    routing: dict  # fake traces: the routing rule, the router calls it answered, what followed (KnownValues.meta)
    buffers: int
    recorded: int  # buffers allocated during the step
    end: int  # one past the last logical time
    peak_bytes: int  # the most bytes live at once
    peak_time: int
    peak_phase: str  # of the allocation that reached the peak
    peak_module: str
    peak_op: str
    at_peak_by_category: dict[str, int]  # bytes live at the peak, by category (categories with none left out)
    internal: int  # buffers no op returned (kernels' own)
    internal_at_peak: int  # their bytes live at the peak
    largest: list[BufferSummary]
    cuda_measured: dict  # what PyTorch itself counted over a CUDA step ({} elsewhere)
    patch: dict | None  # what the layer mode changed (planner.layers.PatchReport's dict), None when no mode ran
    loss: str = AS_BUILT  # the step's loss (modes.LOSSES)
    loss_patch: dict | None = None  # what the loss choice changed (planner.layers.LossPatch's dict), None when none ran
    optimizer_state: dict | None = None  # what the optimizer choice made (planner.layers.OptimizerChoice's dict), None
    #                                      for the model file's optimizer as built
    # storages the step read that the trace lacks (made before recording: traces.unrecorded.Unrecorded's dict), {}
    unrecorded: dict = field(default_factory=dict)
    # offloaded layers' host copies (traces.host.host_summary: copies, moved, peak_bytes, at_device_peak), {} if none
    host: dict = field(default_factory=dict)
    # a trace on several CUDA streams: each stream's id, name (meta "streams") and buffers; [] on one stream
    streams: list = field(default_factory=list)
    syncs: int = 0  # orderings between streams (the trace's syncs)
    # the whole program the step ran in (Trace.program): its steps, which is measured, its buffers and peak live; {}
    program: dict = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The summary as plain data (the JSON of `memplan trace --json`)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TraceSummary:
        """A summary back from `to_dict`'s data (a rank's summary crosses processes as JSON)."""
        known = {f.name for f in fields(cls)}
        values = {"routing": {}, **{k: v for k, v in data.items() if k in known}}
        return cls(**{**values, "largest": [BufferSummary(**b) for b in values["largest"]]})


def _buffer(trace: Trace, i: int) -> BufferSummary:
    return BufferSummary(
        index=int(i),
        size=int(trace.size[i]),
        alloc=int(trace.alloc[i]),
        free=int(trace.free[i]),
        category=trace.category[i],
        phase=trace.phase[i],
        module=trace.module[i],
        op=trace.op[i],
    )


def bytes_by_category(trace: Trace, t: int) -> dict[str, int]:
    """Requested bytes live at logical time t, for every category of CATEGORIES (0 where none)."""
    out = {c: 0 for c in CATEGORIES}
    for i in trace.live_at(t):
        out[trace.category[i]] += int(trace.size[i])
    return out


def summarize(trace: Trace, top: int = 5) -> TraceSummary:
    """Peak live bytes and its time, the phase, module and op of the allocation that reached it,
    bytes by category live at the peak, totals by category, the kernels' own buffers (internal), and the `top`
    largest buffers."""
    peak, t = trace.peak()
    live = trace.live_at(t)
    at_peak = bytes_by_category(trace, t)
    reached_by = np.nonzero(trace.alloc == t)[0] if t > 0 else np.zeros(0, dtype=np.int64)
    largest = np.argsort(-trace.size, kind="stable")[:top]
    return TraceSummary(
        model=trace.meta.get("model", ""),
        layers=trace.meta.get("layers", ""),
        device=trace.meta.get("device", ""),
        dtype=trace.meta.get("dtype", ""),
        fake=bool(trace.meta.get("fake", False)),
        data_dependent=trace.meta.get("data_dependent", {}),
        routing=trace.meta.get("routing", {}),
        buffers=len(trace),
        recorded=int(len(trace.recorded)),
        end=trace.end,
        peak_bytes=peak,
        peak_time=t,
        peak_phase=trace.phase[reached_by[0]] if len(reached_by) else "other",
        peak_module=trace.module[reached_by[0]] if len(reached_by) else "",
        peak_op=trace.op[reached_by[0]] if len(reached_by) else "",
        at_peak_by_category={c: b for c, b in at_peak.items() if b},
        internal=int(trace.internal.sum()),
        internal_at_peak=int(trace.size[live][trace.internal[live] == 1].sum()),
        largest=[_buffer(trace, int(i)) for i in largest],
        cuda_measured=trace.meta.get("cuda_measured", {}),
        patch=trace.meta.get("patch"),
        loss=trace.meta.get("loss", AS_BUILT),
        loss_patch=trace.meta.get("loss_patch"),
        optimizer_state=trace.meta.get("optimizer_state"),
        unrecorded=trace.meta.get("unrecorded") or {},
        host=host_summary(trace, t),
        streams=_streams(trace),
        syncs=len(trace.syncs),
        program=program_summary(trace),
    )


def program_summary(trace: Trace) -> dict:
    """The trace's whole program in figures: steps, the measured one (1-based), buffers, events and peak live
    bytes; {} when the trace holds none."""
    program = trace.program
    if program is None:
        return {}
    measured = program.measured
    return {
        "steps": len(program.steps),
        "measured": None if measured is None else measured + 1,
        "buffers": len(program.trace),
        "events": program.trace.end - 1,
        "peak_bytes": program.trace.peak()[0],
    }


def _streams(trace: Trace) -> list[dict]:
    """Each stream the trace's buffers are on, with its name and its buffers; [] when they are all on one."""
    ids, counts = np.unique(trace.stream, return_counts=True)
    names = trace.meta.get("streams", {})
    if len(ids) < 2:
        return []
    return [{"stream": int(i), "name": names.get(str(int(i)), ""), "buffers": int(n)} for i, n in zip(ids, counts)]
