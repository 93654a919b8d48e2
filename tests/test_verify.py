"""The independent verifier and the plan file: hand-made bad plans are caught and named."""

from __future__ import annotations

import json

import pytest

from memplan.errors import PlanError
from memplan.planner.plan import Plan, load_plan, save_plan
from memplan.planner.problem import build_problem
from memplan.planner.verify import verify_plan


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
        ([0, 1024, 0, 1536], 2560, None, "buffer 2 and buffer 3 may be live together"),
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


def plan(offsets, arena=2560, digest="d"):
    return Plan(
        digest=digest,
        alignment=512,
        offsets=offsets,
        arena=arena,
        bound=2560,
        status="optimal",
        gap=0.0,
        solver="test",
        seconds=0.1,
    )


def test_save_verifies_first_and_load_round_trips(tmp_path):
    path = tmp_path / "p.json"
    save_plan(plan(GOOD), problem(), path)
    assert load_plan(path) == plan(GOOD)
    bad = tmp_path / "bad.json"
    with pytest.raises(PlanError, match="share bytes"):
        save_plan(plan([0, 0, 0, 2048]), problem(), bad)
    assert not bad.exists()
    with pytest.raises(PlanError, match="different trace"):
        save_plan(plan(GOOD, digest="other"), problem(), bad)


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"format": "x"}, "not a memplan-plan/1 file"),
        ({"format": "memplan-plan/1"}, "missing field 'offsets'"),
        ({"format": "memplan-plan/1", "offsets": [0, "a"]}, "non-negative integers"),
    ],
)
def test_bad_plan_files_are_one_line_errors(tmp_path, doc, message):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanError, match=message):
        load_plan(path)
    with pytest.raises(PlanError, match="no such file"):
        load_plan(tmp_path / "missing.json")
