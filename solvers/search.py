"""Exact "fits in capacity C?" search for one-stream problems (the MiniMalloc approach).

Depth-first over canonical placements: every buffer sits at 0 or on top of a conflicting one, buffers are
placed in nondecreasing offset order; time is cut into sections, a section whose floor plus its unplaced
bytes exceeds C prunes the node, a buffer whose offset would leave room below for an entire other buffer
is skipped, and the problem splits into independent parts whenever no unplaced buffer crosses a section
boundary. Three static orders (re-ranked in every independent part) search in parallel threads; the one
that finds a placement or proves that none exists in the fewest steps wins, so the answer depends on the
step budget, not on the machine's load (the wall-clock ceiling aside). A prefix restarts the search from
part of an earlier placement: its buffers go first, in its order, each as low as those placed before allow
(any canonical placement is rebuilt exactly by its own buffers in offset order), and the search completes
it; the portfolio's descent uses it to rebuild only the top of its best placement.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from memplan.planner.problem import Problem
from memplan.solvers.native import (
    SEARCH_FITS,
    SEARCH_INFEASIBLE,
    SEARCH_TIMEOUT,
    BufferIndex,
    Bytes,
    SearchProblem,
    SectionIndex,
    Time,
    Work,
    as_pointer,
    library,
)

FITS, INFEASIBLE, TIMEOUT = "fits", "infeasible", "timeout"
STATUS = {SEARCH_FITS: FITS, SEARCH_INFEASIBLE: INFEASIBLE, SEARCH_TIMEOUT: TIMEOUT}  # the kernel's outcomes
# Static orders, most significant key first, all descending: W lifetime, A area, T section total, Z size.
HEURISTICS = ("TWA", "TAW", "WAT")


def applicable(p: Problem) -> bool:
    """The search handles one stream without contiguous groups or fixed offsets."""
    return p.nstreams == 1 and not p.groups and not p.fixed


@dataclass
class SearchResult:
    """What one search decided: FITS (with offsets), INFEASIBLE (proven) or TIMEOUT, and the steps it spent."""

    status: str
    offsets: np.ndarray | None
    work: int  # steps, all threads together


def search_fit(p: Problem, capacity: int, work: int, seconds: float, prefix: np.ndarray | None = None) -> SearchResult:
    """Decide whether p fits in `capacity` bytes with at most `work` steps per thread and `seconds` of wall
    time. Buffers never live sit at offset 0 but still count in the arena, so one larger than `capacity`
    makes it infeasible. `prefix` (active buffers, in order) restarts the search from part of an earlier
    placement: they are placed first, each as low as the ones placed before it allow; INFEASIBLE then only
    says that nothing completes them."""
    if int(p.size.max(initial=0)) > capacity:
        return SearchResult(INFEASIBLE, None, 0)
    act = np.nonzero(p.active)[0]
    offsets = np.zeros(len(p), dtype=np.int64)
    if len(act) == 0:
        return SearchResult(FITS, offsets, 0)
    position = np.full(len(p), -1, dtype=np.int32)
    position[act] = np.arange(len(act), dtype=np.int32)
    placed_first = np.ascontiguousarray(position[np.asarray(prefix if prefix is not None else [], dtype=np.int64)])
    if (placed_first < 0).any() or len(np.unique(placed_first)) < len(placed_first):
        raise ValueError("a search prefix names a buffer that is not active, or one twice")
    size = np.ascontiguousarray(p.size[act])  # named, like every array below, so it outlives the call
    alloc, free = np.ascontiguousarray(p.alloc[act]), np.ascontiguousarray(p.free[act])
    times = np.unique(np.concatenate([alloc, free]))
    first_section = np.searchsorted(times, alloc).astype(np.int32)
    end_section = np.searchsorted(times, free).astype(np.int32)
    heuristics = (ctypes.c_char_p * len(HEURISTICS))(*[h.encode() for h in HEURISTICS])
    search_problem = SearchProblem(
        buffers=len(act),
        sections=len(times) - 1,
        size=as_pointer(size, Bytes),
        lower=as_pointer(alloc, Time),
        upper=as_pointer(free, Time),
        first_section=as_pointer(first_section, SectionIndex),
        end_section=as_pointer(end_section, SectionIndex),
        capacity=int(capacity),
        prefix_length=len(placed_first),
        prefix=as_pointer(placed_first, BufferIndex),
        heuristics=len(HEURISTICS),
        heuristic=heuristics,
        work_limit=int(work),
        seconds=max(float(seconds), 0.0),
    )
    placed = np.zeros(len(act), dtype=np.int64)
    spent = Work(0)
    status = STATUS[library().mp_search(ctypes.byref(search_problem), placed, ctypes.byref(spent))]
    if status == FITS:
        offsets[act] = placed
        return SearchResult(FITS, offsets, spent.value)
    return SearchResult(status, None, spent.value)
