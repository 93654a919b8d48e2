"""Plan scopes: a `step` plan places only the step's own buffers; the rest is counted outside its arena."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from step_traces import step_trace

from memplan.cli import main
from memplan.errors import PlanError
from memplan.planner.plan import load_plan, save_plan
from memplan.planner.problem import ProblemError, problem_from_trace
from memplan.planner.simulate.plan_footprint import simulate_plan
from memplan.planner.verify import verify_plan
from memplan.solvers import solve
from memplan.traces import save


@pytest.fixture
def trace():
    return step_trace(layers=4, seed=3)


def whole_window(trace) -> np.ndarray:
    return (trace.alloc == 0) & (trace.free == trace.end)


def test_step_plan_leaves_whole_window_buffers_out_and_counts_them_outside(trace):
    everything = solve(problem_from_trace(trace))
    problem = problem_from_trace(trace, scope="step")
    plan = solve(problem)
    out = whole_window(trace)
    assert out.any() and not out.all()
    offsets = np.asarray(plan.offsets)
    assert (offsets[out] == -1).all() and (offsets[~out] >= 0).all() and plan.scope == "step"
    # the step's bound: most aligned bytes of the step's own buffers live at once, computed here directly
    aligned = (trace.size + 511) // 512 * 512
    step_live = max(
        int(sum(aligned[i] for i in range(len(trace)) if not out[i] and trace.alloc[i] <= t < trace.free[i]))
        for t in range(trace.end)
    )
    assert plan.bound == step_live and plan.arena >= plan.bound
    memory = simulate_plan(trace, plan)
    assert memory.peak_outside == int(aligned[out].sum())
    assert memory.peak_total == plan.arena + memory.peak_outside >= everything.arena


def test_verifier_holds_a_step_plan_to_its_scope(trace):
    problem = problem_from_trace(trace, scope="step")
    plan = solve(problem)
    inside = int(np.nonzero(~whole_window(trace) & (trace.size > 0))[0][0])
    outside = int(np.nonzero(whole_window(trace))[0][0])
    moved = list(plan.offsets)
    moved[outside] = 0
    with pytest.raises(PlanError, match=f"buffer {outside} is outside the plan's scope but has offset 0"):
        verify_plan(problem, moved, plan.arena)
    dropped = list(plan.offsets)
    dropped[inside] = -1
    with pytest.raises(PlanError, match=f"buffer {inside} has a negative offset"):
        verify_plan(problem, dropped, plan.arena)
    with pytest.raises(PlanError, match="negative offset"):  # a plan of every buffer has no -1
        verify_plan(problem_from_trace(trace), plan.offsets, plan.arena)


def test_step_plan_file_round_trip_and_old_plans_place_everything(trace, tmp_path):
    problem = problem_from_trace(trace, scope="step")
    plan = solve(problem)
    save_plan(plan, problem, tmp_path / "p.json")
    again = load_plan(tmp_path / "p.json", trace)
    assert again == plan
    with pytest.raises(PlanError, match="plan scope 'step' differs"):
        save_plan(plan, problem_from_trace(trace), tmp_path / "q.json")
    doc = json.loads((tmp_path / "p.json").read_text())
    doc.pop("scope")
    (tmp_path / "old.json").write_text(json.dumps(doc))
    with pytest.raises(PlanError, match="offsets must be non-negative"):
        load_plan(tmp_path / "old.json", trace)  # without a scope a plan places everything: -1 is refused
    everything = solve(problem_from_trace(trace))
    doc = {"format": "memplan-plan/1", **{k: v for k, v in everything.__dict__.items() if k != "scope"}}
    (tmp_path / "older.json").write_text(json.dumps(doc))
    assert load_plan(tmp_path / "older.json", trace).scope == "all"


def test_cli_scope_and_what_it_refuses(trace, tmp_path):
    save(trace, tmp_path / "t.json")
    r = CliRunner().invoke(
        main, ["solve", str(tmp_path / "t.json"), "--scope", "step", "-o", str(tmp_path / "p.json"), "--json"]
    )
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["scope"] == "step" and s["outside"] == int(whole_window(trace).sum())
    r = CliRunner().invoke(main, ["simulate", str(tmp_path / "t.json"), "--plan", str(tmp_path / "p.json"), "--json"])
    plan = json.loads(r.stdout)["plan"]
    assert plan["scope"] == "step" and plan["total_peak"] == plan["arena"] + plan["outside_peak"]
    r = CliRunner().invoke(main, ["solve", str(tmp_path / "t.json"), "--scope", "step", "-o", str(tmp_path / "p.csv")])
    assert r.exit_code == 1 and "cannot leave buffers out" in r.output and not (tmp_path / "p.csv").exists()
    (tmp_path / "x.csv").write_text("id,lower,upper,size\na,0,3,4\n")
    r = CliRunner().invoke(main, ["solve", str(tmp_path / "x.csv"), "--scope", "step"])
    assert r.exit_code == 1 and "has no training step" in r.output
    with pytest.raises(ProblemError, match="outside the plan's scope"):
        problem_from_trace(trace, scope="step", fixed={int(np.nonzero(whole_window(trace))[0][0]): 0})
