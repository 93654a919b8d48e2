"""The window bound: never above the optimum, above max-live where a window proves it, deterministic."""

from __future__ import annotations

import re

import numpy as np
import pytest

from memplan.planner.problem import build_problem
from memplan.solvers import solve
from memplan.solvers.search import FITS, INFEASIBLE, TIMEOUT, search_fit
from memplan.solvers.window_bound import Window, window_bound, windows

WORK = 10**7  # search steps per thread: far more than these small problems need
SEARCH_WORK = 10**8  # for the exact optimum: a few problems stay undecided, and are left out


def tight(rng: np.random.Generator):
    """A one-stream problem whose live bytes are the same at every time: at each step some live buffers are
    freed and new ones (sizes 1 ..) fill the room back to the capacity. Placing them in that capacity is
    impossible about three times in a hundred (about 25 buffers), where uniformly random lifetimes nearly
    always fit in max-live."""
    capacity, steps, largest = 16, 10, 8
    size, alloc, free, live = [], [], [], []
    for t in range(steps):
        for i in [i for i in live if rng.random() < 0.5]:
            free[i] = t
            live.remove(i)
        room = capacity - sum(size[i] for i in live)
        while room > 0:
            size.append(int(min(room, rng.integers(1, largest + 1))))
            alloc.append(t)
            free.append(steps)
            live.append(len(size) - 1)
            room -= size[-1]
    return build_problem(size, alloc, free, alignment=1)


def optimum(p) -> int | None:
    """The least capacity the exact search fits p in (test_solvers checks it against brute force), or None
    if the search does not decide it within SEARCH_WORK steps."""
    capacity = p.max_live()
    while (status := search_fit(p, capacity, SEARCH_WORK, 60.0).status) != FITS:
        if status == TIMEOUT:
            return None
        capacity += 1
    return capacity


@pytest.mark.slow  # 3-10 s: out of the fast lane, which stays under 3 minutes
def test_never_above_the_optimum_and_above_max_live_where_max_live_is_not_enough():
    rng = np.random.default_rng(7)
    gaps = proven = 0
    for k in range(600):
        p = tight(rng)
        floor, best = p.max_live(), optimum(p)
        if best == floor:
            if k % 8 == 0:  # max-live is the optimum: nothing above it can be proven
                assert window_bound(p, floor, WORK, 60.0).bound is None
            continue
        if best is None:
            continue
        gaps += 1
        found = window_bound(p, floor, WORK, 60.0)
        assert found.work <= WORK
        if found.bound is not None:
            proven += 1
            assert floor < found.bound.value <= best, found
            assert found.bound.source.startswith("search: no placement of the ")
        # From 0 the bound climbs (galloping, then bisecting) window after window, and the widest window is the
        # whole problem: unless the budget ran out, the bound ends at the optimum.
        from_zero = window_bound(p, 0, WORK, 60.0)
        assert from_zero.bound.value <= best
        if from_zero.work < WORK:
            assert from_zero.bound.value == best
    print(f"{gaps} of 600 problems do not fit in max-live; the window bound proves it for {proven}")
    assert proven >= 5 and proven >= gaps / 2


def test_deterministic():
    rng = np.random.default_rng(3)
    problems = [tight(rng) for _ in range(200)]
    gaps = [p for p in problems if search_fit(p, p.max_live(), SEARCH_WORK, 60.0).status == INFEASIBLE]
    assert gaps
    for p in gaps[:2] + problems[:2]:
        for work in (30_000, 300_000, 3_000_000):  # small budgets too, where searches time out
            first = window_bound(p, 0, work, 60.0)
            assert first == window_bound(p, 0, work, 60.0) and first.work <= work


def test_a_window_inside_a_long_problem_proves_its_gap():
    """A problem whose gap the window bound proves, then a long tail of buffers one after another: the bound
    is the same, and comes from a window that leaves most of the tail out."""
    rng = np.random.default_rng(11)
    while (found := window_bound(gap := tight(rng), gap.max_live(), WORK, 60.0)).bound is None:
        pass
    end = int(gap.free.max())
    tail = np.arange(end, end + 200)
    p = build_problem(
        np.concatenate([gap.size, np.ones(200, dtype=np.int64)]),
        np.concatenate([gap.alloc, tail]),
        np.concatenate([gap.free, tail + 1]),
        alignment=1,
    )
    embedded = window_bound(p, p.max_live(), WORK, 60.0).bound
    assert embedded.value == found.bound.value
    t0, t1 = (int(t) for t in re.search(r"window \[(\d+), (\d+)\)", embedded.source).groups())
    assert t1 - t0 < 100


def test_windows_cover_every_width_up_to_the_whole_profile():
    live = np.array([1, 5, 2, 2, 9, 3, 1])
    found = windows(live)
    assert found[-1] == Window(0, 7)
    assert found[0] == Window(3, 5) or found[0] == Window(4, 6)  # the heaviest pair holds the 9
    assert {w.end - w.first for w in found} == {2, 4, 7}
    assert all(0 <= w.first < w.end <= 7 for w in found) and len(set(found)) == len(found)
    for width in (2, 4):  # the windows of one width cover every section
        assert set().union(*(range(w.first, w.end) for w in found if w.end - w.first == width)) == set(range(7))


def test_not_applicable_to_several_streams():
    p = build_problem([4, 4], [0, 0], [2, 2], stream=[0, 1], alignment=1)
    assert window_bound(p, 0, WORK, 60.0).bound is None


def test_the_portfolio_reports_a_bound_past_max_live_with_its_source():
    """A problem that needs more than max-live: the plan's bound is above max-live, never above its arena,
    and says which proof gave it."""
    rng = np.random.default_rng(5)
    while (p := tight(rng)).max_live() == optimum(p):
        pass
    plan = solve(p, time_limit=5.0)
    assert p.max_live() < plan.bound <= plan.arena == optimum(p)
    assert plan.bound_source.startswith("search: no placement")
