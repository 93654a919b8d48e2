"""Streams in a trace (traces/cuda/streams.py): the orderings a step makes between streams become syncs that say exactly
what happens before what, a fake CUDA step records its streams and orderings, and reuse across streams follows them
in the planner, the verifier and the caching-allocator simulator."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from memplan.errors import MemplanError
from memplan.planner.problem import build_problem, problem_from_trace
from memplan.planner.report.trace_text import render_trace
from memplan.planner.simulate.caching_allocator import simulate_caching
from memplan.planner.verify import verify_plan
from memplan.solvers import solve
from memplan.traces.capture import record
from memplan.traces.cuda.streams import Ordering, StreamLedger, stream_columns
from memplan.traces.format import make_trace
from memplan.traces.summary import summarize

torch.set_num_threads(1)
KB = 1024


def happens_before(orderings: list[Ordering], nstreams: int) -> list[np.ndarray]:
    """For each ordering, what its waiter knows after it: per stream, the latest time ordered before (reference:
    vector clocks carried by events; an ordering received at time t reaches the sender's events after t only)."""
    known: list[np.ndarray] = []
    for o in orderings:
        clock = np.full(nstreams, -1)
        clock[o.waited] = o.sent
        known.append(clock)
    changed = True
    while changed:  # what the sender knew when it recorded, transitively
        changed = False
        for i, o in enumerate(orderings):
            for j, p in enumerate(orderings):
                if p.waiter == o.waited and p.received < o.sent:
                    merged = np.maximum(known[i], known[j])
                    if (merged != known[i]).any():
                        known[i], changed = merged, True
    return known


def ordered(i: int, j: int, stream, alloc, free, orderings, known) -> bool:
    """Reference: buffer i's free happens before buffer j's allocation."""
    if stream[i] == stream[j]:
        return free[i] <= alloc[j]
    return any(
        o.waiter == stream[j] and o.received < alloc[j] and k[stream[i]] >= free[i] for o, k in zip(orderings, known)
    )


@st.composite
def steps(draw):
    """A few buffers on up to three streams and orderings between them (an event recorded, later waited on)."""
    n = draw(st.integers(2, 6))
    times = draw(st.permutations(list(range(1, 2 * n + 1))))
    stream = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    alloc = [min(times[2 * i], times[2 * i + 1]) for i in range(n)]
    free = [max(times[2 * i], times[2 * i + 1]) for i in range(n)]
    orderings = []
    for _ in range(draw(st.integers(0, 5))):
        a, b = draw(st.integers(0, 2)), draw(st.integers(0, 2))
        sent = draw(st.integers(0, 2 * n))
        received = draw(st.integers(sent, 2 * n))
        orderings.append(Ordering(a, sent, b, received))
    return stream, alloc, free, orderings


@settings(max_examples=300, deadline=None)
@given(steps())
@example(
    (
        [0, 0, 0, 0, 2],
        [1, 3, 5, 7, 9],
        [2, 4, 6, 8, 10],
        [Ordering(0, 2, 1, 2), Ordering(0, 0, 0, 0), Ordering(1, 2, 2, 3)],
    )
)
def test_syncs_say_exactly_the_orderings(step):
    """Every pair of buffers the trace's syncs let share bytes is ordered by the step (sound), and every ordered
    pair may share (exact), whichever of the three encodings each ordering takes."""
    stream, alloc, free, orderings = step
    ledger = StreamLedger(orderings=orderings, known={0, 1, 2})
    columns = stream_columns(stream, alloc, free, list(range(len(alloc))), ledger, 2 * len(alloc) + 1)
    known = happens_before(orderings, 3)
    p = build_problem([KB] * len(alloc), alloc, free, stream=columns.stream, syncs=columns.syncs)
    for i in range(len(alloc)):
        for j in range(len(alloc)):
            if i == j:
                continue
            step = (stream, alloc, free, orderings, known)
            truth = ordered(i, j, *step) or ordered(j, i, *step)
            assert (not p.conflict(i, j)) == truth, (i, j, columns.syncs)


def two_streams(syncs):
    """Buffer 0 on a side stream lives [1, 3); buffer 1 on the default stream [5, 7)."""
    columns = {"size": [KB, KB], "alloc": [1, 5], "free": [3, 7], "stream": [1, 0]}
    return make_trace(columns, syncs=syncs)


def test_a_plan_that_ignores_a_missing_sync_is_rejected():
    """Two buffers on two streams, never live at once: with the sync after the first one's free they may share
    bytes; the same plan on the trace without that sync is refused by the verifier."""
    synced = problem_from_trace(two_streams([(4, 1, 0)]))
    plan = solve(synced, time_limit=2)
    assert plan.offsets == [0, 0]
    verify_plan(synced, plan.offsets, plan.arena)
    with pytest.raises(MemplanError, match="overlap|share|conflict"):
        verify_plan(problem_from_trace(two_streams([])), plan.offsets, plan.arena)


def test_the_simulator_keeps_a_stream_s_freed_block_for_that_stream():
    """PyTorch's allocator does not hand a block freed on one stream to another, whatever the syncs: two buffers of
    one size on two streams, never live at once, take a segment each; on one stream, one block."""
    apart = simulate_caching(two_streams([(4, 1, 0)]))
    together = simulate_caching(make_trace({"size": [KB, KB], "alloc": [1, 5], "free": [3, 7], "stream": [0, 0]}))
    assert len(set(apart.addr.tolist())) == 2 and len(set(together.addr.tolist())) == 1
    assert apart.peak_reserved == 2 * together.peak_reserved == 4 * 1024 * KB


def side_stream_step(keep: bool):
    """A fake CUDA step whose activation is made on a side stream the default stream waits for (an event), and with
    `keep`, handed back to the default stream by record_stream."""
    with record(fake=True, device="cuda") as recording:
        model = torch.nn.Linear(64, 64, device="cuda")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.ones(8, 64, device="cuda")
        side = torch.cuda.Stream()
        with recording.step(model, optimizer, inputs=x):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                h = x * 2
            done = side.record_event()
            torch.empty(4 * KB, device="cuda")  # a default-stream temporary between the record and the wait
            torch.cuda.current_stream().wait_event(done)
            if keep:
                h.record_stream(torch.cuda.current_stream())
            model(h).sum().backward()
            del h
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return recording.trace


def test_a_fake_cuda_step_records_its_streams_and_orderings():
    trace = side_stream_step(keep=False)
    assert trace.meta["streams"] == {"0": "default", "1": ""}
    side = [i for i in range(len(trace.size)) if trace.stream[i] == 1]
    assert [trace.op[i] for i in side] == ["aten::mul"]
    (h,) = side
    # the side stream waits for the default one before its work; the default one for the side stream's event
    assert any(a == 0 and b == 1 and t < trace.alloc[h] for t, a, b in trace.syncs)
    assert any(a == 1 and b == 0 and t >= trace.alloc[h] for t, a, b in trace.syncs)
    p = problem_from_trace(trace)
    plan = solve(p, time_limit=2)
    verify_plan(p, plan.offsets, plan.arena)
    summary = summarize(trace)
    assert [(x["stream"], x["name"], x["buffers"]) for x in summary.streams] == [
        (0, "default", len(trace) - 1),
        (1, "", 1),
    ]
    assert (
        f"streams: 0 default ({len(trace) - 1:,} buffers), 1 unnamed (1 buffers); {len(trace.syncs)} syncs"
        in render_trace(summary)
    )


def test_record_stream_holds_the_block_until_the_using_stream_is_ordered_after_its_free():
    """`record_stream(default)` on the side stream's activation: its free moves to the end of the step, as no sync
    from the default stream back to the side stream follows it."""
    plain, kept = side_stream_step(keep=False), side_stream_step(keep=True)
    (h,) = [i for i in range(len(kept.size)) if kept.stream[i] == 1]
    assert plain.free[h] < kept.free[h] == int(kept.free.max())


def test_a_cpu_step_has_one_stream_and_no_syncs():
    with record(fake=True) as recording:
        model = torch.nn.Linear(8, 8)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with recording.step(model, optimizer):
            model(torch.ones(2, 8)).sum().backward()
            optimizer.step()
    trace = recording.trace
    assert set(trace.stream.tolist()) == {0} and trace.syncs == [] and "streams" not in trace.meta
    assert summarize(trace).streams == [] and "streams:" not in render_trace(summarize(trace))
