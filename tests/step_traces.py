"""Synthetic training-step traces for the simulate, plot and compare tests: every category and phase.

The step follows a real one's shape: parameters and optimizer state exist before recording, the
forward pass keeps one activation per layer and frees a temporary, the backward pass frees the
activations in reverse and allocates gradients, the optimizer allocates and frees temporaries.
`bytes_by_category` totals any trace's bytes per category and `buffer_events` lists what fake and real
traces of one step share, for tests that compare two traces.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from memplan.traces import make_trace
from memplan.traces.format import Trace


def step_trace(
    layers: int = 4, activation: int = 3 << 20, param: int = 1 << 20, seed: int = 0, meta: dict | None = None
) -> Trace:
    """A one-stream step of `layers` layers; sizes vary by a random factor so traces differ by seed."""
    rng = np.random.default_rng(seed)
    rows: list[dict] = []  # size, category, phase, module, alloc event, free event (None: never freed)
    events: list[tuple[int, str]] = []  # (row, "alloc" | "free") in program order

    def new(size, category, phase, module, before_recording=False):
        rows.append(
            {
                "size": int(size),
                "category": category,
                "phase": phase,
                "module": module,
                "alloc": 0 if before_recording else None,
                "free": None,
            }
        )
        if not before_recording:
            events.append((len(rows) - 1, "alloc"))
        return len(rows) - 1

    def free(row):
        events.append((row, "free"))

    jitter = lambda base: int(base * rng.uniform(0.6, 1.4)) // 4 * 4  # noqa: E731
    params = [new(jitter(param), "parameter", "other", f"layer.{i}", True) for i in range(layers)]
    for p in params:
        for _ in range(2):
            new(rows[p]["size"], "optimizer", "other", rows[p]["module"], True)
    batch = new(activation // 4, "input", "forward", "")
    acts = []
    for i in range(layers):
        tmp = new(jitter(activation) // 2, "temporary", "forward", f"layer.{i}")
        acts.append(new(jitter(activation), "activation", "forward", f"layer.{i}"))
        free(tmp)
    grads = []
    for i in reversed(range(layers)):
        tmp = new(jitter(activation), "temporary", "backward", f"layer.{i}")
        grads.append(new(rows[params[i]]["size"], "gradient", "backward", f"layer.{i}"))
        free(tmp)
        free(acts[i])
    free(batch)
    for g in grads:
        tmp = new(rows[g]["size"], "temporary", "optimizer", rows[g]["module"])
        free(tmp)
    for t, (row, kind) in enumerate(events, start=1):
        rows[row][kind] = t
    end = len(events) + 1
    return make_trace(
        {
            "size": [r["size"] for r in rows],
            "alloc": [r["alloc"] for r in rows],
            "free": [end if r["free"] is None else r["free"] for r in rows],
            "category": [r["category"] for r in rows],
            "phase": [r["phase"] for r in rows],
            "module": [r["module"] for r in rows],
        },
        meta=meta if meta is not None else {"model": "synthetic", "layers": "baseline"},
    )


def bytes_by_category(trace: Trace) -> Counter:
    """Bytes of every buffer of `trace`, summed per category."""
    totals: Counter = Counter()
    for size, category in zip(trace.size, trace.category):
        totals[category] += int(size)
    return totals


def state_bytes(trace: Trace) -> Counter:
    """Bytes of the buffers alive when the step begins (parameters, optimizer state, inputs), summed per category."""
    totals: Counter = Counter()
    for size, alloc, category in zip(trace.size, trace.alloc, trace.category):
        if alloc == 0:
            totals[category] += int(size)
    return totals


def buffer_events(trace: Trace) -> list[tuple]:
    """The buffers alive at the start (size and labels, in order), then every allocation (+size) and free (-size)
    of a buffer an op returned, in time order with its labels: what a fake and a real trace of one step share
    (a real one also holds kernels' own buffers, marked internal)."""

    def labelled(i: int, size: int) -> tuple:
        return (size, trace.op[i], trace.module[i], trace.phase[i], trace.category[i])

    state = [labelled(i, int(trace.size[i])) for i in range(len(trace)) if trace.alloc[i] == 0]
    timed = []
    for i in range(len(trace)):
        if trace.alloc[i] > 0 and not trace.internal[i]:
            timed.append((int(trace.alloc[i]), labelled(i, int(trace.size[i]))))
        if trace.free[i] < trace.end and not trace.internal[i]:
            timed.append((int(trace.free[i]), labelled(i, -int(trace.size[i]))))
    return state + [event for _, event in sorted(timed)]
