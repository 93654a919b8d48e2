"""A recorded step repeated as a training loop runs it, so the caching allocator is simulated in the state the
program reaches its recorded step in, not from an empty cache.

A steady step ends in the state it began in: what it frees of the storages alive at its start (an optimizer
that replaces its moments, last step's output) it has made again by its end. `repeated` chains copies of the
step: copy k's buffers alive at the window's end are the ones copy k+1 frees where the step frees its
starting ones, paired by size in order. A step that does not end as it began (a first step, whose optimizer
creates its state) cannot be repeated: `RepeatError` says so.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from memplan.errors import MemplanError
from memplan.traces.format import COLUMNS, INT_COLUMNS, Trace, make_trace


class RepeatError(MemplanError):
    """The step does not end in the state it began in, so it cannot be run again as recorded."""


def successors(trace: Trace) -> dict[int, int]:
    """For each buffer the step makes and keeps past its end, the buffer alive at the start that the next step
    frees in its place (same size, in order); RepeatError when the two do not pair up."""
    end = trace.end
    started = [i for i in range(len(trace)) if trace.alloc[i] == 0 and trace.free[i] < end]
    kept = [int(i) for i in trace.recorded if trace.free[i] == end]
    by_size: dict[int, list[int]] = defaultdict(list)
    for i in sorted(started, key=lambda i: (int(trace.free[i]), i)):
        by_size[int(trace.size[i])].append(i)
    pairs = {}
    for i in kept:
        waiting = by_size.get(int(trace.size[i]))
        if not waiting:
            raise RepeatError(
                f"the step keeps a buffer of {int(trace.size[i]):,} B ({trace.op[i] or 'an op'}) past its end that "
                "no storage alive at its start matches: not a steady step (a first step?), so it cannot be repeated"
            )
        pairs[i] = waiting.pop(0)
    left = [i for sizes in by_size.values() for i in sizes]
    if left:
        raise RepeatError(
            f"the step frees {len(left)} storages alive at its start and makes none like them again: not a steady "
            "step, so it cannot be repeated"
        )
    return pairs


def repeated(trace: Trace, steps: int) -> Trace:
    """The step run `steps` times in a row as one trace (copy k's times shifted by k x the window's length); the
    storages alive throughout stay one buffer each. The last copy is the recorded step as the program reaches it."""
    if steps < 1:
        raise RepeatError(f"--steps {steps}: at least 1")
    end, n = trace.end, len(trace)
    span = end - 1  # the step's event times are 1 .. end - 1
    after = successors(trace)
    started = {i for i in range(n) if trace.alloc[i] == 0 and trace.free[i] < end}
    made = trace.recorded
    columns: dict[str, list] = {c: [] for c in COLUMNS}

    def add(i: int, alloc: int, free: int) -> None:
        for c in COLUMNS:
            if c == "alloc":
                columns[c].append(alloc)
            elif c == "free":
                columns[c].append(free)
            else:
                value = getattr(trace, c)[i]
                columns[c].append(int(value) if c in INT_COLUMNS else value)

    total_end = steps * span + 1
    for i in range(n):  # alive at the start: once, freed where the first step frees it, or never
        if trace.alloc[i] == 0:
            add(i, 0, int(trace.free[i]) if i in started else total_end)
    for k in range(steps):
        shift = k * span
        for i in made.tolist():
            free = int(trace.free[i])
            if free < end:
                free += shift
            elif k + 1 < steps:  # kept past the step: freed by the next step where it frees its predecessor
                free = int(trace.free[after[i]]) + shift + span
            else:
                free = total_end
            add(i, int(trace.alloc[i]) + shift, free)
    meta = {**trace.meta, "repeated_steps": steps}
    return make_trace(columns, meta=meta)


def last_step_peaks(reserved: np.ndarray, allocated: np.ndarray, trace: Trace, steps: int) -> tuple[int, int]:
    """(peak reserved, peak allocated) over the last copy's window of a simulation of `repeated(trace, steps)`."""
    start = (steps - 1) * (trace.end - 1) + 1
    return int(reserved[start:].max(initial=0)), int(allocated[start:].max(initial=0))
