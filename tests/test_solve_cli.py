"""`memplan solve` end to end: traces and CSV in, verified plans out, --json, capacity failures."""

from __future__ import annotations

import json

from click.testing import CliRunner

from memplan.cli import main
from memplan.planner.minimalloc_csv import read_csv
from memplan.planner.plan import load_plan
from memplan.planner.problem import problem_from_trace
from memplan.planner.verify import verify_plan
from memplan.traces import make_trace
from memplan.traces.format import save, trace_digest

README = "id,lower,upper,size\nb1,0,3,4\nb2,3,9,4\nb3,0,9,4\nb4,9,21,4\nb5,0,21,4\n"


def run(*args):
    return CliRunner().invoke(main, list(args))


def test_solve_trace_writes_a_verified_plan(tmp_path):
    trace = make_trace({"size": [4000, 1000, 3000, 5000], "alloc": [0, 1, 2, 4], "free": [7, 3, 5, 6]})
    save(trace, tmp_path / "t.json.gz")
    res = run("solve", str(tmp_path / "t.json.gz"), "-o", str(tmp_path / "plan.json"), "--json")
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert {"buffers", "bound", "arena", "ratio", "status", "gap", "seconds", "solver"} <= set(summary)
    plan = load_plan(tmp_path / "plan.json", trace)
    assert plan.digest == trace_digest(trace) and plan.alignment == 512
    verify_plan(problem_from_trace(trace), plan.offsets, plan.arena)
    assert summary["arena"] == plan.arena == 4096 + 5120 + 3072 and summary["status"] == "optimal"


def test_solve_csv_to_csv_with_progress_and_text(tmp_path):
    src = tmp_path / "in.csv"
    src.write_text(README)
    res = run("solve", str(src), "-o", str(tmp_path / "out.csv"), "--method", "cpsat", "--time-limit", "5")
    assert res.exit_code == 0, res.output
    assert "arena/bound  1.0000" in res.stdout and "status       optimal" in res.stdout
    assert "bound 12 B" in res.stderr
    problem, offsets = read_csv(tmp_path / "out.csv")
    verify_plan(problem, offsets, 12)


def test_capacity_below_the_bound_is_one_line_and_nonzero(tmp_path):
    src = tmp_path / "in.csv"
    src.write_text(README)
    res = run("solve", str(src), "--capacity", "11")
    assert res.exit_code == 1
    assert (
        res.stderr.strip().splitlines()[-1] == "Error: cannot fit in 11 bytes: the lower bound is 12 bytes (max-live)"
    )
    assert run("solve", str(src), "--capacity", "12").exit_code == 0


def test_bad_input_is_one_line(tmp_path):
    res = run("solve", str(tmp_path / "missing.csv"))
    assert res.exit_code == 1 and res.stderr.count("\n") == 1 and "no such file" in res.stderr
