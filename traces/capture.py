"""Capture one training step as a trace: every allocation and free of the device's allocator.

`capture_step` installs the step recorder (traces/recorder.py) before the workload is built, runs a
warm-up step (it creates the optimizer state and settles lazy initialisation), then records exactly
one `workload.step()`. The recorded buffers, in allocation order, are the allocations the allocator
served during that step (0-byte requests are not served and not recorded). Every storage alive when
the step begins is a buffer with allocation time 0, freed where the program drops its last reference
(an optimizer that replaces its state, a module that rebinds a buffer), or at the end.

With `fake=True` the workload is built and stepped under fake tensors (traces/fake.py): nothing is
allocated or computed, and the trace holds every storage the program's ops return, with the same
labels. On CUDA the caching allocator's history of the step gives the requested (unrounded) sizes
and the streams. A real CPU capture runs on one intra-op thread (see `one_cpu_thread`).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from memplan.traces.errors import MemplanError
from memplan.traces.fake import DATA_RULE, FakeCapture
from memplan.traces.format import PHASES, Trace, make_trace
from memplan.traces.recorder import Events, Recorder, recording
from memplan.traces.resident import resident_storages, resident_tensors
from memplan.traces.step_marks import StepMarks, marked_step
from memplan.traces.workload import Workload

SCALAR_OP = "python scalar"  # an allocation outside any op: a Python number wrapped as a tensor


class CaptureError(MemplanError):
    """A workload cannot be captured (no parameters, unsupported device, inconsistent events)."""


@dataclass
class _Buffer:
    """One buffer while the trace is assembled."""

    size: int
    alloc: int
    free: int
    key: int
    phase: str
    module: str
    op: str
    category: str = ""
    stream: int = 0


@contextlib.contextmanager
def one_cpu_thread(device: torch.device) -> Iterator[None]:
    """CPU steps inside run on one intra-op thread. With more, a kernel that splits its work over threads
    allocates per-thread scratch on worker threads, in an order that changes from run to run, so no two
    steps allocate the same sequence (a GPU step has no such allocations). Capture and replay use it."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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


def _run(what: str, name: str, call: Callable):
    """Run user code (build, a step); an exception from it becomes one line."""
    try:
        return call()
    except MemplanError:
        raise
    except (Exception, SystemExit) as e:  # user code: sys.exit() in a loss or model is an error too
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        raise CaptureError(f"{name}: the {what} raised {type(e).__name__}" + (f": {first}" if first else "")) from None


def _assemble(live: Events, step: Events, names: list[str], resident: dict) -> list[_Buffer]:
    """Buffers from the storages alive at the start (alloc 0) and the step's events (times 1, 2, ...)."""
    end = len(step) + 1
    buffers: list[_Buffer] = []
    index: dict[int, int] = {}  # storage key -> its buffer, while live
    for key, size, module in zip(live.key.tolist(), live.size.tolist(), live.module.tolist()):
        known = resident.get(key)
        buffers.append(
            _Buffer(
                known.size if known else size,
                0,
                end,
                key,
                "other",
                known.module if known else names[module],
                "",
                known.category if known else "unknown",
            )
        )
        index[key] = len(buffers) - 1
    for t, (key, size, op, module, phase) in enumerate(
        zip(step.key.tolist(), step.size.tolist(), step.op.tolist(), step.module.tolist(), step.phase.tolist()), start=1
    ):
        if size > 0:
            index[key] = len(buffers)
            buffers.append(_Buffer(size, t, end, key, PHASES[phase], names[module], names[op] or SCALAR_OP))
        else:
            buffers[index.pop(key)].free = t
    return buffers


def _categorize(buffers: list[_Buffer], marks: StepMarks) -> None:
    """Label the step's buffers: gradient, optimizer state, activation (saved across the forward/backward
    boundary), or temporary."""

    def live(b: _Buffer, t: int | None) -> bool:
        return t is not None and b.alloc <= t < b.free

    for b in buffers:
        if b.category:
            continue
        if b.key in marks.grad_keys and live(b, marks.optimizer_at):
            b.category = "gradient"
        elif b.key in marks.state_keys and live(b, marks.optimizer_end):
            b.category = "optimizer"
        elif b.phase == "forward" and live(b, marks.backward_at):
            b.category = "activation"
        else:
            b.category = "temporary"


def _requested_sizes(buffers: list[_Buffer], history: list[dict]) -> None:
    """On CUDA the allocator reports rounded block sizes: put back the sizes the program requested and
    the streams, taken in order from the caching allocator's history of the same step."""
    allocated = [b for b in buffers if b.alloc > 0]
    entries = [e for e in history if e["action"] == "alloc"]
    if len(allocated) != len(entries):
        raise CaptureError(
            f"the CUDA allocator history holds {len(entries)} allocations but the recorder "
            f"saw {len(allocated)}: cannot recover the requested sizes"
        )
    for b, entry in zip(allocated, entries):
        if int(entry["addr"]) != b.key:
            raise CaptureError(f"the CUDA allocator history and the recorder disagree at address {b.key:#x}")
        b.size, b.stream = int(entry["size"]), int(entry.get("stream", 0))


@contextlib.contextmanager
def _cuda_history(device: torch.device):
    """The caching allocator's history of the block (a list filled in when it ends)."""
    history: list[dict] = []
    torch.cuda.memory._record_memory_history(context=None, max_entries=10_000_000, device=device, clear_history=True)
    try:
        yield history
        torch.cuda.synchronize(device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        history.extend(torch.cuda.memory._snapshot()["device_traces"][index])
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, device=device)


def _resident_at_start(workload: Workload, recorder: Recorder, live: Events) -> dict:
    """Labels of the storages alive as the step begins; every storage the workload holds must be among
    them (one allocated before recording began would be invisible)."""
    alive = set(live.key.tolist())
    outside = [
        t
        for t, _, _ in resident_tensors(workload)
        if t.untyped_storage().nbytes() > 0 and recorder.storage_key(t) not in alive
    ]
    if outside:
        raise CaptureError(
            f"{workload.name}: {len(outside)} of its tensors existed before recording began: "
            "pass capture_step a function that builds the workload, not a built one"
        )
    return resident_storages(workload, recorder.storage_key, alive)


def _record_step(workload: Workload, recorder: Recorder, device: torch.device, fake: bool):
    """Record one step: (storages alive at its start, their labels, its events, marks, CUDA history)."""
    gc.collect(1)  # the warm-up's cyclic garbage is young; a full collection costs ~0.1 s in a torch process
    live = recorder.begin_step()
    resident = _resident_at_start(workload, recorder, live)
    gc.disable()  # no cycle collection in the middle of the step: frees happen where the program drops them
    try:
        with contextlib.ExitStack() as stack:
            history = stack.enter_context(_cuda_history(device)) if device.type == "cuda" and not fake else None
            with marked_step(workload, recorder) as marks:
                _run("recorded step", workload.name, workload.step)
            step = recorder.end_step()
    finally:
        gc.enable()
    return live, resident, step, marks, history


def capture_step(
    build: Callable[[], Workload],
    device: str | torch.device = "cpu",
    *,
    fake: bool = False,
    warmup: bool = True,
    meta: dict | None = None,
) -> Trace:
    """Build a workload with `build()` and record one `workload.step()` (after a warm-up step unless
    `warmup=False`) on `device` as a labelled Trace; with `fake`, under fake tensors."""
    device = torch.device(device)
    with one_cpu_thread(device), recording(device, fake=fake) as recorder:
        fake_mode = FakeCapture(recorder) if fake else None
        with fake_mode or contextlib.nullcontext():
            workload = build()
            actual = workload_device(workload)
            if actual.type != device.type:
                raise CaptureError(f"{workload.name}: the model is on {actual.type}, the capture on {device.type}")
            if warmup:
                _run("warm-up step", workload.name, workload.step)
            if device.type == "cuda" and not fake:
                torch.cuda.synchronize(device)
            live, resident, step, marks, history = _record_step(workload, recorder, actual, fake)
            names = recorder.names()
            dtype = next(workload.model.parameters()).dtype
            name = workload.name
            del workload
    buffers = _assemble(live, step, names, resident)
    _categorize(buffers, marks)
    if history is not None:
        _requested_sizes(buffers, history)
    info = {
        "source": "memplan trace",
        "model": name,
        "layers": "baseline",
        "device": device.type,
        "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__,
        "warmup": warmup,
        "fake": fake,
        "events": len(step),
    }
    if fake_mode is not None:
        info.update(data_rule=DATA_RULE, data_dependent=dict(fake_mode.data_dependent))
    info.update(meta or {})
    columns = {
        "size": [b.size for b in buffers],
        "alloc": [b.alloc for b in buffers],
        "free": [b.free for b in buffers],
        "stream": [b.stream for b in buffers],
        "addr": [b.key if not fake else -1 for b in buffers],
        "category": [b.category for b in buffers],
        "phase": [b.phase for b in buffers],
        "op": [b.op for b in buffers],
        "module": [b.module for b in buffers],
    }
    return make_trace(columns, meta=info)
