"""A lower bound above max-live, proven by the exact search on the buffers of a time window.

Why it is valid. Take a window [t0, t1) of time, keep the buffers live somewhere in it and clip their
lifetimes to it. Two kept buffers conflict after clipping exactly when they conflicted before (two
lifetimes that both reach into the window and overlap, overlap inside it), so every valid placement of the
whole problem, restricted to the kept buffers, is a valid placement of the window's problem in the same
arena. The window's optimum is therefore at most the whole problem's, and a proof by `search_fit` that the
window's buffers do not fit in v - 1 bytes proves that every placement of the whole problem needs v bytes
or more. Dropping every buffer as low as it goes makes each offset a sum of sizes, so optimal arenas are
multiples of the sizes' GCD, and only such values are worth proving. For the same reason a window inside
another one whose buffers fit in some arena fits in it too, and need not be searched.

Which windows. Max-live looks at one time at a time; a window beats it only where buffers that start and
end inside it fragment the free space. Windows of 2, 4, 8, ... sections, up to the whole problem (where the
bound is the exact optimum), slide over the profile by half their width, narrowest first (they are the
cheapest to decide) and, within a width, heaviest first. A window that fits is done; one that proves a
value raises it as far as proofs come (galloping up, then bisecting below the arena of the first placement
found); one whose search times out, and every window around it, waits for the next round.

Deterministic. Every search is charged its whole step limit, whatever it used, so what is tried next
depends only on the `work` budget and on the searches' answers, which depend only on their step limits
(wall seconds are only a ceiling). Limits are counted in multiples of a search's steps when nothing makes
it backtrack (estimated from its buffers and their sections): each search starts at FIRST_LIMIT of them
and deepens (times DEEPENING) while it times out, up to the round's cap: FIRST_CAP in the first round,
ROUND_GROWTH times more in each round after. So a search that decides quickly costs little, and one hard
window cannot take the budget before every easier one has had its turn.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from memplan.planner.problem import Problem, build_problem
from memplan.solvers.bounds import Bound
from memplan.solvers.search import FITS, INFEASIBLE, TIMEOUT, applicable, search_fit
from memplan.traces.format import live_bytes

FIRST_LIMIT = 2  # a search's first step limit, in multiples of its steps without backtracking
DEEPENING = 4  # a search that times out runs again with this many times its limit, up to the round's cap
FIRST_CAP = 64  # the first round's cap on step limits, in multiples of the steps without backtracking
ROUND_GROWTH = 16  # each round multiplies the cap by this


@dataclass
class WindowBound:
    """The best bound proven above the floor (None if none was), and the steps charged for it: the sum of
    the searches' step limits, per thread as `search_fit` counts them (all threads together: times the
    number of heuristics), never more than the budget."""

    bound: Bound | None
    work: int


@dataclass(frozen=True)
class Window:
    """Sections first .. end - 1 of the profile (a section: between two consecutive distinct times)."""

    first: int
    end: int


def window_bound(p: Problem, floor: int, work: int, seconds: float) -> WindowBound:
    """A proven bound above `floor` from a time window's buffers (None if none was proven) within `work`
    search steps per thread and `seconds` of wall time; only on problems `search_fit` applies to."""
    if not applicable(p) or not p.active.any():
        return WindowBound(None, 0)
    deadline = time.monotonic() + seconds
    active = np.nonzero(p.active)[0]
    size, alloc, free = p.size[active], p.alloc[active], p.free[active]
    times = np.unique(np.concatenate([alloc, free]))
    first_section, end_section = np.searchsorted(times, alloc), np.searchsorted(times, free)
    live = live_bytes(size, first_section, end_section, len(times) - 1)
    grain = math.gcd(*(int(s) for s in p.size[p.size > 0]))
    spent, cap = 0, FIRST_CAP
    best: Bound | None = None
    placed: list[tuple[Window, int]] = []  # a window and an arena its buffers fit in

    def search(window: Window, capacity: int) -> tuple[str, int]:
        """Whether the window's buffers fit in `capacity`, and the arena of a placement if they do (else 0);
        TIMEOUT without searching once the budget or the time is spent."""
        nonlocal spent
        around = [arena for w, arena in placed if w.first <= window.first and window.end <= w.end]
        if any(arena <= capacity for arena in around):
            return FITS, min(around)  # a window around this one fits: so does this one
        kept = (alloc < times[window.end]) & (free > times[window.first])
        if int(size[kept].sum()) <= capacity:
            return FITS, int(size[kept].sum())  # stacked
        first = np.maximum(first_section[kept], window.first)
        end = np.minimum(end_section[kept], window.end)
        buffers, spans = int(kept.sum()), int((end - first).sum())
        easy = buffers * (512 + 4 * buffers + 2 * spans)  # about twice a search's steps without backtracking
        q = build_problem(size[kept], times[first], times[end], alignment=1)
        limit = FIRST_LIMIT * easy
        while True:  # deepen: a search that decides in few steps is charged few
            limit, left = min(limit, cap * easy, work - spent), deadline - time.monotonic()
            if limit <= 0 or left <= 0:
                return TIMEOUT, 0
            spent += limit
            result = search_fit(q, capacity, limit, left)
            if result.status != TIMEOUT or limit >= cap * easy:
                break
            limit *= DEEPENING
        if result.status != FITS:
            return result.status, 0
        arena = int((result.offsets + q.size).max())
        placed.append((window, arena))
        return FITS, arena

    def raise_bound(window: Window) -> bool:
        """Prove the window's highest value above the best bound so far: the value just above it first,
        then galloping up, then bisecting below a placement's arena. False if a search timed out."""
        nonlocal best
        start = best.value if best else floor
        proven, ceiling, step = start, None, grain  # the window reaches `proven`, not `ceiling`
        while True:
            if ceiling is None:
                target = -(-(proven + 1) // grain) * grain if proven == start else proven + step
            else:
                target = proven + (ceiling - proven) // grain // 2 * grain
                if target <= proven:
                    return True
            status, arena = search(window, target - 1)
            if status == INFEASIBLE:
                proven, step = target, 2 * step
                t0, t1 = int(times[window.first]), int(times[window.end])
                buffers = int(((alloc < t1) & (free > t0)).sum())
                source = f"search: no placement of the {buffers} buffers live in window [{t0}, {t1}) fits in"
                best = Bound(target, f"{source} {target - 1:,} B")
            elif status == FITS:
                ceiling = (arena // grain + 1) * grain  # the window's optimum is at most this arena
            else:
                return False

    pending = windows(live)
    while pending and spent < work and time.monotonic() < deadline:
        stuck: list[Window] = []  # timed out in this round: the windows around them wait for the next
        for window in pending:
            if not any(window.first <= w.first and w.end <= window.end for w in stuck) and raise_bound(window):
                continue
            stuck.append(window)
        pending = stuck
        cap *= ROUND_GROWTH
    return WindowBound(best, spent)


def windows(live: np.ndarray) -> list[Window]:
    """Windows of 2, 4, 8, ... sections up to the whole profile, each width at strides of half of it (the
    last one flush with the end); narrowest first, and within a width the heaviest (most live bytes) first."""
    found: list[Window] = []
    width = 2
    while True:
        width = min(width, len(live))
        starts = sorted(set(range(0, len(live) - width + 1, max(width // 2, 1))) | {len(live) - width})
        heaviest = sorted(starts, key=lambda first: (-live[first : first + width].max(), first))
        found += [Window(first, first + width) for first in heaviest]
        if width == len(live):
            return found
        width *= 2
