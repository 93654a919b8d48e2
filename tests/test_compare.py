"""`memplan compare`: every figure of the table equals an independent computation on the same traces."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner
from step_traces import step_trace
from test_simulate_cli import brute_max_live, side_by_side_plan

from memplan.cli import main
from memplan.planner.plan import save_plan
from memplan.planner.problem import problem_from_trace
from memplan.planner.report.compare import compare_traces
from memplan.planner.simulate.caching_allocator import simulate_caching
from memplan.planner.verify import verify_plan
from memplan.solvers import solve
from memplan.traces import save


def brute_peak(trace):
    """(peak live bytes, first time, bytes by category live then), one logical time at a time."""
    best, when = -1, 0
    for t in range(trace.end):
        live = sum(int(s) for s, a, f in zip(trace.size, trace.alloc, trace.free) if a <= t < f)
        if live > best:
            best, when = live, t
    by_cat = {}
    for i in range(len(trace)):
        if trace.alloc[i] <= when < trace.free[i]:
            by_cat[trace.category[i]] = by_cat.get(trace.category[i], 0) + int(trace.size[i])
    return best, when, by_cat


@pytest.fixture
def files(tmp_path):
    base = step_trace(layers=5, seed=0, meta={"model": "toy", "layers": "baseline"})
    tempo = step_trace(layers=5, seed=0, activation=2 << 20, meta={"model": "toy", "layers": "tempo"})
    save(base, tmp_path / "base.json")
    save(tempo, tmp_path / "tempo.json")
    save_plan(side_by_side_plan(base), problem_from_trace(base), tmp_path / "base.plan.json")
    return tmp_path, base, tempo


def test_table_equals_independent_computations(files):
    tmp, base, tempo = files
    r = CliRunner().invoke(
        main,
        [
            "compare",
            str(tmp / "base.json"),
            str(tmp / "tempo.json"),
            "--plan",
            str(tmp / "base.plan.json"),
            "--method",
            "greedy",
            "--time-limit",
            "2",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["traces"]
    assert [row["name"] for row in rows] == [str(tmp / "base.json"), str(tmp / "tempo.json")]
    assert [row["title"] for row in rows] == ["toy · baseline", "toy · tempo"]
    for row, trace in zip(rows, (base, tempo)):
        peak, when, by_cat = brute_peak(trace)
        assert (row["peak_live"], row["peak_live_time"]) == (peak, when)
        assert {c: b for c, b in row["at_peak"].items() if b} == by_cat
        assert set(row["at_peak"]) == set(base.category) | set(tempo.category)
        sim = simulate_caching(trace)
        assert row["caching_peak_reserved"] == sim.peak_reserved
        assert row["caching_peak_allocated"] == sim.peak_allocated
        assert row["bound"] >= brute_max_live(trace)
        assert row["plan_arena"] >= row["bound"]
    assert rows[0]["plan_arena"] == side_by_side_plan(base).arena
    assert rows[0]["plan_source"] == str(tmp / "base.plan.json")
    assert rows[1]["plan_source"] == "solved: greedy"
    assert rows[1]["plan_arena"] < side_by_side_plan(tempo).arena  # the solver reuses bytes


def test_solved_plan_is_verified_and_is_the_one_reported(files):
    tmp, _, tempo = files
    plan = solve(problem_from_trace(tempo), method="greedy", time_limit=2.0)
    verify_plan(problem_from_trace(tempo), plan.offsets, plan.arena)
    [row] = compare_traces([("tempo", tempo)], method="greedy", time_limit=2.0)
    assert (row.plan_arena, row.status, row.gap, row.solver) == (plan.arena, plan.status, plan.gap, plan.solver)


def test_text_table_has_a_column_per_trace_and_changes(files):
    tmp, base, tempo = files
    r = CliRunner().invoke(
        main,
        [
            "compare",
            str(tmp / "base.json"),
            str(tmp / "tempo.json"),
            "--plan",
            str(tmp / "base.plan.json"),
            "--method",
            "greedy",
            "--time-limit",
            "2",
        ],
    )
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert "base.json" in lines[0] and "tempo.json" in lines[0]
    labels = [re.split(r"\s{2,}", line.strip())[0] for line in lines]
    for label in ("peak live", "caching peak reserved", "plan arena", "lower bound", *sorted(set(base.category))):
        assert label in labels
    peak_line = next(line for line in lines if line.startswith("peak live"))
    change = (tempo.peak()[0] - base.peak()[0]) / base.peak()[0]
    assert f"({change:+.1%})" in peak_line


def test_identical_traces_take_their_plans_in_order_or_share_one():
    """Symmetric ranks give identical traces: two plans go one to each, one plan serves both."""
    from memplan.planner.simulate.plan_footprint import PlanMismatchError, match_plans

    a, b, other = step_trace(layers=3, seed=4), step_trace(layers=3, seed=4), step_trace(layers=3, seed=5)
    p, q = side_by_side_plan(a), side_by_side_plan(b)
    traces = [("rank0", a), ("rank1", b)]
    assert [m[0] for m in match_plans(traces, [("p", p), ("q", q)])] == ["p", "q"]
    assert [m[0] for m in match_plans(traces, [("p", p)])] == ["p", "p"]
    assert match_plans(traces + [("x", other)], [("p", p)])[2] is None
    with pytest.raises(PlanMismatchError, match="a second plan for rank0"):
        match_plans(traces, [("p", p), ("q", q), ("r", p)])
    with pytest.raises(PlanMismatchError, match="made for none of the given traces"):
        match_plans(traces, [("o", side_by_side_plan(other))])
