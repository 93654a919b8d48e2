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
from memplan.solvers.native import library

FITS, INFEASIBLE, TIMEOUT = "fits", "infeasible", "timeout"
# Static orders, most significant key first, all descending: W lifetime, A area, T section pressure, Z size.
HEURISTICS = ("TWA", "TAW", "WAT")


def applicable(p: Problem) -> bool:
    """The search handles one stream without contiguous groups or fixed offsets."""
    return p.nstreams == 1 and not p.groups and not p.fixed


def search_fit(p: Problem, capacity: int, seconds: float) -> tuple[str, np.ndarray | None, int]:
    """(FITS with offsets | INFEASIBLE | TIMEOUT, offsets or None, nodes searched).

    Buffers never live sit at offset 0; they still count in the arena, so one larger than `capacity`
    makes it infeasible."""
    if int(p.size.max(initial=0)) > capacity:
        return INFEASIBLE, None, 0
    act = np.nonzero(p.active)[0]
    offsets = np.zeros(len(p), dtype=np.int64)
    if len(act) == 0:
        return FITS, offsets, 0
    alloc, free, size = p.alloc[act], p.free[act], np.ascontiguousarray(p.size[act])
    times = np.unique(np.concatenate([alloc, free]))
    slo = np.searchsorted(times, alloc).astype(np.int32)
    shi = np.searchsorted(times, free).astype(np.int32)
    nsec = len(times) - 1
    out = np.zeros(len(act), dtype=np.int64)
    nodes = ctypes.c_longlong(0)
    heuristics = (ctypes.c_char_p * len(HEURISTICS))(*[h.encode() for h in HEURISTICS])
    res = library().mp_search(
        len(act),
        nsec,
        size,
        np.ascontiguousarray(alloc),
        np.ascontiguousarray(free),
        slo,
        shi,
        int(capacity),
        len(HEURISTICS),
        heuristics,
        float(seconds),
        out,
        ctypes.byref(nodes),
    )
    if res == 1:
        offsets[act] = out
        return FITS, offsets, nodes.value
    return (INFEASIBLE if res == 0 else TIMEOUT), None, nodes.value
