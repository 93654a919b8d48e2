"""Fewer traces when the layers are alike: the memory model of terms.py from the uniform traces and a few walks.

terms.assignments_to_trace measures every context (a layer's mode, the next layer's) at every layer: M uniform and
M(M-1) alternating traces for M modes. When the layers are alike (a stack of one block, as in every decoder here),
a layer's bytes in a segment depend on its context and on where the segment falls relative to the layer, not on
which layer it is. So a context measured at one layer stands for it at every layer, and the M(M-1) pairs of
distinct modes fit in walks through the modes, about L-4 pairs a trace of L layers: 8 modes on 32 layers take 8 +
2 traces instead of 64.

Where a segment falls relative to a layer is its relation: the segment's phase, and its distance from the layer in
the order the phase runs the layers (backward runs them last to first), in half-layers (a stretch owned by no
layer lies half-way after the layer its phase last ran), two or more layers away counted as one far relation on
each side. That the layers are alike is checked on the uniform traces: every relation and context has the same
bytes at every layer that shows it. Where walks show less than pairs, the model takes more, never less:
- a relation a walk did not show for a context (the first layer's edges) takes the most its mode shows with any
  next mode;
- a layer's own segments take the most its mode shows in any context (they vary with the layer before too);
- the embeddings' buffers (terms.PREFIX) count wherever any trace shows them in a stretch: how long a position
  table lives is any later layer's doing, and walks show few layers after each first mode.
The chosen configuration's own trace remains the check of the model, as for terms.py.
"""

from __future__ import annotations

import numpy as np

from memplan.planner.optimize.terms import (
    PREFIX,
    Assignment,
    Bytes,
    Context,
    MemoryTerms,
    Mode,
    Segment,
    TermsError,
    contexts,
    measure,
    measure_all,
    owner_of,
    owners,
    segment_of_times,
)
from memplan.planner.problem import align_up
from memplan.traces.format import Trace

FAR = 3  # half-layers: a relation this far or farther is one relation on its side
EDGE = 2  # walks start at this layer and end this many layers before the last: every relation shows in them
Relation = tuple[str, int | None]  # a segment's phase, and its distance from the layer in half-layers (None: the
#                                   phase runs no layer)
Spans = dict[int, tuple[Bytes, set[Segment]]]  # the PREFIX's buffers in the order made: size, the segments it lives in


def walks_to_trace(modes: tuple[Mode, ...], count: int) -> list[Assignment] | None:
    """Assignments whose consecutive layers show every ordered pair of distinct modes, each pair at layers EDGE to
    count - EDGE - 1 (the layers before the walk take its first mode, those after its last); None when the model
    is too short for a walk."""
    if len(modes) < 2:
        return []
    per_trace = count - 2 * EDGE  # pairs a trace shows between layers EDGE and count - EDGE - 1
    if per_trace < 1:
        return None
    # 1. One closed walk through every ordered pair of distinct modes (each mode has as many pairs in as out).
    unused = {m: [n for n in modes if n != m] for m in modes}
    stack, walk = [modes[0]], []
    while stack:
        if unused[stack[-1]]:
            stack.append(unused[stack[-1]].pop(0))
        else:
            walk.append(stack.pop())
    walk.reverse()
    # 2. Cut into pieces of per_trace pairs, each placed from layer EDGE and padded with its ends' modes.
    assignments = []
    for start in range(0, len(walk) - 1, per_trace):
        piece = walk[start : start + per_trace + 1]
        padded = [piece[0]] * EDGE + piece + [piece[-1]] * (count - EDGE - len(piece))
        assignments.append(tuple(padded))
    return assignments


def phase_orders(segments: tuple[Segment, ...], count: int) -> dict[str, dict[int, int]]:
    """For each phase that runs layers, each layer's place in the order it runs them (first to last in forward,
    last to first in backward)."""
    seen: dict[str, list[int]] = {}
    for phase, owner, _ in segments:
        if owner >= 0:
            seen.setdefault(phase, []).append(owner)
    orders = {}
    for phase, run in seen.items():
        ascending = run[0] <= run[-1]
        orders[phase] = {j: (j if ascending else count - 1 - j) for j in range(count)}
    return orders


def relation(segment: Segment, layer: int, orders: dict[str, dict[int, int]]) -> Relation:
    """Where `segment` falls relative to `layer`: its phase and its distance in half-layers, FAR or more as FAR."""
    phase, owner, last = segment
    order = orders.get(phase)
    if order is None:
        return phase, None
    if owner >= 0:
        place = 2 * order[owner]
    else:
        place = -1 if last < 0 else 2 * order[last] + 1
    return phase, max(-FAR, min(FAR, place - 2 * order[layer]))


def layers_alike(uniform: dict[Assignment, Trace], layers: tuple[str, ...], alignment: int = 512) -> bool:
    """Whether, in each uniform trace, every layer shows the same bytes in each relation (and in its own segments,
    apart from the other layers') as every other layer in the same context showing it."""
    for assignment, trace in uniform.items():
        everything_but, held = measure(trace, layers, alignment)
        orders, around = phase_orders(tuple(everything_but), len(layers)), contexts(assignment)
        seen: dict[tuple, Bytes] = {}
        for segment, value in everything_but.items():
            if (
                owner_of(segment) is not None
                and seen.setdefault((segment[0], around[owner_of(segment)]), value) != value
            ):
                return False
        for (j, segment), value in held.items():
            if j == PREFIX or owner_of(segment) == j:
                continue
            if seen.setdefault((relation(segment, j, orders), around[j]), value) != value:
                return False
    return True


def alike_terms(traces: dict[Assignment, Trace], layers: tuple[str, ...], alignment: int = 512) -> MemoryTerms:
    """The model of terms.memory_terms for alike layers, from the uniform traces and walks_to_trace's: each layer's
    bytes by relation and context, measured at any layer, stand for every layer."""
    count = len(layers)
    own_by: dict[tuple[str, Mode], Bytes] = {}  # a layer's own segment in a phase, by its mode alone: the bytes
    #                                            besides the other layers' vary with the layer before too
    held_by: dict[tuple[Relation, Context], Bytes] = {}  # a layer's bytes in a relation, by its context
    outside: dict[tuple[Segment, None], Bytes] = {}  # a segment no layer owns: all but the layers' bytes
    spans: dict[Assignment, Spans] = {}  # the PREFIX's buffers in each trace
    segments: tuple[Segment, ...] = ()
    # 1. Every trace's bytes, by relation and context.
    for assignment, trace, everything_but, held in measure_all(traces, layers, alignment):
        if not segments:  # every trace has the first's (measure_all checks)
            segments = tuple(everything_but)
            orders = phase_orders(segments, count)
        around = contexts(assignment)
        spans[assignment] = prefix_spans(trace, layers, alignment)
        for segment, value in everything_but.items():
            owner = owner_of(segment)
            table, key = (outside, (segment, None)) if owner is None else (own_by, (segment[0], around[owner][0]))
            table[key] = max(table.get(key, 0), value)
        for (j, segment), value in held.items():
            if owner_of(segment) != j and j != PREFIX:
                key = (relation(segment, j, orders), around[j])
                held_by[key] = max(held_by.get(key, 0), value)
    # 2. Every layer's terms in every context, from the relation's (or, not shown, the mode's most).
    modes = tuple(dict.fromkeys(m for assignment in traces for m in assignment))

    def shown(where: Relation, context: Context) -> Bytes:
        if (where, context) in held_by:
            return held_by[where, context]
        alike = [v for (w, (m, n)), v in held_by.items() if w == where and m == context[0] and n is not None]
        if not alike:
            raise TermsError(f"no trace shows a layer in mode {context[0]} at {where}: no per-layer model")
        return max(alike)

    own: dict[tuple[Segment, Context | None], Bytes] = dict(outside)
    held_terms = prefix_terms(spans, segments, modes)
    for j in range(count):
        nexts = (None,) if j + 1 == count else modes
        for context in [(m, n) for m in modes for n in nexts]:
            for segment in segments:
                if owner_of(segment) == j:
                    own[segment, context] = own_by[segment[0], context[0]]
                else:
                    held_terms[j, segment, context] = shown(relation(segment, j, orders), context)
    return MemoryTerms(tuple(layers), modes, segments, own, held_terms)


def prefix_spans(trace: Trace, layers: tuple[str, ...], alignment: int) -> Spans:
    """The PREFIX's buffers of a trace (those made before the first layer, outside any layer), each with the
    segments it lives in."""
    segment_at = segment_of_times(trace, layers)
    owner, size = owners(trace, layers, segment_at), align_up(trace.size.astype(np.int64), alignment)
    times = np.array(sorted(segment_at))
    spans = {}
    for order, i in enumerate(np.flatnonzero(owner == PREFIX).tolist()):
        alive = times[(times >= trace.alloc[i]) & (times < trace.free[i])]
        spans[order] = (int(size[i]), {segment_at[t] for t in alive.tolist()})
    return spans


def prefix_terms(
    spans: dict[Assignment, Spans], segments: tuple[Segment, ...], modes: tuple[Mode, ...]
) -> dict[tuple[int, Segment, Context], Bytes]:
    """The PREFIX's term per segment, whatever the first layer's mode, buffer by buffer: a buffer counts in a
    segment when any trace shows it anywhere in the segment's stretch (the segments of a phase's layers, or the
    segment itself). How long a PREFIX buffer lives is the first layer's doing and any later layer's (each keeps a
    position table to its own backward), and walks show few later layers after each first mode: so any layer is
    taken to keep it as long as any trace shows (at most one embedding output more than the pairs' model)."""

    def stretch(segment: Segment):
        return segment[0] if owner_of(segment) is not None else segment

    size: dict[int, Bytes] = {}
    anywhere: dict[int, set] = {}  # by buffer: the stretches any trace shows it in
    for buffers in spans.values():
        for order, (nbytes, alive) in buffers.items():
            size[order] = max(size.get(order, 0), nbytes)
            anywhere.setdefault(order, set()).update(stretch(segment) for segment in alive)
    held = {segment: sum(n for order, n in size.items() if stretch(segment) in anywhere[order]) for segment in segments}
    return {(PREFIX, segment, (None, first)): held[segment] for segment in segments for first in modes}
