"""`memplan simulate`: summary figures against independent counts, the timeline CSV, the plan check, bad input."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from click.testing import CliRunner
from step_traces import step_trace

from memplan.cli import main
from memplan.planner.plan import Plan, save_plan
from memplan.planner.problem import problem_from_trace
from memplan.planner.simulate.alloc_conf import parse_alloc_conf
from memplan.planner.simulate.caching_allocator import simulate_caching
from memplan.traces import save
from memplan.traces.format import trace_digest

SUMMARY_KEYS = {
    "trace",
    "buffers",
    "events",
    "peak_live",
    "peak_live_time",
    "peak_live_phase",
    "bound",
    "plan",
    "caching",
    "timeline",
    "verdict",
    "repeated",
    "unrecorded",
}
CACHING_KEYS = {
    "alloc_conf",
    "tie_break",
    "capacity",
    "peak_allocated",
    "peak_reserved",
    "fragmentation_at_peak",
    "segment_allocs",
    "oom",
}


def side_by_side_plan(trace) -> Plan:
    """A valid plan that never reuses bytes: every buffer after the previous one (arena = sum of sizes)."""
    problem = problem_from_trace(trace)
    offsets = np.concatenate(([0], np.cumsum(problem.size)[:-1])).tolist()
    arena = int(problem.size.sum())
    bound = problem.max_live()
    return Plan(
        digest=trace_digest(trace),
        alignment=512,
        offsets=[int(o) for o in offsets],
        arena=arena,
        bound=bound,
        status="feasible",
        gap=arena / bound - 1,
        solver="side-by-side",
        seconds=0.0,
    )


@pytest.fixture
def files(tmp_path):
    a = step_trace(layers=5, seed=0)
    b = step_trace(layers=5, seed=1)
    save(a, tmp_path / "a.json")
    save(b, tmp_path / "b.json.gz")
    save_plan(side_by_side_plan(a), problem_from_trace(a), tmp_path / "a.plan.json")
    save_plan(side_by_side_plan(b), problem_from_trace(b), tmp_path / "b.plan.json")
    return tmp_path, a, b


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def brute_max_live(trace, align=512) -> int:
    """Most aligned bytes live at once, one logical time at a time."""
    sizes = [-(-int(s) // align) * align for s in trace.size]
    return max(sum(s for s, a, f in zip(sizes, trace.alloc, trace.free) if a <= t < f) for t in range(trace.end))


def test_json_summary_keys_and_figures(files):
    tmp, a, _ = files
    r = run("simulate", tmp / "a.json", "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert set(s) == SUMMARY_KEYS and set(s["caching"]) == CACHING_KEYS
    assert s["plan"] is None and s["caching"]["oom"] is None and s["unrecorded"] is None
    live = [sum(int(z) for z, al, fr in zip(a.size, a.alloc, a.free) if al <= t < fr) for t in range(a.end)]
    assert s["peak_live"] == max(live) and s["peak_live_time"] == live.index(max(live))
    assert s["bound"] == brute_max_live(a)
    sim = simulate_caching(a)
    assert s["caching"]["peak_reserved"] == sim.peak_reserved
    assert s["caching"]["peak_allocated"] == sim.peak_allocated
    assert s["caching"]["segment_allocs"] == sim.segment_allocs > 0
    assert s["caching"]["peak_reserved"] >= s["caching"]["peak_allocated"] >= s["peak_live"]


def test_tie_break_reaches_the_simulator(files):
    tmp, a, _ = files
    for tie in ("lowest_address", "oldest_segment"):
        r = run("simulate", tmp / "a.json", "--tie-break", tie, "--json")
        assert r.exit_code == 0, r.output
        s = json.loads(r.stdout)
        assert s["caching"]["tie_break"] == tie
        sim = simulate_caching(a, parse_alloc_conf("", tie))
        assert (s["caching"]["peak_reserved"], s["caching"]["segment_allocs"]) == (
            sim.peak_reserved,
            sim.segment_allocs,
        )
    r = run("simulate", tmp / "a.json", "--tie-break", "newest")
    assert r.exit_code == 2 and "Error:" in r.output


def test_plan_arena_and_timeline_csv(files):
    tmp, a, _ = files
    r = run("simulate", tmp / "a.json", "--plan", tmp / "a.plan.json", "--timeline", tmp / "t.csv", "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    arena = int(problem_from_trace(a).size.sum())
    assert s["plan"]["arena"] == arena and s["plan"]["status"] == "feasible"
    assert s["plan"]["peak_in_use"] == s["bound"]
    assert s["timeline"] == str(tmp / "t.csv")
    rows = list(csv.DictReader(open(tmp / "t.csv")))
    assert len(rows) == a.end
    assert [int(r["live"]) for r in rows] == a.live_bytes().tolist()
    assert [int(r["time"]) for r in rows] == list(range(a.end))
    assert all(int(r["reserved"]) >= int(r["allocated"]) for r in rows)
    assert all(int(r["plan_arena"]) == arena >= int(r["plan_in_use"]) for r in rows)
    assert {r["phase"] for r in rows} == {"other", "forward", "backward", "optimizer"}


def test_text_summary_names_every_figure(files):
    tmp, _, _ = files
    r = run("simulate", tmp / "a.json", "--plan", tmp / "a.plan.json")
    assert r.exit_code == 0, r.output
    for label in (
        "max-live bound",
        "plan arena",
        "peak allocated",
        "peak reserved",
        "fragmentation",
        "segment allocs",
        "out of memory    no",
    ):
        assert label in r.stdout


def test_capacity_reports_where_memory_ran_out(files):
    tmp, a, _ = files
    capacity = a.peak()[0] // 2
    r = run("simulate", tmp / "a.json", "--capacity", capacity, "--json")
    assert r.exit_code == 0, r.output
    oom = json.loads(r.stdout)["caching"]["oom"]
    assert oom is not None and 0 <= oom["time"] < a.end and oom["size"] == int(a.size[oom["buffer"]])
    assert "YES at event" in run("simulate", tmp / "a.json", "--capacity", capacity).stdout
    r = run("simulate", tmp / "a.json", "--plan", tmp / "a.plan.json", "--capacity", capacity, "--json")
    assert json.loads(r.stdout)["plan"]["fits_capacity"] is False


@pytest.mark.parametrize(
    "args, message",
    [
        (["simulate", "{tmp}/missing.json"], "missing.json: no such file"),
        (
            ["simulate", "{tmp}/a.json", "--plan", "{tmp}/b.plan.json", "--timeline", "{tmp}/t.csv"],
            "b.plan.json: plan was made for another trace",
        ),
        (["simulate", "{tmp}/a.json", "--plan", "{tmp}/missing.plan.json"], "missing.plan.json: no such file"),
        (["simulate", "{tmp}/a.json", "--alloc-conf", "max_split_size_mb:lots"], "max_split_size_mb"),
        (["plot", "{tmp}/a.json", "-o", "{tmp}/t.jpg"], "t.jpg: the figure must end in .png or .svg"),
        (
            ["plot", "{tmp}/a.json", "--plan", "{tmp}/b.plan.json", "-o", "{tmp}/t.png"],
            "b.plan.json: plan was made for none of the given traces",
        ),
        (["plot", "{tmp}/a.json", "--address-space", "-o", "{tmp}/t.png"], "--address-space needs a plan"),
        (["compare", "{tmp}/a.json", "{tmp}/missing.json"], "missing.json: no such file"),
        (["compare", "{tmp}/a.json", "--plan", "{tmp}/b.plan.json"], "plan was made for none of the given traces"),
    ],
)
def test_bad_input_gives_one_line_and_no_file(files, args, message):
    tmp, _, _ = files
    r = run(*[a.format(tmp=tmp) for a in args])
    assert r.exit_code == 1
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0] and r.stderr.endswith(errors[0] + "\n")
    assert not (tmp / "t.csv").exists() and not (tmp / "t.png").exists() and not (tmp / "t.jpg").exists()


def test_tampered_plan_is_refused(files):
    tmp, _, _ = files
    doc = json.loads((tmp / "a.plan.json").read_text())
    doc["offsets"][1] = doc["offsets"][0]  # buffers 0 and 1 now share bytes while both are live
    (tmp / "bad.plan.json").write_text(json.dumps(doc))
    r = run("simulate", tmp / "a.json", "--plan", tmp / "bad.plan.json")
    assert r.exit_code == 1 and "bad.plan.json: invalid for" in r.stderr and "share bytes" in r.stderr
