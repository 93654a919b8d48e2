"""The independent verifier and the plan file: hand-made bad plans are caught and named."""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.errors import PlanError
from memplan.planner.plan import Plan, PlanMismatchError, check_plan, load_plan, save_plan
from memplan.planner.problem import build_problem, problem_from_trace
from memplan.planner.verify import _sharing_pair, _sharing_pair_streams, verify_figures, verify_plan
from memplan.traces.format import make_trace, trace_digest


def problem(**kw):
    # 0: [0,4) 1 KiB, 1: [2,6) 1 KiB, 2: [6,8) 2 KiB, 3: [0,8) 512 B
    return build_problem([1024, 1024, 2048, 512], [0, 2, 6, 0], [4, 6, 8, 8], alignment=512, digest="d", **kw)


GOOD = [0, 1024, 0, 2048]


def test_a_valid_plan_passes():
    verify_plan(problem(), GOOD, 2560)


@pytest.mark.parametrize(
    "offsets, arena, capacity, message",
    [
        ([0, 512, 0, 2048], 2560, None, r"buffer 0 and buffer 1 may be live together but share bytes \[512, 1024\)"),
        ([0, 1024, 0, 1536], 2560, None, r"buffer 1 and buffer 3 may be live together but share bytes \[1536, 2048\)"),
        ([0, 1024, 0, 2100], 2612, None, "buffer 3 offset 2100 is not a multiple of the alignment 512"),
        ([0, 1024, 0, 2048], 2048, None, "buffer 3 ends at byte 2560, beyond the arena of 2048 bytes"),
        ([0, 1024, 0, 2048], 2560, 2048, "exceeds the capacity of 2048 bytes"),
        ([0, 1024, 0], 2560, None, "3 offsets but the problem has 4 buffers"),
        ([-512, 1024, 0, 2048], 2560, None, "negative offset"),
        ([0, 1024, 0, 2**63 - 512], 2560, None, "buffer 3 has an offset 9223372036854775296 beyond 2"),
        ([0, 1024, 0, 2**64], 2560, None, "does not fit in 64 bits"),
    ],
)
def test_bad_plans_are_caught_and_named(offsets, arena, capacity, message):
    with pytest.raises(PlanError, match=message):
        verify_plan(problem(), offsets, arena, capacity)


def test_buffers_that_never_meet_may_share():
    verify_plan(problem(), [0, 1024, 0, 2048], 2560)  # 0 and 2 share bytes [0, 1024): never live together


def test_contiguity_and_fixed_offsets_are_checked():
    p = problem(groups=[[0, 1]], fixed={3: 2048})
    verify_plan(p, GOOD, 2560)
    with pytest.raises(PlanError, match="contiguous group 0: buffer 1 does not start where buffer 0 ends"):
        verify_plan(p, [0, 1536, 0, 2048], 2560)
    with pytest.raises(PlanError, match="buffer 3 is at offset 2560 but is fixed at 2048"):
        verify_plan(p, [0, 1024, 0, 2560], 3072)


def test_names_use_csv_ids():
    p = build_problem([4, 4], [0, 1], [3, 4], alignment=1, ids=["conv", "relu"])
    with pytest.raises(PlanError, match=r"buffer 0 \(id conv\) and buffer 1 \(id relu\)"):
        verify_plan(p, [0, 2], 6)


def trace():
    """The trace of problem(): the same sizes and lifetimes."""
    return make_trace({"size": [1024, 1024, 2048, 512], "alloc": [0, 2, 6, 0], "free": [4, 6, 8, 8]})


def plan(offsets, arena=2560, digest=None, **figures):
    return Plan(
        digest=trace_digest(trace()) if digest is None else digest,
        alignment=512,
        offsets=offsets,
        arena=arena,
        **{"bound": 2560, "status": "optimal", "gap": 0.0, **figures},
        solver="test",
        seconds=0.1,
    )


def test_save_verifies_first_and_load_round_trips(tmp_path):
    path = tmp_path / "p.json"
    problem = problem_from_trace(trace())
    save_plan(plan(GOOD), problem, path)
    assert load_plan(path, trace()) == plan(GOOD)
    assert load_plan(path, [make_trace({"size": [1], "alloc": [1], "free": [2]}), trace()]) == plan(GOOD)
    assert load_plan(path, trace) == plan(GOOD)  # the trace from a function, asked for once the file has parsed
    bad = tmp_path / "bad.json"
    with pytest.raises(PlanError, match="share bytes"):
        save_plan(plan([0, 0, 0, 2048]), problem, bad)
    assert not bad.exists()
    with pytest.raises(PlanMismatchError, match="different trace"):
        save_plan(plan(GOOD, digest="other"), problem, bad)


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"format": "x"}, "not a memplan-plan/1 file"),
        ({"format": "memplan-plan/1"}, "missing field 'offsets'"),
        ({"format": "memplan-plan/1", "offsets": [0, "a"]}, "non-negative integers"),
        ({**asdict(plan(GOOD)), "format": "memplan-plan/1", "arena": 2**70}, r"'arena' is \d+, outside \[0, 2\*\*62\)"),
        ({**asdict(plan(GOOD)), "format": "memplan-plan/1", "seconds": -1}, "'seconds' is -1.0, not a finite number"),
        ({**asdict(plan(GOOD)), "format": "memplan-plan/1", "alignment": 0}, r"'alignment' is 0, outside \[1, 2"),
    ],
)
def test_bad_plan_files_are_one_line_errors(tmp_path, doc, message):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanError, match=message):
        load_plan(path, trace())
    with pytest.raises(PlanError, match="no such file"):
        load_plan(tmp_path / "missing.json", trace())


def test_not_json_numbers_and_deep_nesting_are_refused(tmp_path):
    text = json.dumps({**asdict(plan(GOOD)), "format": "memplan-plan/1"})
    (tmp_path / "nan.json").write_text(text.replace('"gap": 0.0', '"gap": NaN'))
    with pytest.raises(PlanError, match="NaN is not a number JSON allows"):
        load_plan(tmp_path / "nan.json", trace())
    (tmp_path / "deep.json").write_text(
        '{"format": "memplan-plan/1", "offsets": ' + "[" * 100_000 + "]" * 100_000 + "}"
    )
    with pytest.raises(PlanError, match="nested too deeply"):
        load_plan(tmp_path / "deep.json", trace())


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"offsets": [0, 512, 0, 2048]}, r"invalid for its trace: buffer 0 and buffer 1 may be live together"),
        ({"arena": 2**61, "bound": 2**61}, "the arena says 2305843009213693952 bytes but the placement's highest"),
        ({"bound": 5120}, "lower bound of 5120 bytes is not between 0 and the arena of 2560 bytes"),
        ({"offsets": [0, 1024, 0, 2560], "arena": 3072}, "status 'optimal' with arena 3072 and bound 2560"),
        ({"bound": 2048, "gap": 0.25}, "status 'optimal' with arena 2560 and bound 2048 bytes: it is feasible"),
        ({"bound": 2048, "status": "feasible", "gap": 0.0}, r"gap 0.0 is not arena / bound - 1 = 0.25"),
        ({"bound": 2048, "bound_source": "max-live", "offsets": [0, 1024, 0, 2560], "arena": 3072,
          "status": "feasible", "gap": 0.5}, "the bound says max-live, 2048 bytes, but the trace's max-live is 2560"),
    ],
)  # fmt: skip
def test_an_edited_plan_file_is_refused_on_reading(tmp_path, edit, message):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**asdict(plan(GOOD)), "format": "memplan-plan/1", **edit}))
    with pytest.raises(PlanError, match=message):
        load_plan(path, trace())
    with pytest.raises(PlanMismatchError, match="made for another trace, not the trace given"):
        load_plan(path, make_trace({"size": [1], "alloc": [1], "free": [2]}))


def test_figures_of_a_plan_object_are_verified_too():
    """verify_figures, as check_plan (and so every view) applies it to a plan made in Python."""
    problem = problem_from_trace(trace())
    check_plan(plan(GOOD), problem)
    with pytest.raises(PlanError, match="gap nan is not"):
        check_plan(plan(GOOD, bound=2048, status="feasible", gap=float("nan")), problem)
    feasible = plan([0, 1024, 0, 2560], arena=3072, bound=2560, status="feasible", gap=0.2, bound_source="max-live")
    check_plan(feasible, problem)
    with pytest.raises(PlanError, match="the arena says 0 bytes"):
        verify_figures(problem, GOOD, arena=0, bound=0, status="optimal", gap=0.0)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(2, 40))
def test_the_sweep_finds_a_sharing_pair_exactly_when_the_pairwise_check_does(seed, n):
    """On one stream the verifier sweeps time (O(n log n)); the offset-sorted pairwise check it replaced, which it
    still uses across streams, must agree on every placement, valid or not."""
    rng = np.random.default_rng(seed)
    alloc = rng.integers(0, 30, n)
    p = build_problem(rng.integers(0, 4, n) * 512, alloc, alloc + rng.integers(0, 10, n), alignment=512)
    off = rng.integers(0, 8, n) * 512
    end = off + p.size
    found, pairwise = _sharing_pair(p, off, end), _sharing_pair_streams(p, off, end)
    assert (found is None) == (pairwise is None)
    if found is not None:
        assert p.conflict(*found) and max(off[list(found)]) < min(end[list(found)])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(2, 30))
def test_across_streams_the_verdict_is_the_pairwise_checks(seed, n):
    """On several streams the sweep over each buffer's latest release finds every conflict that shares bytes (and
    some pairs that are no conflict): a placement it passes has no sharing pair; one it does not pass is refused
    exactly when the pairwise check finds a pair."""
    rng = np.random.default_rng(seed)
    alloc = rng.integers(0, 30, n)
    syncs = [(int(t), int(a), int(b)) for t, a, b in rng.integers(0, [40, 3, 3], (int(rng.integers(0, 6)), 3))]
    p = build_problem(
        rng.integers(0, 4, n) * 512, alloc, alloc + rng.integers(0, 10, n), stream=rng.integers(0, 3, n),
        syncs=syncs, alignment=512,
    )  # fmt: skip
    off = rng.integers(0, 8, n) * 512
    end = off + p.size
    pairwise = _sharing_pair_streams(p, off, end)
    if _sharing_pair(p, off, end) is None:
        assert pairwise is None
    if pairwise is None:
        verify_plan(p, off.tolist(), int(end.max()))
    else:
        with pytest.raises(PlanError, match="may be live together but share bytes"):
            verify_plan(p, off.tolist(), int(end.max()))
