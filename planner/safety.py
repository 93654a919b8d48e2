"""Reuse safety across streams: when the free of one buffer happens before the allocation of another.

Happens-before is per-stream program order plus the trace's syncs. A sync (t, A, B) orders every
event of stream A at time <= t before every event of stream B at time > t; syncs chain transitively
through later syncs (two syncs at the same time do not chain). The result is a release matrix R:
R[i, s] is the first time at which an event on stream s knows that buffer i was freed, so a buffer j
on stream s allocated at time >= R[i, s] may reuse i's bytes. On i's own stream R[i, s] is its free.
"""

from __future__ import annotations

import numpy as np


def release_matrix(
    alloc: np.ndarray,
    free: np.ndarray,
    stream: np.ndarray,
    nstreams: int,
    syncs: list[tuple[int, int, int]],
    never: int,
) -> np.ndarray:
    """R[i, s] (n x nstreams): earliest time on stream s ordered after buffer i's free; `never` if none.

    `stream` and the syncs use dense stream indices 0..nstreams-1.
    """
    n = len(alloc)
    release = np.full((n, nstreams), never, dtype=np.int64)
    release[np.arange(n), stream] = free
    if nstreams == 1:
        return release
    # clock[b, a]: the latest time on stream a whose events are ordered before stream b's current point.
    clock = np.full((nstreams, nstreams), -1, dtype=np.int64)
    history: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(nstreams)]
    by_time: dict[int, list[tuple[int, int]]] = {}
    for t, a, b in syncs:
        if a != b:
            by_time.setdefault(int(t), []).append((int(a), int(b)))
    for t in sorted(by_time):
        before = clock.copy()  # same-time syncs do not chain
        touched = set()
        for a, b in by_time[t]:
            sent = before[a].copy()
            sent[a] = t
            clock[b] = np.maximum(clock[b], sent)
            touched.add(b)
        for b in touched:
            history[b].append((t, clock[b].copy()))
    for b in range(nstreams):
        if not history[b]:
            continue
        times = np.array([t for t, _ in history[b]], dtype=np.int64)
        known = np.stack([c for _, c in history[b]])  # rows nondecreasing over time
        for a in range(nstreams):
            if a == b:
                continue
            mine = np.nonzero(stream == a)[0]
            k = np.searchsorted(known[:, a], free[mine], side="left")
            ok = k < len(times)
            release[mine[ok], b] = times[k[ok]] + 1
    return release


def conflicts_with(
    alloc: np.ndarray, stream: np.ndarray, release: np.ndarray, active: np.ndarray, i: int, others: np.ndarray
) -> np.ndarray:
    """Boolean mask over `others`: which of them may not share a byte with buffer i."""
    si = stream[i]
    mask = (alloc[others] < release[i, stream[others]]) & (alloc[i] < release[others, si])
    return mask & active[others] & bool(active[i])
