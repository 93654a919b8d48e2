"""Reuse safety across streams: only a free that happens before an allocation lets two buffers share bytes."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.planner.problem import build_problem
from memplan.planner.verify import verify_plan
from memplan.solvers import solve
from memplan.solvers.bounds import lower_bound

KB = 1024


def two_streams(syncs):
    """Buffer 0 on stream 1 lives [1, 3); buffer 1 on stream 0 lives [5, 7)."""
    return build_problem([KB, KB], [1, 5], [3, 7], stream=[1, 0], syncs=syncs, alignment=512)


def test_cross_stream_without_sync_never_share():
    p = two_streams([])
    assert p.conflict(0, 1) and p.conflict(1, 0)
    plan = solve(p, time_limit=2)
    verify_plan(p, plan.offsets, plan.arena)
    assert plan.arena == 2 * KB and plan.bound == 2 * KB and plan.status == "optimal"
    lo, hi = sorted(plan.offsets)
    assert hi - lo >= KB


def test_cross_stream_with_sync_may_share():
    p = two_streams([(4, 1, 0)])
    assert not p.conflict(0, 1)
    plan = solve(p, time_limit=2)
    assert plan.arena == KB and plan.offsets == [0, 0] and plan.status == "optimal"


def test_sync_must_follow_the_free_and_go_the_right_way():
    assert two_streams([(4, 0, 1)]).conflict(0, 1)  # wrong direction
    assert two_streams([(2, 1, 0)]).conflict(0, 1)  # before the free at 3
    assert not two_streams([(3, 1, 0)]).conflict(0, 1)  # at the free's time: ordered after it
    assert two_streams([(5, 1, 0)]).conflict(0, 1)  # the allocation at 5 is not after the sync


def test_syncs_chain_through_a_third_stream_but_not_at_the_same_time():
    def p(syncs):
        return build_problem([KB, KB], [1, 6], [2, 8], stream=[2, 0], syncs=syncs, alignment=512)

    assert not p([(3, 2, 1), (5, 1, 0)]).conflict(0, 1)
    assert p([(3, 2, 1), (3, 1, 0)]).conflict(0, 1)
    assert p([(3, 1, 0), (5, 2, 1)]).conflict(0, 1)  # wrong order


def test_bound_is_the_heaviest_unordered_set_not_max_live():
    # Three streams, disjoint lifetimes, no syncs: never live together, yet none may share.
    p = build_problem([KB, 2 * KB, 4 * KB], [1, 3, 5], [2, 4, 6], stream=[0, 1, 2], alignment=512)
    assert p.max_live() == 4 * KB
    assert lower_bound(p) == 7 * KB
    q = build_problem(
        [KB, 2 * KB, 4 * KB], [1, 3, 5], [2, 4, 6], stream=[0, 1, 2], syncs=[(2, 0, 1), (4, 1, 2)], alignment=512
    )
    assert lower_bound(q) == 4 * KB


def brute_heaviest_clique(p) -> int:
    n, best = len(p), 0
    for r in range(1, n + 1):
        for subset in itertools.combinations(range(n), r):
            if all(p.conflict(i, j) for i, j in itertools.combinations(subset, 2)):
                best = max(best, int(p.size[list(subset)].sum()))
    return best


@st.composite
def multi_stream(draw):
    n = draw(st.integers(2, 7))
    alloc = [draw(st.integers(1, 20)) for _ in range(n)]
    free = [a + draw(st.integers(1, 8)) for a in alloc]
    size = [draw(st.integers(1, 4)) * 512 for _ in range(n)]
    stream = [draw(st.integers(0, 2)) for _ in range(n)]
    syncs = [
        (draw(st.integers(0, 30)), draw(st.integers(0, 2)), draw(st.integers(0, 2)))
        for _ in range(draw(st.integers(0, 4)))
    ]
    return build_problem(size, alloc, free, stream=stream, syncs=syncs, alignment=512)


@settings(max_examples=60, deadline=None)
@given(multi_stream())
def test_bound_equals_the_heaviest_clique_of_the_conflict_graph(p):
    assert lower_bound(p) == max(brute_heaviest_clique(p), int(p.size.max()))


@settings(max_examples=40, deadline=None)
@given(multi_stream())
def test_conflict_matches_explicit_happens_before(p):
    # Reference: a graph of per-stream program order plus sync edges, closed transitively.
    events = []  # (stream, time, rank, tag)
    for i in range(len(p)):
        events += [(int(p.stream[i]), int(p.alloc[i]), 1, ("a", i)), (int(p.stream[i]), int(p.free[i]), 0, ("f", i))]
    for k, (t, a, b) in enumerate(p.syncs):
        if a != b:
            events += [(a, t, 2, ("s", k)), (b, t, 3, ("r", k))]
    events.sort()
    index = {e[3]: n for n, e in enumerate(events)}
    reach = np.eye(len(events), dtype=bool)
    edges = [(n, n + 1) for n in range(len(events) - 1) if events[n][0] == events[n + 1][0]]
    edges += [(index[("s", k)], index[("r", k)]) for k, (t, a, b) in enumerate(p.syncs) if a != b]
    for _ in range(len(events)):
        for u, v in edges:
            reach[:, v] |= reach[:, u]
    for i, j in itertools.combinations(range(len(p)), 2):
        ordered = reach[index[("f", i)], index[("a", j)]] or reach[index[("f", j)], index[("a", i)]]
        assert p.conflict(i, j) == (not ordered)
