"""Exact "fits in capacity C?" search for one-stream problems (the MiniMalloc approach).

Depth-first over canonical placements: every buffer sits at 0 or on top of a conflicting one, buffers are
placed in nondecreasing offset order; time is cut into sections, a section whose floor plus its unplaced
bytes exceeds C prunes the node, a buffer whose offset would leave room below for an entire other buffer
is skipped, and the problem splits into independent parts whenever no unplaced buffer crosses a section
boundary. Three static orders (re-ranked in every independent part) search in parallel threads; the first
to find a placement or prove that none exists wins.
"""

from __future__ import annotations

import ctypes

import numpy as np

from memplan.planner.problem import Problem
from memplan.solvers.native import (
    SEARCH_FITS,
    SEARCH_INFEASIBLE,
    SEARCH_TIMEOUT,
    Bytes,
    Nodes,
    SearchProblem,
    SectionIndex,
    Time,
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


def search_fit(p: Problem, capacity: int, seconds: float) -> tuple[str, np.ndarray | None, int]:
    """(FITS | INFEASIBLE | TIMEOUT, offsets or None, nodes searched). Buffers never live sit at offset 0
    but still count in the arena, so one larger than `capacity` makes it infeasible."""
    if int(p.size.max(initial=0)) > capacity:
        return INFEASIBLE, None, 0
    act = np.nonzero(p.active)[0]
    offsets = np.zeros(len(p), dtype=np.int64)
    if len(act) == 0:
        return FITS, offsets, 0
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
        heuristics=len(HEURISTICS),
        heuristic=heuristics,
        seconds=float(seconds),
    )
    placed = np.zeros(len(act), dtype=np.int64)
    nodes = Nodes(0)
    status = STATUS[library().mp_search(ctypes.byref(search_problem), placed, ctypes.byref(nodes))]
    if status == FITS:
        offsets[act] = placed
        return FITS, offsets, nodes.value
    return status, None, nodes.value
