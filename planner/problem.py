"""The allocation problem: aligned sizes, lifetimes, the conflict relation, contiguous groups, fixed offsets.

Buffer i is live on [alloc_i, free_i) on its stream. Two buffers conflict (may not share a byte) unless
the free of one happens before the allocation of the other (planner.safety). Buffers of size 0 or with
an empty lifetime conflict with nothing. Indices are the trace's buffer indices.

A plan's scope says which buffers it places: `all` of them, or only the `step`'s own, leaving out the
buffers that exist for the whole window (parameters, optimizer state, inputs: allocated once, outside
the step, by whatever allocator made them). Buffers outside the plan are in the problem with size 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from memplan.errors import MemplanError
from memplan.limits import MAX_STREAMS
from memplan.planner.safety import conflicts_with, release_matrix
from memplan.traces.format import Trace, trace_digest

MAX_BYTES = 2**62  # sizes, offsets and times stay below this, so their sums never overflow int64
SCOPES = ("all", "step")
OUTSIDE = -1  # the offset a plan gives a buffer outside its scope
DEFAULT_ALIGNMENT = 512  # a trace's sizes and offsets are rounded to this unless a plan says otherwise


class ProblemError(MemplanError):
    """An allocation problem cannot be built: bad alignment, groups or fixed offsets."""


@dataclass
class Problem:
    """Everything a solver needs; `release` (n x streams) encodes the conflict relation."""

    size: np.ndarray  # bytes, rounded up to the alignment
    requested: np.ndarray  # bytes as given
    alloc: np.ndarray
    free: np.ndarray
    stream: np.ndarray  # dense stream index 0..nstreams-1
    release: np.ndarray  # release[i, s]: first time on stream s ordered after i's free
    alignment: int
    digest: str  # digest of the source (trace or CSV) the problem was built from
    ids: list[str]  # buffer names (CSV ids, or the trace index)
    syncs: list[tuple[int, int, int]] = field(default_factory=list)  # (time, from, to), dense stream ids
    groups: list[list[int]] = field(default_factory=list)  # back to back, in the given order
    fixed: dict[int, int] = field(default_factory=dict)  # buffer index -> required offset
    outside: np.ndarray = None  # bool mask of buffers left out of the plan (all False for scope "all")
    scope: str = "all"

    def __len__(self) -> int:
        return int(self.size.shape[0])

    @property
    def nstreams(self) -> int:
        return int(self.release.shape[1])

    @property
    def active(self) -> np.ndarray:
        """Buffers that occupy bytes at some time: positive size and a non-empty lifetime."""
        return (self.size > 0) & (self.alloc < self.free)

    def conflicts_with(self, i: int, others: np.ndarray) -> np.ndarray:
        """Boolean mask over `others`: which of them may not share a byte with buffer i."""
        return conflicts_with(self.alloc, self.stream, self.release, self.active, i, np.asarray(others))

    def conflict(self, i: int, j: int) -> bool:
        """True when buffers i and j (i != j) may not share a byte."""
        return i != j and bool(self.conflicts_with(i, np.array([j]))[0])

    def max_live(self, among: np.ndarray | None = None) -> int:
        """The most aligned bytes live at one time (counting only active buffers, and only those `among` a mask)."""
        act = self.active if among is None else self.active & among
        if not act.any():
            return 0
        times = np.concatenate([self.free[act], self.alloc[act]])
        deltas = np.concatenate([-self.size[act], self.size[act]])
        order = np.argsort(times, kind="stable")  # at equal times frees (listed first) come first
        return int(max(0, np.cumsum(deltas[order]).max()))


def align_up(size: np.ndarray, alignment: int) -> np.ndarray:
    """Round every size up to a multiple of the alignment (0 stays 0)."""
    return (size + alignment - 1) // alignment * alignment


def build_problem(
    size, alloc, free, *, stream=None, syncs=(), alignment: int = 512, digest: str = "", ids=None, groups=(), fixed=None
) -> Problem:
    """Validate and assemble a Problem from columns; `stream`/`syncs` use the caller's stream ids."""
    if not isinstance(alignment, (int, np.integer)) or alignment < 1:
        raise ProblemError(f"alignment must be a positive integer, got {alignment!r}")
    alignment = int(alignment)
    requested = np.asarray(size, dtype=np.int64)
    alloc = np.asarray(alloc, dtype=np.int64)
    free = np.asarray(free, dtype=np.int64)
    n = len(requested)
    _check_ranges(requested, alloc, free, alignment)
    raw_stream = np.zeros(n, dtype=np.int64) if stream is None else np.asarray(stream, dtype=np.int64)
    used = np.unique(raw_stream)
    names = sorted(set(used.tolist()) | {int(s[k]) for s in syncs for k in (1, 2)}) or [0]
    if len(names) > MAX_STREAMS:  # reuse safety keeps buffers x streams and streams x streams matrices
        raise ProblemError(f"{len(names):,} distinct streams; memplan handles at most {MAX_STREAMS} (limits.py)")
    dense = {s: k for k, s in enumerate(names)}
    dstream = np.array([dense[s] for s in used.tolist()], dtype=np.int64)[np.searchsorted(used, raw_stream)]
    dsyncs = [(int(t), dense[int(a)], dense[int(b)]) for t, a, b in syncs]
    never = int(max(free.max(initial=0), alloc.max(initial=0)) + 1)
    release = release_matrix(alloc, free, dstream, len(names), dsyncs, never)
    ids = list(map(str, range(n))) if ids is None else [str(x) for x in ids]
    problem = Problem(
        size=align_up(requested, alignment),
        requested=requested,
        alloc=alloc,
        free=free,
        stream=dstream,
        release=release,
        alignment=alignment,
        digest=digest,
        ids=ids,
        syncs=dsyncs,
        groups=[[int(i) for i in g] for g in groups],
        fixed={int(k): int(v) for k, v in (fixed or {}).items()},
        outside=np.zeros(n, dtype=bool),
    )
    _check_groups_and_fixed(problem)
    return problem


def _check_ranges(size: np.ndarray, alloc: np.ndarray, free: np.ndarray, alignment: int) -> None:
    """Sizes and times that 64-bit offset arithmetic can carry: no sum of sizes may reach 2**62."""
    if (size < 0).any():
        i = int(np.argmax(size < 0))
        raise ProblemError(f"buffer {i} has a negative size {int(size[i])}")
    if (alloc < 0).any() or (free < alloc).any():
        i = int(np.argmax((alloc < 0) | (free < alloc)))
        raise ProblemError(f"buffer {i} has a bad lifetime [{int(alloc[i])}, {int(free[i])})")
    total = float(size.astype(np.float64).sum()) + float(alignment) * len(size)  # float: the check cannot overflow
    if total >= MAX_BYTES or alignment >= MAX_BYTES:
        raise ProblemError(f"the buffers add up to about {total:.3g} bytes; memplan handles at most 2**62")
    if len(free) and int(free.max()) >= MAX_BYTES:
        raise ProblemError(f"a free time of {int(free.max())} is beyond 2**62")


def _check_groups_and_fixed(p: Problem) -> None:
    n = len(p)
    seen: set[int] = set()
    for g, members in enumerate(p.groups):
        if not members:
            raise ProblemError(f"contiguous group {g} is empty")
        for i in members:
            if not 0 <= i < n:
                raise ProblemError(f"contiguous group {g}: buffer {i} does not exist ({n} buffers)")
            if i in seen:
                raise ProblemError(f"contiguous group {g}: buffer {i} is in more than one group")
            seen.add(i)
    for i, off in p.fixed.items():
        if not 0 <= i < n:
            raise ProblemError(f"fixed offset for buffer {i}: no such buffer ({n} buffers)")
        if off < 0 or off % p.alignment or off >= MAX_BYTES:
            raise ProblemError(
                f"fixed offset {off} of buffer {i} is negative or not a multiple of the alignment {p.alignment}"
            )
    pinned = np.array(sorted(p.fixed), dtype=np.int64)
    for k, i in enumerate(pinned[:-1]):
        others = pinned[k + 1 :]
        off = np.array([p.fixed[int(j)] for j in others], dtype=np.int64)
        clash = (
            p.conflicts_with(int(i), others)
            & (off < p.fixed[int(i)] + p.size[i])
            & (p.fixed[int(i)] < off + p.size[others])
        )
        if clash.any():
            raise ProblemError(
                f"fixed offsets of buffers {int(i)} and {int(others[clash][0])} overlap while both may be live"
            )
    for g, members in enumerate(p.groups):
        bases = {p.fixed[i] - int(p.size[members[:k]].sum()) for k, i in enumerate(members) if i in p.fixed}
        if len(bases) > 1 or min(bases, default=0) < 0:
            raise ProblemError(f"contiguous group {g}: its fixed offsets do not put its buffers back to back")


def outside_of_scope(trace: Trace, scope: str) -> np.ndarray:
    """Mask of the trace's buffers a plan of `scope` leaves out: none for `all`; for `step`, the buffers
    that exist for the whole window (alloc 0, never freed before the end)."""
    if scope not in SCOPES:
        raise ProblemError(f"unknown plan scope {scope!r} (expected one of {', '.join(SCOPES)})")
    if scope == "all":
        return np.zeros(len(trace), dtype=bool)
    return (trace.alloc == 0) & (trace.free == trace.end) & (trace.size > 0)


def problem_from_trace(
    trace: Trace, alignment: int = DEFAULT_ALIGNMENT, groups=(), fixed=None, scope: str = "all"
) -> Problem:
    """The allocation problem of a trace: sizes rounded up to `alignment`, streams and syncs kept; with
    scope `step` the whole-window buffers are outside the plan (size 0 here)."""
    outside = outside_of_scope(trace, scope)
    held = sorted({int(i) for g in groups for i in g} | set(fixed or {}))
    if any(outside[i] for i in held if 0 <= i < len(trace)):
        raise ProblemError("a contiguous group or fixed offset names a buffer outside the plan's scope")
    problem = build_problem(
        np.where(outside, 0, trace.size),
        trace.alloc,
        trace.free,
        stream=trace.stream,
        syncs=trace.syncs,
        alignment=alignment,
        digest=trace_digest(trace),
        groups=groups,
        fixed=fixed,
    )
    problem.outside, problem.scope = outside, scope
    return problem
