"""Capture one real training step as a trace: every allocation the device's allocator serves.

`capture_step` runs a warm-up step (it creates the optimizer state and settles lazy
initialisation), then records exactly one `workload.step()` with the PyTorch profiler's memory
events (REFERENCE §5). The recorded buffers, in allocation order, are the allocation calls the
allocator served during that step (allocations of 0 bytes are not served and not recorded);
storages that already existed (parameters, optimizer state, inputs) are buffers with alloc 0.
On CUDA the same profiler events give order, addresses and labels, and the caching allocator's
history of the step gives the requested (unrounded) sizes.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from traces.errors import MemplanError
from traces.format import Trace, make_trace
from traces.profiler_events import StepEvents, step_events
from traces.resident import ResidentStorage, resident_storages
from traces.step_marks import StepMarks, marked_step
from traces.workload import Workload


class CaptureError(MemplanError):
    """A workload cannot be captured (no parameters, unsupported device, inconsistent events)."""


@dataclass
class _Buffer:
    """One buffer while the trace is assembled (free is None until its free event is seen)."""

    size: int
    alloc: int
    free: int | None
    addr: int
    phase: str
    module: str
    op: str
    category: str = ""
    stream: int = 0


def workload_device(workload: Workload) -> torch.device:
    """The device of the workload's parameters (all must share one device type)."""
    types = {p.device.type for p in workload.model.parameters()}
    if not types:
        raise CaptureError(f"{workload.name}: the model has no parameters to train")
    if len(types) > 1:
        raise CaptureError(f"{workload.name}: parameters on several devices ({', '.join(sorted(types))})")
    device = next(workload.model.parameters()).device
    if device.type not in ("cpu", "cuda"):
        raise CaptureError(f"{workload.name}: capture supports cpu and cuda, not {device.type}")
    return device


def _count_before(times_ns: np.ndarray, boundary_ns: int | None) -> int | None:
    """Logical time of the last event before `boundary_ns` (None when there is no boundary)."""
    if boundary_ns is None:
        return None
    return int(np.searchsorted(times_ns, boundary_ns, side="left"))


def _pair(step: StepEvents, resident: dict[int, ResidentStorage]) -> list[_Buffer]:
    """Match allocations with frees by address; frees of unseen addresses are pre-existing buffers."""
    buffers: list[_Buffer] = []
    open_at: dict[int, int] = {}
    freed_resident: set[int] = set()
    for i, ev in enumerate(step.events):
        t = i + 1
        if ev.size > 0:
            if ev.addr in open_at:
                raise CaptureError(f"allocation at time {t} reuses live address {ev.addr:#x}: events are inconsistent")
            open_at[ev.addr] = len(buffers)
            buffers.append(_Buffer(ev.size, t, None, ev.addr, ev.phase, ev.module, ev.op, stream=ev.stream))
        elif ev.size < 0:
            if ev.addr in open_at:
                buffers[open_at.pop(ev.addr)].free = t
                continue
            known = resident.get(ev.addr)
            if known is not None and ev.addr not in freed_resident:
                freed_resident.add(ev.addr)
                # The storage's own size: on CUDA the profiler reports the rounded block size.
                buffers.append(_Buffer(known.size, 0, t, ev.addr, "other", known.module, "", known.category))
            else:
                buffers.append(_Buffer(-ev.size, 0, t, ev.addr, "other", "", "", "unknown"))
    end = len(step.events) + 1
    for b in buffers:
        if b.free is None:
            b.free = end
    kept = [_Buffer(r.size, 0, end, r.addr, "other", r.module, "", r.category)
            for addr, r in resident.items() if addr not in freed_resident]
    return kept + buffers


def _categorize(buffers: list[_Buffer], step: StepEvents, marks: StepMarks) -> None:
    """Label recorded buffers: gradient, optimizer state, activation (saved across the forward/backward
    boundary), or temporary."""
    times = np.array([e.time_ns for e in step.events], dtype=np.int64)
    backward_at = _count_before(times, step.backward_start_ns)
    optimizer_at = _count_before(times, step.optimizer_start_ns)
    state_at = _count_before(times, step.optimizer_end_ns)

    def live(b: _Buffer, t: int | None) -> bool:
        return t is not None and b.alloc <= t < b.free

    for b in buffers:
        if b.category:
            continue
        if b.addr in marks.grad_ptrs and live(b, optimizer_at):
            b.category = "gradient"
        elif b.addr in marks.state_ptrs and live(b, state_at):
            b.category = "optimizer"
        elif b.phase == "forward" and live(b, backward_at):
            b.category = "activation"
        else:
            b.category = "temporary"


def _run_step(workload: Workload, when: str) -> None:
    """One workload step; an exception from the user's model, loss or optimizer becomes one line."""
    try:
        workload.step()
    except MemplanError:
        raise
    except (Exception, SystemExit) as e:  # user code: sys.exit() in a loss or model is an error too
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        raise CaptureError(f"{workload.name}: the {when} step raised {type(e).__name__}"
                           + (f": {first}" if first else "")) from None


def _use_allocator_history(step: StepEvents, allocs_in_history: list[dict]) -> None:
    """On CUDA the profiler reports rounded block sizes and no stream; put back the sizes the program
    requested and the streams, taken in order from the caching allocator's history of the same step."""
    allocs = [e for e in step.events if e.size > 0]
    if len(allocs) != len(allocs_in_history):
        raise CaptureError(f"the CUDA allocator history holds {len(allocs_in_history)} allocations but the "
                           f"profiler saw {len(allocs)}: cannot recover the requested sizes")
    for event, entry in zip(allocs, allocs_in_history):
        if int(entry["addr"]) != event.addr:
            raise CaptureError(f"the CUDA allocator history and the profiler disagree at address {event.addr:#x}")
        event.size, event.stream = int(entry["size"]), int(entry.get("stream", 0))


def _record(workload: Workload, device: torch.device) -> tuple[StepEvents, StepMarks]:
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.memory._record_memory_history(context=None, max_entries=10_000_000, device=device,
                                                 clear_history=True)
    gc.disable()  # no cycle collection in the middle of the step: frees happen where the program drops them
    try:
        with marked_step(workload) as marks:
            with profile(activities=activities, profile_memory=True) as prof:
                _run_step(workload, "recorded")
                if cuda:
                    torch.cuda.synchronize(device)
        if cuda:
            index = device.index if device.index is not None else torch.cuda.current_device()
            history = torch.cuda.memory._snapshot()["device_traces"][index]
    finally:
        gc.enable()
        if cuda:
            torch.cuda.memory._record_memory_history(enabled=None, device=device)
    step = step_events(prof.profiler.kineto_results.experimental_event_tree(), device.type)
    if cuda:
        _use_allocator_history(step, [e for e in history if e["action"] == "alloc"])
    return step, marks


def capture_step(workload: Workload, *, warmup: bool = True, meta: dict | None = None) -> Trace:
    """Record one `workload.step()` (after a warm-up step unless `warmup=False`) as a labelled Trace."""
    device = workload_device(workload)
    if warmup:
        _run_step(workload, "warm-up")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    resident = resident_storages(workload, device.type)
    step, marks = _record(workload, device)
    buffers = _pair(step, resident)
    _categorize(buffers, step, marks)
    dtype = next(workload.model.parameters()).dtype
    info = {"source": "memplan trace", "model": workload.name, "layers": "baseline",
            "device": device.type, "dtype": str(dtype).replace("torch.", ""),
            "torch": torch.__version__, "warmup": warmup, "events": len(step.events)}
    info.update(meta or {})
    columns = {
        "size": [b.size for b in buffers], "alloc": [b.alloc for b in buffers],
        "free": [b.free for b in buffers], "stream": [b.stream for b in buffers],
        "addr": [b.addr for b in buffers], "category": [b.category for b in buffers],
        "phase": [b.phase for b in buffers], "op": [b.op for b in buffers],
        "module": [b.module for b in buffers],
    }
    return make_trace(columns, meta=info)
