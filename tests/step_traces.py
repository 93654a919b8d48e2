"""Synthetic training-step traces for the simulate, plot and compare tests: every category and phase.

The step follows a real one's shape: parameters and optimizer state exist before recording, the
forward pass keeps one activation per layer and frees a temporary, the backward pass frees the
activations in reverse and allocates gradients, the optimizer allocates and frees temporaries.
`bytes_by_category` totals any trace's bytes per category and `buffer_events` lists what fake and real
traces of one step share, for tests that compare two traces; `comparable` what a fake rank and a gloo rank share
when gloo's threads time some frees.
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


GLOO_REDUCE_SCATTER = "c10d::_reduce_scatter_base_"  # gloo's own buffers: an all-reduce and a copy of the slice
FSDP_COLLECTIVES = (
    "all_gather",
    "reduce_scatter",
)  # the op of FSDP2's collective buffers (traces/ranks/communication.py)


def gloo_held(event: tuple) -> bool:
    """A buffer a gloo collective works on: gloo's worker thread holds it until it takes its next work, so the
    program's last reference may not be the last, and its free comes when that thread lets go (the recorder sees it
    there). FSDP2's all-gather outputs and reduce-scatter inputs, a functional all-reduce's clone (tensor
    parallelism's, forward and backward), or a reduce-scatter's input or output made in backward."""
    size, op, module, phase, category = event
    return (
        op in FSDP_COLLECTIVES
        or (op == "aten::clone" and module != "loss")
        or (op == "aten::empty" and phase == "backward")
    )


def comparable(trace: Trace, gloo: bool = False) -> tuple[list[tuple], list[tuple]]:
    """(every allocation in order with its size and labels, and the buffer events of the buffers no collective
    holds, frees and categories included); on a gloo rank without gloo's own reduce-scatter buffers and CPU scalars.
    A buffer's category follows its free (a temporary outlives its forward as an activation), so an allocation in
    forward or backward is compared without it."""
    events = buffer_events(trace)
    if gloo:
        events = [e for e in events if e[-1] != "unknown" and e[1] != GLOO_REDUCE_SCATTER]
    allocated = [e if e[3] == "other" else e[:4] for e in events if e[0] > 0]
    return allocated, [e for e in events if not gloo_held(e)]


def unfreed_collective_buffers(trace: Trace) -> list[int]:
    """Sizes of FSDP2's collective buffers made in the step and never freed in it (each is freed within its step)."""
    return [
        int(trace.size[i])
        for i in range(len(trace))
        if trace.op[i] in FSDP_COLLECTIVES and trace.alloc[i] > 0 and trace.free[i] == trace.end
    ]


def first_difference(fake: tuple[list, list], gloo: tuple[list, list]) -> str:
    """Where two `comparable` results part (empty when equal): which list, the index, and the entries about it, so
    that a rank that differs once in many runs (gloo's threads time some frees) says how."""
    for name, a, b in zip(("allocations", "events"), fake, gloo):
        if a != b:
            index = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            window = slice(max(0, index - 2), index + 3)
            return f"{name} part at {index} of {len(a)} (fake) and {len(b)} (gloo): fake {a[window]}, gloo {b[window]}"
    return ""


def off_default_sizes(trace: Trace) -> list[int]:
    """Sizes of the buffers off the default stream (stream 0), in the order they were allocated."""
    by_time = sorted(range(len(trace)), key=lambda i: trace.alloc[i])
    return [int(trace.size[i]) for i in by_time if trace.stream[i]]
