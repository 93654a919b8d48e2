"""The solve's budget: deterministic work instead of wall-clock shares, so a busy machine gives the same
answer; capacity mode leaves CP-SAT its share; the bound says where it came from; a million buffers are
solved within the time limit."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest
from click.testing import CliRunner
from large_trace import step_like, write_trace

from memplan.cli import main
from memplan.planner.jobs.solve_file import load_problem, solve_file
from memplan.planner.plan import load_plan
from memplan.planner.report.solve_text import render_solve
from memplan.solvers import solve
from memplan.solvers.search import TIMEOUT, search_fit
from memplan.traces.format import load

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # they time solves against an idle machine: run alone


def test_capacity_mode_leaves_cpsat_its_share(shared):
    """capacity_21 (62 buffers, max live 21): the search cannot decide it, CP-SAT can; both get a share."""
    plan = solve(load_problem(str(shared / "benchmarks/regressions/capacity_21.csv")), capacity=21, time_limit=10)
    assert plan.arena <= 21 and plan.capacity == 21


def test_search_answer_does_not_depend_on_thread_timing(shared):
    """Three threads race; the winner is the one with the fewest steps, so repeated runs agree exactly."""
    problem = load_problem(str(shared / "benchmarks/minimalloc/D.1048576.csv"))
    results = [search_fit(problem, 1_061_888, 10**9, 60.0) for _ in range(3)]
    assert results[0].status == "fits"
    for other in results[1:]:
        assert other.status == results[0].status and other.work == results[0].work
        assert np.array_equal(other.offsets, results[0].offsets)


def test_out_of_work_is_a_timeout_not_a_proof(shared):
    problem = load_problem(str(shared / "benchmarks/minimalloc/D.1048576.csv"))
    result = search_fit(problem, 986_112, 1000, 60.0)
    assert result.status == TIMEOUT and result.offsets is None


def test_same_arena_with_a_cpu_burning_process_alongside(shared):
    """The acceptance check of issue 16: the same instance and time limit, the machine idle and then busy."""
    problem = load_problem(str(shared / "benchmarks/minimalloc/D.1048576.csv"))
    idle = solve(problem, time_limit=4.0)
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy = solve(problem, time_limit=4.0)
    finally:
        burner.kill()
        burner.wait()
    assert (busy.arena, busy.bound, busy.solver) == (idle.arena, idle.bound, idle.solver)
    assert busy.offsets == idle.offsets


def test_json_names_the_bound_source(shared, tmp_path):
    report = solve_file(str(shared / "benchmarks/minimalloc/A.1048576.csv"), time_limit=5.0)
    summary = report.summary()
    assert summary["bound_source"] and json.dumps(summary)
    assert f"({summary['bound_source']})" in render_solve(summary)


@pytest.mark.parametrize("name, target", [("D", 1_025_024), ("J", 1_035_264)])
def test_descent_reaches_the_issue_targets_on_the_hardest_instances(shared, name, target):
    """Issue 16's targets at --time-limit 10: the best arenas an 80 s solve had found before the descent."""
    problem = load_problem(str(shared / f"benchmarks/minimalloc/{name}.1048576.csv"))
    plan = solve(problem, time_limit=10)
    assert plan.arena <= target and plan.solver == "search"


def test_a_million_buffers_within_ten_seconds_at_time_limit_5(tmp_path):
    """Issue 31's acceptance: `memplan solve --time-limit 5` of a generated million-buffer trace returns within
    10 s, reading, solving, verifying and writing included, and its plan passes the verifier against the trace.
    No greedy placement can finish in the work 5 s buy, so the sweep places every buffer."""
    trace_path, plan_path = tmp_path / "million.trace.json", tmp_path / "million.plan.json"
    write_trace(trace_path, step_like(1_000_000))
    start = time.monotonic()
    result = CliRunner().invoke(main, ["solve", str(trace_path), "--time-limit", "5", "-o", str(plan_path), "--json"])
    wall = time.monotonic() - start
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert wall < 10 and summary["seconds"] < 5
    trace = load(trace_path)
    plan = load_plan(plan_path, trace)  # verified again, against the trace itself
    assert plan.buffers == len(trace) == 1_000_000 and plan.solver == "sweep"
    assert plan.bound_source == "max-live" and plan.arena < 1.2 * plan.bound  # the sweep: 1.13x here


MAIN_JOB_TRACES = ("tempo", "tempo+selective", "tempo+full")


@pytest.mark.parametrize("mode", MAIN_JOB_TRACES)
def test_main_job_traces_reach_their_bound_at_time_limit_10(mode):
    """Issue 31 item 5: the main job's own traces (`bash scripts/run.sh`: BERT-Large's 2-layer slice, batch 2,
    sequence 512, traced 2026-11-26) are placed at max-live at the default --time-limit, as they were before the
    work budget became deterministic; the greedy plans end 0.009-0.73% above it and only the search at the
    bound itself finds a placement there."""
    plan = solve(load_problem(f"tests/data/main-job/bert_large_slice.b2s512.{mode}.trace.json.gz"), time_limit=10)
    assert plan.status == "optimal" and plan.bound_source == "max-live" and plan.solver == "search"
