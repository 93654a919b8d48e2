"""Lower bounds on the arena.

One stream: max-live, the most bytes live at one time. Several streams: conflicting buffers are exactly
the pairs not ordered by happens-before, so the bound is the heaviest set of mutually unordered buffers.
Such a set is exactly the set of buffers allocated but not yet freed at some consistent cut of the event
graph (per-stream program order plus sync edges), so the bound is a maximum-weight closure: +size on each
allocation event, -size on each free event, solved as a minimum cut with OR-Tools' max flow.
The max flow takes seconds past MAX_FLOW_BUFFERS active buffers (2.7 s at 100,000, 76 s at a million, on
this machine); above it the bound is the busiest stream's max-live instead (buffers of one stream that are
live together always conflict). Fixed offsets, the largest buffer and the largest contiguous group bound the
arena too. Each bound says where it came from; the portfolio raises it further with proofs (portfolio.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memplan.planner.problem import Problem

MAX_FLOW_BUFFERS = 50_000  # active buffers on several streams beyond which the max flow is not tried
# Ranks of same-time events on one stream: frees, then allocations, then sync sends, then sync receives.
FREE, ALLOC, SEND, RECV = 0, 1, 2, 3


def heaviest_unordered(p: Problem, syncs: list[tuple[int, int, int]]) -> int:
    """Max total size of mutually unordered active buffers (dense stream ids in `syncs`)."""
    from ortools.graph.python import max_flow

    act = np.nonzero(p.active)[0]
    # events: (stream, time, rank, weight, key)
    ev_stream = np.concatenate([p.stream[act], p.stream[act]])
    ev_time = np.concatenate([p.alloc[act], p.free[act]])
    ev_rank = np.concatenate([np.full(len(act), ALLOC), np.full(len(act), FREE)])
    ev_w = np.concatenate([p.size[act], -p.size[act]])
    sync_arr = np.asarray([s for s in syncs if s[1] != s[2]], dtype=np.int64).reshape(-1, 3)
    ns = len(sync_arr)
    ev_stream = np.concatenate([ev_stream, sync_arr[:, 1], sync_arr[:, 2]])
    ev_time = np.concatenate([ev_time, sync_arr[:, 0], sync_arr[:, 0]])
    ev_rank = np.concatenate([ev_rank, np.full(ns, SEND), np.full(ns, RECV)])
    ev_w = np.concatenate([ev_w, np.zeros(2 * ns, dtype=np.int64)])
    m = len(ev_w)
    order = np.lexsort((ev_rank, ev_time, ev_stream))
    pos = np.empty(m, dtype=np.int64)
    pos[order] = np.arange(m)
    # Closure arcs (infinite capacity): a later event on a stream implies the earlier one; a receive
    # implies its send.
    same = ev_stream[order[1:]] == ev_stream[order[:-1]]
    tails = [order[1:][same]]
    heads = [order[:-1][same]]
    base = 2 * len(act)
    tails.append(base + ns + np.arange(ns))
    heads.append(base + np.arange(ns))
    source, sink = m, m + 1
    pos_w = np.nonzero(ev_w > 0)[0]
    neg_w = np.nonzero(ev_w < 0)[0]
    inf = int(ev_w[pos_w].sum()) + 1
    t = np.concatenate(tails + [np.full(len(pos_w), source), neg_w]).astype(np.int32)
    h = np.concatenate(heads + [pos_w, np.full(len(neg_w), sink)]).astype(np.int32)
    cap = np.concatenate([np.full(sum(len(x) for x in tails), inf), ev_w[pos_w], -ev_w[neg_w]]).astype(np.int64)
    flow = max_flow.SimpleMaxFlow()
    flow.add_arcs_with_capacity(t, h, cap)
    if flow.solve(source, sink) != flow.OPTIMAL:
        raise RuntimeError("max flow failed while bounding a multi-stream problem")
    return int(ev_w[pos_w].sum() - flow.optimal_flow())


@dataclass(frozen=True)
class Bound:
    """A proven lower bound on the arena of every valid placement, and how it was proven."""

    value: int  # bytes
    source: str  # in words, e.g. "max-live" or "search: no placement in 1,000,000 B"


def cheap_bound(p: Problem) -> Bound:
    """The best of the bounds that cost no search: most bytes live at once (or the heaviest set of mutually
    unordered buffers on several streams, or the busiest stream's max-live on many buffers), the top of a fixed
    offset, the largest buffer or group."""
    if p.nstreams == 1:
        live = Bound(p.max_live(), "max-live")
    elif int(p.active.sum()) <= MAX_FLOW_BUFFERS:
        live = Bound(heaviest_unordered(p, p.syncs), "max-live across streams (heaviest unordered set)")
    else:
        busiest = max(p.max_live(p.stream == s) for s in range(p.nstreams))
        live = Bound(busiest, "max-live of the busiest stream (too many buffers for the max flow)")
    fixed_top = max((off + int(p.size[i]) for i, off in p.fixed.items() if p.size[i] > 0), default=0)
    candidates = [
        live,
        Bound(fixed_top, "a fixed offset's top"),
        Bound(int(p.size.max(initial=0)), "the largest buffer"),
        Bound(max((int(p.size[g].sum()) for g in p.groups), default=0), "the largest contiguous group"),
    ]
    return max(candidates, key=lambda bound: bound.value)  # the first of equals: max-live when they tie


def lower_bound(p: Problem) -> int:
    """The best cheap lower bound on the arena of any valid placement of p, in bytes."""
    return cheap_bound(p).value
