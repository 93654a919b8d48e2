"""The memory model of a per-layer choice of modes, measured on the traces of the uniform choices.

A step's logical times fall into segments: the forward or backward of one Transformer layer (owned by
it), and the stretches between and around the layers (the embeddings, the head and loss, the
optimizer: owned by none). At any time, live bytes = what each layer's own buffers hold (buffers made
during the step whose module is inside the layer) + the rest. Within a segment, the other layers' own
bytes are what they keep (their activations, or their gradients' temporaries), so

    peak of segment s = E[s][mode of its owner] + sum over other layers j of H[j][s][mode of j]

where E is the segment's most bytes apart from the other layers' own, and H a layer's most own bytes in
the segment. A layer's bytes depend on its own mode and on the next layer's: the layer's output is made
by it and kept for backward by the next one (an in-place LayerNorm keeps it overwritten, a checkpointed
layer as its input). So E and H are read per context (a layer's mode, the next layer's) off traces
that together show every context at every layer (assignments_to_trace). Sums of maxima bound the
maximum of sums, so the model never predicts less than a measured trace shows. Sizes are rounded up to
the plan's alignment, as the solver packs them.

A step-level action (the loss fused, the optimizer's state made smaller) changes the bytes outside the layers: the
head's logits, the optimizer's state held through the step. Its term is a delta per segment, the action's trace
less the step's own, both with every layer as built; chosen actions add their deltas. That they add up, and hold
under other layer modes, is the model's assumption: the chosen configuration's own trace is the check.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np

from memplan.errors import MemplanError
from memplan.planner.problem import align_up
from memplan.traces.format import Trace, live_bytes
from memplan.traces.step_marks import ROOT_MODULE

Mode = str  # a per-layer mode (planner.layers.PER_LAYER_MODES)
Bytes = int
Assignment = tuple[Mode, ...]  # a mode per layer, in the order of the model's layers
Context = tuple[Mode | None, Mode | None]  # a layer's mode and the next layer's (None: no layer there)
Action = tuple[str, str]  # a step-level choice: its family ("loss", "optimizer") and the choice ("fused")
Segment = tuple[str, int, int]  # (phase, owning layer or -1, the layer the phase last ran or -1)
PREFIX = -1  # the step's buffers made in forward before the first layer (the embeddings): the first layer's
#              mode decides how long they live (as its kept input, or overwritten in place, or not at all)


class TermsError(MemplanError):
    """The traces cannot give a per-layer model (no layers found, segments that do not line up)."""


def contexts(assignment: Assignment) -> dict[int, Context]:
    """Each layer's context in an assignment: its mode and the next layer's (None after the last); and the
    PREFIX's, which has no mode and is followed by the first layer."""
    around = {j: (mode, assignment[j + 1] if j + 1 < len(assignment) else None) for j, mode in enumerate(assignment)}
    return {PREFIX: (None, assignment[0]), **around}


def owner_of(segment: Segment) -> int | None:
    """The layer a segment belongs to, None when no layer owns it."""
    return segment[1] if segment[1] >= 0 else None


@dataclass(frozen=True)
class MemoryTerms:
    """Per-segment bytes of the measured traces: enough to predict the peak of any per-layer assignment."""

    layers: tuple[str, ...]  # layer paths, in order (module paths relative to the model)
    modes: tuple[Mode, ...]  # the modes a layer may take
    segments: tuple[Segment, ...]  # in the order of the first trace
    own: dict[tuple[Segment, Context | None], Bytes]  # E: by its owner's context (None: a segment no layer owns)
    held: dict[tuple[int, Segment, Context], Bytes]  # H: layer j's (or the PREFIX's) most bytes, by its context
    deltas: dict[Action, dict[Segment, Bytes]] = field(default_factory=dict)  # a step-level action's, per segment

    def segment_peak(self, segment: Segment, assignment: Assignment, actions: tuple[Action, ...] = ()) -> Bytes:
        """The model's peak of one segment under `assignment` (a mode per layer) with the step-level `actions`."""
        around, owner = contexts(assignment), owner_of(segment)
        others = sum(self.held[j, segment, c] for j, c in around.items() if j != owner)
        changed = sum(self.deltas[action][segment] for action in actions)
        return self.own[segment, None if owner is None else around[owner]] + others + changed

    def peak(self, assignment: Assignment, actions: tuple[Action, ...] = ()) -> Bytes:
        """The model's peak live bytes of the whole step under `assignment` with the step-level `actions`."""
        return max(self.segment_peak(s, assignment, actions) for s in self.segments)

    def with_deltas(self, deltas: dict[Action, dict[Segment, Bytes]]) -> MemoryTerms:
        """These terms with step-level actions' deltas (action_deltas) added."""
        return replace(self, deltas={**self.deltas, **deltas})


def assignments_to_trace(modes: tuple[Mode, ...], count: int) -> list[Assignment]:
    """Assignments whose traces measure every context at every layer: each mode on every layer, and each
    ordered pair of modes alternating from the first layer (m, n, m, n, ...)."""
    uniform = [tuple(m for _ in range(count)) for m in modes]
    if count < 2:
        return uniform
    pairs = [(m, n) for m in modes for n in modes if m != n]
    return uniform + [tuple(pair[j % 2] for j in range(count)) for pair in pairs]


def layer_of(module: str, layers: tuple[str, ...]) -> int:
    """Index of the layer whose subtree holds `module` (a trace label `model.<path>...`), or -1."""
    for index, path in enumerate(layers):
        label = f"{ROOT_MODULE}.{path}"
        if module == label or module.startswith(label + "."):
            return index
    return -1


def segment_of_times(trace: Trace, layers: tuple[str, ...]) -> dict[int, Segment]:
    """The segment of every allocation time: its phase, its layer, and the layer its phase last ran."""
    segments: dict[int, Segment] = {}
    last: dict[str, int] = {}
    for i in trace.recorded:
        phase, owner = trace.phase[i], layer_of(trace.module[i], layers)
        if owner >= 0:
            last[phase] = owner
        segments[int(trace.alloc[i])] = (phase, owner, owner if owner >= 0 else last.get(phase, -1))
    return segments


def owners(trace: Trace, layers: tuple[str, ...], segment_at: dict[int, Segment]) -> np.ndarray:
    """Each buffer's owner: its layer's index, PREFIX for one made before the first layer outside any layer, or -2
    for the rest (resident storages, the head's and the optimizer's buffers)."""
    first = next(iter(segment_at.values()))  # the segment before the first layer: the PREFIX's
    return np.array(
        [
            -2
            if a == 0
            else layer_of(m, layers)
            if layer_of(m, layers) >= 0
            else PREFIX
            if segment_at[a] == first
            else -2
            for m, a in zip(trace.module, trace.alloc.tolist())
        ]
    )


def measure(trace: Trace, layers: tuple[str, ...], alignment: int) -> tuple[dict, dict]:
    """One uniform trace's E (per segment) and H (per layer and segment)."""
    # 1. Live bytes of the whole step, and of each layer's own buffers, at every time.
    size = align_up(trace.size.astype(np.int64), alignment)
    end = trace.end
    total = live_bytes(size, trace.alloc, trace.free, end)
    segment_at = segment_of_times(trace, layers)
    owner = owners(trace, layers, segment_at)
    indices = [PREFIX, *range(len(layers))]
    own = {j: live_bytes(np.where(owner == j, size, 0), trace.alloc, trace.free, end) for j in indices}
    # 2. Per segment, the most of everything but the other layers (and the PREFIX), and each one's most.
    times: dict[Segment, list[int]] = {}
    for t, segment in segment_at.items():
        times.setdefault(segment, []).append(t)
    everything_but, held = {}, {}
    for segment, ts in times.items():
        at = np.array(ts)
        others = sum(own[j][at] for j in indices if j != owner_of(segment))
        everything_but[segment] = int((total[at] - others).max())
        for j in indices:
            held[j, segment] = int(own[j][at].max())
    return everything_but, held


def measure_all(
    traces: dict[Assignment, Trace], layers: tuple[str, ...], alignment: int
) -> Iterator[tuple[Assignment, Trace, dict, dict]]:
    """Each trace with its E and H (`measure`), in order; TermsError when one's segments are not the first's (its
    layers ran in another order)."""
    if not layers:
        raise TermsError("the model has no list of Transformer layers to choose modes for")
    first = None
    for assignment, trace in traces.items():
        everything_but, held = measure(trace, layers, alignment)
        if first is not None and set(everything_but) != first:
            raise TermsError(
                f"the trace of {', '.join(assignment)} runs the layers in another order: no per-layer model"
            )
        first = set(everything_but)
        yield assignment, trace, everything_but, held


def memory_terms(traces: dict[Assignment, Trace], layers: tuple[str, ...], alignment: int = 512) -> MemoryTerms:
    """The model from traces of the assignments_to_trace: a context measured twice keeps its larger bytes."""
    own: dict[tuple[Segment, Context | None], Bytes] = {}
    held: dict[tuple[int, Segment, Context], Bytes] = {}
    segments: tuple[Segment, ...] = ()
    for assignment, _, everything_but, most in measure_all(traces, layers, alignment):
        segments = segments or tuple(everything_but)
        around = contexts(assignment)
        for segment, value in everything_but.items():
            key = (segment, None if owner_of(segment) is None else around[owner_of(segment)])
            own[key] = max(own.get(key, 0), value)
        for (j, segment), value in most.items():
            held[j, segment, around[j]] = max(held.get((j, segment, around[j]), 0), value)
    modes = tuple(dict.fromkeys(m for assignment in traces for m in assignment))
    return MemoryTerms(tuple(layers), modes, segments, own, held)


def segment_peaks(
    trace: Trace, layers: tuple[str, ...], alignment: int = 512, known: set[Segment] | None = None
) -> dict[Segment, Bytes]:
    """The most live bytes (aligned) of each segment of a trace; with `known`, a time in a segment not known counts
    in the last known segment before it (an action's own stretch, such as a host optimizer's copies, joins the
    stretch it runs in)."""
    size = align_up(trace.size.astype(np.int64), alignment)
    total = live_bytes(size, trace.alloc, trace.free, trace.end)
    peaks: dict[Segment, Bytes] = {}
    last = None
    for t, segment in sorted(segment_of_times(trace, layers).items()):
        if known is not None and segment not in known:
            segment = last
        if segment is None:
            continue
        last = segment
        peaks[segment] = max(peaks.get(segment, 0), int(total[t]))
    return peaks


def action_deltas(base: Trace, action: Trace, layers: tuple[str, ...], alignment: int = 512) -> dict[Segment, Bytes]:
    """A step-level action's term: per segment of the step's own trace, the action's trace's peak less the step's
    (every layer as built in both); a segment the action's trace lacks keeps the step's bytes (delta 0)."""
    before = segment_peaks(base, layers, alignment)
    after = segment_peaks(action, layers, alignment, known=set(before))
    return {segment: after.get(segment, peak) - peak for segment, peak in before.items()}
