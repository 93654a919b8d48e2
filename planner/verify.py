"""The independent plan verifier: checks a placement against the problem without using any solver code.

It checks one offset per buffer (-1 exactly for the buffers outside a step plan's scope), alignment, the
arena and capacity, contiguous groups, fixed offsets, and that no two conflicting buffers share a byte;
a failure names the buffers involved. verify_figures then checks what a plan says about itself (its arena,
bound, status and gap) against the placement, so no view shows a figure the placement does not prove.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from memplan.errors import PlanError
from memplan.planner.problem import MAX_BYTES, OUTSIDE, Problem


def _name(p: Problem, i: int) -> str:
    return f"buffer {i}" if p.ids[i] == str(i) else f"buffer {i} (id {p.ids[i]})"


def verify_plan(problem: Problem, offsets, arena: int, capacity: int | None = None) -> None:
    """Raise PlanError naming the offending buffer(s) unless the placement is valid."""
    p = problem
    n = len(p)
    if len(offsets) != n:
        raise PlanError(f"plan has {len(offsets)} offsets but the problem has {n} buffers")
    try:
        off = np.asarray(offsets, dtype=np.int64).reshape(n)
    except OverflowError:
        raise PlanError("an offset does not fit in 64 bits") from None
    big = np.nonzero(off >= MAX_BYTES)[0]
    if len(big):  # sizes are below 2**62 too (planner.problem), so offset + size cannot overflow
        raise PlanError(f"{_name(p, int(big[0]))} has an offset {int(off[big[0]])} beyond 2**62")
    bad = np.nonzero(p.outside & (off != OUTSIDE))[0]
    if len(bad):
        raise PlanError(f"{_name(p, int(bad[0]))} is outside the plan's scope but has offset {int(off[bad[0]])}")
    off = np.where(p.outside, 0, off)  # size 0 in the problem: no byte, no alignment to check
    end = off + p.size
    bad = np.nonzero(off < 0)[0]
    if len(bad):
        raise PlanError(f"{_name(p, int(bad[0]))} has a negative offset {int(off[bad[0]])}")
    bad = np.nonzero(off % p.alignment)[0]
    if len(bad):
        raise PlanError(
            f"{_name(p, int(bad[0]))} offset {int(off[bad[0]])} is not a multiple of the alignment {p.alignment}"
        )
    bad = np.nonzero((end > arena) & (p.size > 0))[0]
    if len(bad):
        i = int(bad[0])
        raise PlanError(f"{_name(p, i)} ends at byte {int(end[i])}, beyond the arena of {arena} bytes")
    if not 0 <= arena < MAX_BYTES:
        raise PlanError(f"arena of {arena} bytes is outside [0, 2**62)")
    if capacity is not None and arena > capacity:
        raise PlanError(f"arena of {arena} bytes exceeds the capacity of {capacity} bytes")
    for i, want in p.fixed.items():
        if off[i] != want:
            raise PlanError(f"{_name(p, i)} is at offset {int(off[i])} but is fixed at {want}")
    for g, members in enumerate(p.groups):
        for a, b in zip(members, members[1:]):
            if off[b] != off[a] + p.size[a]:
                raise PlanError(f"contiguous group {g}: {_name(p, b)} does not start where {_name(p, a)} ends")
    pair = _sharing_pair(p, off, end)
    if pair is not None and p.nstreams > 1:  # maybe not a conflict: check every pair that shares bytes
        pair = _sharing_pair_streams(p, off, end)
    if pair is not None:
        i, j = sorted(pair, key=lambda k: (int(off[k]), k))
        lo, top = max(off[i], off[j]), min(end[i], end[j])
        raise PlanError(f"{_name(p, i)} and {_name(p, j)} may be live together but share bytes [{lo}, {top})")


def _sharing_pair(p: Problem, off: np.ndarray, end: np.ndarray) -> tuple[int, int] | None:
    """Two buffers that share bytes while each is allocated before the other's latest release (on any stream),
    or None. On one stream that is exactly a conflict (their lifetimes intersect); on several, every conflict is
    such a pair, but not every such pair a conflict. Sweeps the events in time order (frees before allocations
    at the same time), keeping the live buffers' byte ranges sorted and disjoint, and returns the first pair
    whose ranges meet (O(n log n), however much the plan reuses its bytes)."""
    idx = np.nonzero(p.active)[0]
    times = np.concatenate([p.release.max(axis=1)[idx], p.alloc[idx]])
    kinds = np.concatenate([np.zeros(len(idx), dtype=np.int64), np.ones(len(idx), dtype=np.int64)])
    order = np.lexsort((kinds, times))
    events = np.concatenate([idx, idx])[order].tolist()
    frees = (kinds[order] == 0).tolist()
    starts: list[int] = []  # the live buffers' first bytes, ascending (their ranges are disjoint)
    owners: list[int] = []
    offsets, ends = off.tolist(), end.tolist()
    left, right = bisect.bisect_left, bisect.bisect_right
    for i, is_free in zip(events, frees):
        first = offsets[i]
        if is_free:  # drop its range (it was inserted at its own start)
            at = left(starts, first)
            while owners[at] != i:
                at += 1
            del starts[at], owners[at]
            continue
        at = right(starts, first)
        if at > 0 and ends[owners[at - 1]] > first:
            return owners[at - 1], i
        if at < len(starts) and starts[at] < ends[i]:
            return owners[at], i
        starts.insert(at, first)
        owners.insert(at, i)
    return None


def _sharing_pair_streams(p: Problem, off: np.ndarray, end: np.ndarray) -> tuple[int, int] | None:
    """With several streams (conflicts follow happens-before, not lifetimes alone): sort by offset and test each
    buffer against those that start inside its bytes."""
    idx = np.nonzero(p.active)[0]
    order = idx[np.argsort(off[idx], kind="stable")]
    starts = off[order]
    ends_at = np.searchsorted(starts, end[order], side="left")
    for pos in range(len(order)):
        hi = int(ends_at[pos])
        if hi <= pos + 1:
            continue
        i = int(order[pos])
        others = order[pos + 1 : hi]
        hit = np.nonzero(p.conflicts_with(i, others))[0]
        if len(hit):
            return i, int(others[hit[0]])
    return None


def placement_top(problem: Problem, offsets) -> int:
    """Where the highest placed buffer ends: the least arena that holds the placement (0 when nothing is placed)."""
    off = np.where(problem.outside, 0, np.asarray(offsets, dtype=np.int64).reshape(len(problem)))
    return int((off + problem.size)[problem.size > 0].max(initial=0))


def verify_figures(
    problem: Problem, offsets, *, arena: int, bound: int, status: str, gap: float, bound_source: str = ""
) -> None:
    """PlanError unless a verified placement's figures are the ones it proves: the arena is where its highest buffer
    ends, the bound lies between 0 and the arena (and is the problem's max-live when it says it is), the status is
    "optimal" exactly when arena = bound, and the gap is arena / bound - 1 (0 with no bound)."""
    top = placement_top(problem, offsets)
    if arena != top:
        raise PlanError(f"the arena says {arena} bytes but the placement's highest buffer ends at byte {top}")
    if not 0 <= bound <= arena:
        raise PlanError(f"lower bound of {bound} bytes is not between 0 and the arena of {arena} bytes")
    if bound_source == "max-live" and bound != problem.max_live():
        raise PlanError(f"the bound says max-live, {bound} bytes, but the trace's max-live is {problem.max_live()}")
    want = "optimal" if arena == bound else "feasible"
    if status != want:
        raise PlanError(f"status {status!r} with arena {arena} and bound {bound} bytes: it is {want}")
    expected = arena / bound - 1.0 if bound else 0.0
    if not (math.isfinite(gap) and abs(gap - expected) <= 1e-9 * max(1.0, expected)):
        raise PlanError(f"gap {gap} is not arena / bound - 1 = {expected:.6g}")
