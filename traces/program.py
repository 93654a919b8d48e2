"""The whole program as a trace: every allocation and free the recorder saw from its start (construction, moves,
warm-up steps, the measured step, what follows), with each training step's window, so a verdict simulates the cache
the measured step meets rather than an empty one.

Logical time counts the program's kept events (1, 2, ...; 0 for storages adopted before recording began). The
measured step's buffers are the step trace's own, with its labels, requested sizes and streams; the rest take the
recorder's labels, and a category from where they live in their step (categories below).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from memplan.traces.format import PHASES, Program, ProgramStep, Trace, make_trace
from memplan.traces.recorder import BACKWARD, FORWARD, OPTIMIZER, Events


@dataclass(frozen=True)
class StepWindow:
    """A training step as the capture marked it: indices into the recorder's marks, and whether it is measured."""

    start_mark: int
    end_mark: int
    measured: bool = False


@dataclass(frozen=True)
class MeasuredStep:
    """The measured step's trace, the storage key of each of its buffers, and the mark its events begin at."""

    trace: Trace
    keys: Sequence[int]
    start_mark: int


def _window_categories(alloc: np.ndarray, free: np.ndarray, phase: np.ndarray, step: ProgramStep) -> dict[int, str]:
    """Categories of the buffers allocated in one unmeasured step, from when they live: made in the optimizer and kept
    past the step, optimizer state; made in backward and alive when the optimizer begins, a gradient; made in forward
    and alive when backward begins, an activation; the rest temporary."""
    inside = np.flatnonzero((alloc >= step.start) & (alloc < step.end))
    order = np.argsort(alloc[inside], kind="stable")
    first = {}
    for i in inside[order]:
        first.setdefault(int(phase[i]), int(alloc[i]))
    backward_at, optimizer_at = first.get(BACKWARD), first.get(OPTIMIZER)
    out = {}
    for i in inside:
        a, f, ph = int(alloc[i]), int(free[i]), int(phase[i])
        if ph == OPTIMIZER and f >= step.end:
            out[int(i)] = "optimizer"
        elif ph == BACKWARD and optimizer_at is not None and a < optimizer_at < f:
            out[int(i)] = "gradient"
        elif ph == FORWARD and backward_at is not None and a < backward_at < f:
            out[int(i)] = "activation"
        else:
            out[int(i)] = "temporary"
    return out


def assemble_program(
    events: Events,
    marks: list[int],
    adopted: list[int],
    adopted_sizes: dict[int, int],
    names: list[str],
    windows: list[StepWindow],
    measured: MeasuredStep | None,
    meta: dict,
) -> Program:
    """The Program of a capture's events: one buffer per allocation (and per adopted storage, at time 0), freed where
    its free event is (else at the end), the steps' windows from their marks; the measured step's buffers take that
    step's labels, sizes and streams."""
    # 1. Buffers from the events, in allocation order.
    size, alloc, free, key_of, op, module, phase = [], [], [], [], [], [], []
    open_at: dict[int, int] = {}
    for key in adopted:
        open_at[key] = len(size)
        size.append(adopted_sizes.get(key, 0)), alloc.append(0), free.append(-1), key_of.append(key)
        op.append(0), module.append(0), phase.append(len(PHASES) - 1)
    columns = (events.key, events.size, events.op, events.module, events.phase)
    for t, (key, nbytes, o, m, ph) in enumerate(zip(*(c.tolist() for c in columns)), start=1):
        if nbytes > 0:
            open_at[key] = len(size)
            size.append(nbytes), alloc.append(t), free.append(-1), key_of.append(key)
            op.append(o), module.append(m), phase.append(ph)
        elif key in open_at:
            free[open_at.pop(key)] = t
    end = len(events) + 1
    free = [end if f < 0 else f for f in free]
    steps = [ProgramStep(marks[w.start_mark] + 1, marks[w.end_mark] + 1, w.measured) for w in windows]
    n = len(size)
    alloc_a, free_a, phase_a = np.asarray(alloc, np.int64), np.asarray(free, np.int64), np.asarray(phase, np.int64)
    # 2. Labels: the recorder's, a category from the step each buffer was made in.
    category = ["unknown"] * n
    for step in steps:
        for i, c in _window_categories(alloc_a, free_a, phase_a, step).items():
            category[i] = c
    starts = [s.start for s in steps]
    for i in range(n):
        if category[i] == "unknown" and alloc[i] > 0 and (not starts or alloc[i] < starts[0]):
            category[i] = "parameter" if free[i] == end else "temporary"  # built, and kept or dropped
    labels = {
        "op": [names[o] for o in op],
        "module": [names[m] for m in module],
        "phase": [PHASES[p] for p in phase],
        "category": category,
    }
    stream = [0] * n
    # 3. The measured step's buffers are the step trace's: its labels, requested sizes, streams and moved frees.
    if measured is not None:
        _take_step_labels(measured, marks, size, free, stream, labels, key_of, alloc_a, free_a)
    program = make_trace({"size": size, "alloc": alloc, "free": free, "stream": stream, **labels}, meta=meta)
    return Program(program, steps)


def _take_step_labels(measured, marks, size, free, stream, labels, key_of, alloc_a, free_a) -> None:
    """Copy the measured step's labels, sizes, streams and (record_stream-moved) frees onto its program buffers:
    a buffer it allocated is the program's of the same storage allocated at the same time; one alive when it began
    is the program's of the same storage alive then."""
    step, offset = measured.trace, marks[measured.start_mark]  # step time t is program time offset + t
    step_end = step.end
    by_alloc = {(key_of[i], int(alloc_a[i])): i for i in range(len(key_of))}
    alive = {}
    for i in np.flatnonzero((alloc_a <= offset) & (free_a > offset)).tolist():
        alive[key_of[i]] = i
    allocs = step.alloc.tolist()
    frees = step.free.tolist()
    for j, key in enumerate(measured.keys):
        i = by_alloc.get((key, offset + allocs[j])) if allocs[j] > 0 else alive.get(key)
        if i is None:
            continue
        size[i], stream[i] = int(step.size[j]), int(step.stream[j])
        # a buffer made in the step takes all its labels; one alive when it began keeps when (op, phase) it was made
        for name in ("op", "module", "phase", "category") if allocs[j] > 0 else ("module", "category"):
            value = getattr(step, name)[j]
            if value or name != "module":
                labels[name][i] = value
        if frees[j] < step_end:
            free[i] = offset + frees[j]


def step_view(program: Program, k: int) -> Trace:
    """Step `k` of the program as a step trace, the form a capture gives its measured step: the storages alive when it
    begins at time 0, its events at times 1, 2, ..., what outlives it freed at its end; the program attached, with
    step `k` marked measured."""
    trace, step = program.trace, program.steps[k]
    offset = step.start - 1  # the step's time t is the program's offset + t
    inside = np.flatnonzero((trace.alloc < step.end) & (trace.free > offset))
    end = step.end - offset
    alloc = np.maximum(trace.alloc[inside] - offset, 0)
    free = np.minimum(trace.free[inside] - offset, end)
    columns = {
        "size": trace.size[inside], "alloc": alloc, "free": free, "stream": trace.stream[inside],
        "addr": trace.addr[inside], "internal": trace.internal[inside],
        **{name: [getattr(trace, name)[i] for i in inside] for name in ("category", "phase", "op", "module")},
    }  # fmt: skip
    syncs = [(t - offset, a, b) for t, a, b in trace.syncs if offset < t < step.end]
    view = make_trace(columns, syncs=syncs, meta={**trace.meta, "step": k + 1})
    steps = [ProgramStep(s.start, s.end, i == k) for i, s in enumerate(program.steps)]
    view.program = Program(trace, steps)
    return view
