"""Greedy placement: several item orders (pressure over the lifetime, size, area, lifetime, allocation time)
with best fit and first fit, run side by side in the native kernel; the smallest arena wins (SOMAS-style).
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

import numpy as np

from memplan.planner.problem import Problem
from memplan.solvers.items import Items, make_items
from memplan.solvers.native import (
    BufferIndex,
    Bytes,
    GreedyProblem,
    ItemIndex,
    MemberIndex,
    StreamId,
    Time,
    Work,
    as_pointer,
    library,
)
from memplan.solvers.ranges import range_max
from memplan.traces.format import live_bytes


def pressure(p: Problem, items: Items) -> np.ndarray:
    """For each item, the most bytes held at any time of its span (max-live restricted to its span)."""
    act = p.active
    until = p.release.max(axis=1)[act]  # with several streams a buffer blocks others until its release
    times = np.unique(np.concatenate([p.alloc[act], until, items.alloc, items.free]))
    if len(times) == 0:
        return np.zeros(len(items), dtype=np.int64)
    live = live_bytes(p.size[act], np.searchsorted(times, p.alloc[act]), np.searchsorted(times, until), len(times))
    return range_max(live, np.searchsorted(times, items.alloc), np.searchsorted(times, items.free))


def orders(p: Problem, items: Items) -> dict[str, np.ndarray]:
    """Named item orders to try, most often best first: by pressure (the most bytes live during the item's
    lifetime), then size, allocation or free time (ties in pressure are common: tie-breaks matter)."""
    size, length = items.size, items.free - items.alloc
    area, press = size.astype(np.float64) * length, pressure(p, items)  # an ordering key: float cannot overflow
    alloc, free = items.alloc, items.free
    return {
        "pressure-late": np.lexsort((-alloc, -size, -press)),
        "pressure-long": np.lexsort((-size, -free, -press)),
        "pressure": np.lexsort((alloc, -size, -press)),
        "pressure-early": np.lexsort((-size, alloc, -press)),
        "pressure-lifetime": np.lexsort((-size, -length, -press)),
        "pressure-area": np.lexsort((-area, -press)),
        "size": np.lexsort((-length, -size)),
        "area": np.lexsort((-size, -area)),
        "lifetime": np.lexsort((-size, -length)),
        "alloc": np.lexsort((-size, alloc)),
    }


def place(
    p: Problem, items: Items, preset: np.ndarray, order: np.ndarray, best_fit: bool
) -> tuple[np.ndarray, int, int]:
    """Place the items in `order` on top of the preset offsets; returns (offsets, arena, steps spent)."""
    release = np.ascontiguousarray(p.release)  # named, like every array below, so it outlives the call
    order = np.ascontiguousarray(order, dtype=np.int32)
    greedy_problem = GreedyProblem(
        buffers=len(p),
        streams=p.nstreams,
        alloc=as_pointer(p.alloc, Time),
        stream=as_pointer(p.stream, StreamId),
        release=as_pointer(release, Time),
        size=as_pointer(p.size, Bytes),
        items=len(items),
        item_start=as_pointer(items.start, MemberIndex),
        members=as_pointer(items.members, BufferIndex),
        member_offset=as_pointer(items.rel, Bytes),
        order=as_pointer(order, ItemIndex),
        best_fit=int(best_fit),
    )
    offsets = preset.copy()
    spent = Work(0)
    arena = library().mp_greedy(ctypes.byref(greedy_problem), offsets, ctypes.byref(spent))
    offsets[offsets < 0] = 0
    return offsets, int(arena), spent.value


@dataclass
class GreedyResult:
    """The best greedy placement and how it was made (the order can seed an improvement phase)."""

    offsets: np.ndarray
    arena: int
    name: str
    order: np.ndarray
    best_fit: bool
    work: int  # steps spent by every placement tried


@dataclass
class Improvement:
    """The best placement an improvement loop reached, and the steps it spent."""

    offsets: np.ndarray
    arena: int
    work: int


def greedy(p: Problem, stop_at: int | None = None, deadline: float | None = None) -> GreedyResult:
    """Best of every order x {best fit, first fit}; stops early once the arena reaches `stop_at`, or when
    time.monotonic() passes `deadline` (a wall-clock ceiling, checked after at least one placement)."""
    items, preset = make_items(p)
    best, spent = None, 0
    for name, order in orders(p, items).items():
        for best_fit in (True, False):
            offsets, arena, work = place(p, items, preset, order, best_fit)
            spent += work
            if best is None or arena < best.arena:
                name_of_fit = f"greedy-{name}-{'best' if best_fit else 'first'}-fit"
                best = GreedyResult(offsets, arena, name_of_fit, order, best_fit, 0)
            best.work = spent
            if (stop_at is not None and best.arena <= stop_at) or (
                deadline is not None and time.monotonic() > deadline
            ):
                return best
    return best


def squeaky_wheel(
    p: Problem,
    start: GreedyResult,
    bound: int,
    work: int,
    deadline: float,
    boost: float = 0.01,
    patience: int = 100,
) -> Improvement:
    """Improve a greedy placement by moving the items that end above the bound earlier, round after round;
    stops at the bound, after `work` steps, at a fixed point, after `patience` rounds without gain, or at
    the wall-clock ceiling `deadline`."""
    items, preset = make_items(p)
    m = len(items)
    rank = np.empty(m, dtype=np.float64)
    rank[start.order] = np.arange(m)
    blame = np.zeros(m)
    first = items.start[:-1]
    best_offsets, best_arena = start.offsets, start.arena
    offsets, arena, order, stale, spent = start.offsets, start.arena, start.order, 0, 0
    while arena > bound and stale < patience and spent < work and time.monotonic() < deadline:
        # An item's place in the order drops by boost x items x its blame: how far above the bound it
        # ended, relative to the excess, summed over the rounds.
        top = offsets[items.members[first]] - items.rel[first] + items.size
        blame += np.maximum(top - bound, 0) / (arena - bound)
        previous, order = order, np.argsort(rank - boost * m * blame, kind="stable")
        if np.array_equal(order, previous):
            break
        offsets, arena, steps = place(p, items, preset, order, start.best_fit)
        spent += steps
        stale += 1
        if arena < best_arena:
            best_offsets, best_arena, stale = offsets, arena, 0
    return Improvement(best_offsets, best_arena, spent)
