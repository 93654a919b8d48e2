"""The independent plan verifier: checks a placement against the problem without using any solver code.

It checks one offset per buffer (-1 exactly for the buffers outside a step plan's scope), alignment, the
arena and capacity, contiguous groups, fixed offsets, and that no two conflicting buffers share a byte;
a failure names the buffers involved.
"""

from __future__ import annotations

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
    act = p.active
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
    if capacity is not None and arena > capacity:
        raise PlanError(f"arena of {arena} bytes exceeds the capacity of {capacity} bytes")
    for i, want in p.fixed.items():
        if off[i] != want:
            raise PlanError(f"{_name(p, i)} is at offset {int(off[i])} but is fixed at {want}")
    for g, members in enumerate(p.groups):
        for a, b in zip(members, members[1:]):
            if off[b] != off[a] + p.size[a]:
                raise PlanError(f"contiguous group {g}: {_name(p, b)} does not start where {_name(p, a)} ends")
    # Overlap check: sort by offset; any byte-overlapping pair shows up within each buffer's window.
    idx = np.nonzero(act)[0]
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
            j = int(others[hit[0]])
            lo, top = max(off[i], off[j]), min(end[i], end[j])
            raise PlanError(f"{_name(p, i)} and {_name(p, j)} may be live together but share bytes [{lo}, {top})")
