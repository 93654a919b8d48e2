"""Greedy placement: several item orders (pressure over the lifetime, size, area, lifetime, allocation time)
with best fit and first fit, run side by side in the native kernel; the smallest arena wins (SOMAS-style).

A placement stops once it has spent its steps or passed a wall-clock ceiling. One cut short is dropped,
unless no placement has finished yet: then the sweep (an allocator's rule, O(n log n) however the buffers
overlap) places the items it had not reached above those it had, or every item, whichever is smaller, so a
plan always comes back in time. When even the fewest steps a placement can take exceed the work, the sweep
places every item without a greedy placement being tried.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from memplan.planner.problem import Problem
from memplan.solvers.items import Items, make_items
from memplan.solvers.native import (
    GREEDY_INTERRUPTED,
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

UNLIMITED = 2**62  # a work limit that never strikes
NO_CEILING = 1e9  # seconds: the kernels' "no wall-clock ceiling"


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """np.unique by sorting: on millions of times it is several times faster than numpy's hash-based unique."""
    values = np.sort(values)
    return values[np.concatenate(([True], values[1:] != values[:-1]))] if len(values) else values


def pressure(p: Problem, items: Items) -> np.ndarray:
    """For each item, the most bytes held at any time of its span (max-live restricted to its span)."""
    act = p.active
    until = p.release.max(axis=1)[act]  # with several streams a buffer blocks others until its release
    times = sorted_unique(np.concatenate([p.alloc[act], until, items.alloc, items.free]))
    if len(times) == 0:
        return np.zeros(len(items), dtype=np.int64)
    live = live_bytes(p.size[act], np.searchsorted(times, p.alloc[act]), np.searchsorted(times, until), len(times))
    return range_max(live, np.searchsorted(times, items.alloc), np.searchsorted(times, items.free))


def orders(p: Problem, items: Items) -> Iterator[tuple[str, np.ndarray]]:
    """Named item orders to try, most often best first: by pressure (the most bytes live during the item's
    lifetime), then size, allocation or free time (ties in pressure are common: tie-breaks matter). Each is
    sorted when it is reached: on a large problem the work runs out after the first few."""
    size, length, alloc, free = items.size, items.free - items.alloc, items.alloc, items.free
    press = pressure(p, items)
    yield "pressure-late", np.lexsort((-alloc, -size, -press))
    yield "pressure-long", np.lexsort((-size, -free, -press))
    yield "pressure", np.lexsort((alloc, -size, -press))
    yield "pressure-early", np.lexsort((-size, alloc, -press))
    yield "pressure-lifetime", np.lexsort((-size, -length, -press))
    area = size.astype(np.float64) * length  # an ordering key: float cannot overflow
    yield "pressure-area", np.lexsort((-area, -press))
    yield "size", np.lexsort((-length, -size))
    yield "area", np.lexsort((-size, -area))
    yield "lifetime", np.lexsort((-size, -length))
    yield "alloc", np.lexsort((-size, alloc))


def _kernel_call(
    kernel, p: Problem, items: Items, offsets: np.ndarray, order: np.ndarray, best_fit: bool, work: int, seconds: float
) -> tuple[int, int]:
    """Run mp_greedy or mp_sweep on `offsets` in place; returns (its answer, steps spent)."""
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
        work_limit=int(min(max(work, 0), UNLIMITED)),
        seconds=min(max(float(seconds), 0.0), NO_CEILING),
    )
    spent = Work(0)
    answer = kernel(ctypes.byref(greedy_problem), offsets, ctypes.byref(spent))
    return int(answer), spent.value


def place(
    p: Problem,
    items: Items,
    preset: np.ndarray,
    order: np.ndarray,
    best_fit: bool,
    work: int = UNLIMITED,
    deadline: float | None = None,
) -> tuple[np.ndarray, int | None, int]:
    """Place the items in `order` on top of the preset offsets; returns (offsets, arena, steps spent). Past
    `work` steps or time.monotonic() = `deadline` it stops: the arena is None, the items not reached at -1."""
    seconds = NO_CEILING if deadline is None else deadline - time.monotonic()
    offsets = preset.copy()
    arena, spent = _kernel_call(library().mp_greedy, p, items, offsets, order, best_fit, work, seconds)
    if arena == GREEDY_INTERRUPTED:
        return offsets, None, spent
    offsets[offsets < 0] = 0
    return offsets, arena, spent


def least_work(p: Problem, items: Items) -> int:
    """A lower bound on the steps of any one greedy placement: for each active member, mp_greedy visits every
    time rank strictly inside its span (times compressed as the kernel compresses them)."""
    until = p.release.max(axis=1)
    times = sorted_unique(np.concatenate([p.alloc, until]))
    members = items.members[p.active[items.members]]
    span = np.searchsorted(times, until[members]) - np.searchsorted(times, p.alloc[members]) - 1
    return int(np.maximum(span, 0).sum())


def sweep(p: Problem, items: Items, offsets: np.ndarray) -> tuple[np.ndarray, int, int]:
    """Place the items still at -1 above every placed buffer, in time order, each in the smallest free block
    that holds it (mp_sweep); returns (offsets, arena, steps spent). Never stops short."""
    offsets = offsets.copy()
    arena, spent = _kernel_call(library().mp_sweep, p, items, offsets, np.arange(len(items)), True, 0, 0.0)
    return offsets, arena, spent


@dataclass
class GreedyResult:
    """The best greedy placement and how it was made (the order can seed an improvement phase)."""

    offsets: np.ndarray
    arena: int
    name: str
    order: np.ndarray
    best_fit: bool
    work: int  # steps spent by every placement tried
    least_work: int  # the fewest steps any one placement of this problem can take (least_work)


@dataclass
class Improvement:
    """The best placement an improvement loop reached, and the steps it spent."""

    offsets: np.ndarray
    arena: int
    work: int


def greedy(
    p: Problem,
    stop_at: int | None = None,
    deadline: float | None = None,
    work: int | None = None,
    first_deadline: float | None = None,
) -> GreedyResult:
    """Best of every order x {best fit, first fit}; stops early once the arena reaches `stop_at`, once the
    placements have spent `work` steps (the deterministic budget), or when time.monotonic() passes `deadline`
    (a wall-clock ceiling; `first_deadline` for the first placement, if later). Both stop a placement midway:
    it is dropped, or, when it is the first, the sweep places the items it had not reached ("...+sweep") or
    every item ("sweep"), whichever gives the smaller arena, so there is always a plan. When no placement can
    finish within `work` (least_work), the sweep places every item."""
    items, preset = make_items(p)
    limit = UNLIMITED if work is None else work
    least = least_work(p, items)
    if least > limit:  # no placement can finish: the sweep places every item
        offsets, arena, steps = sweep(p, items, preset)
        return GreedyResult(offsets, arena, "sweep", np.arange(len(items)), True, steps, least)
    best, spent = None, 0
    for name, order in orders(p, items):
        for best_fit in (True, False):
            ceiling = deadline
            if best is None and deadline is not None and first_deadline is not None:
                ceiling = max(deadline, first_deadline)
            offsets, arena, steps = place(p, items, preset, order, best_fit, limit - spent, ceiling)
            spent += steps
            name_of_fit = f"greedy-{name}-{'best' if best_fit else 'first'}-fit"
            stopped = arena is None
            if stopped and best is None:  # the sweep finishes it, or places every item if that is better
                offsets, arena, steps = sweep(p, items, offsets)
                fresh, fresh_arena, fresh_steps = sweep(p, items, preset)
                spent, name_of_fit = spent + steps + fresh_steps, f"{name_of_fit}+sweep"
                if fresh_arena < arena:
                    offsets, arena, name_of_fit = fresh, fresh_arena, "sweep"
            if arena is not None and (best is None or arena < best.arena):
                best = GreedyResult(offsets, arena, name_of_fit, order, best_fit, 0, least)
            best.work = spent
            if (
                stopped
                or spent >= limit
                or (stop_at is not None and best.arena <= stop_at)
                or (deadline is not None and time.monotonic() > deadline)
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
    the wall-clock ceiling `deadline`; a placement either of them stops midway is dropped."""
    if start.least_work > work:  # no placement can finish within the work
        return Improvement(start.offsets, start.arena, 0)
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
        offsets, arena, steps = place(p, items, preset, order, start.best_fit, work - spent, deadline)
        spent += steps
        if arena is None:  # cut short by the work or the ceiling: nothing to compare
            break
        stale += 1
        if arena < best_arena:
            best_offsets, best_arena, stale = offsets, arena, 0
    return Improvement(best_offsets, best_arena, spent)
