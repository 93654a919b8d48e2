"""A recorded step repeated as a loop runs it (planner/simulate/repeat.py): the caching allocator simulated in the
state the program reaches its step in."""

from __future__ import annotations

import pytest

from memplan.planner.simulate.caching_allocator import simulate_caching
from memplan.planner.simulate.repeat import RepeatError, last_step_peaks, repeated
from memplan.traces.format import make_trace


def replacing_step():
    """A step that frees the 100-byte state alive at its start and makes a new one it keeps (as the course's
    AdamW replaces its moments), with a 50-byte temporary; a 10-byte parameter lives throughout."""
    return make_trace(
        {
            "size": [10, 100, 50, 100],
            "alloc": [0, 0, 1, 2],
            "free": [5, 3, 4, 5],
            "category": ["parameter", "optimizer", "temporary", "optimizer"],
        }
    )


def test_each_copy_frees_what_the_one_before_kept():
    trace = repeated(replacing_step(), 3)
    assert len(trace) == 1 + 1 + 3 * 2  # parameter and first state once; temporary and new state per step
    assert trace.end == 3 * 4 + 1
    live = trace.live_bytes()
    assert live.max() == 10 + 100 + 50 + 100  # every step's peak: both states and the temporary
    assert live[-1] == 10 + 100  # the end: the parameter and the last state, as at the start
    # copy k's new state (made at 2 + 4k) dies at 3 + 4(k + 1), where copy k + 1 frees its predecessor
    states = sorted((int(a), int(f)) for a, f, s in zip(trace.alloc, trace.free, trace.size) if s == 100)
    assert states == [(0, 3), (2, 7), (6, 11), (10, 13)]


def test_one_copy_is_the_step_itself():
    step = replacing_step()
    once = repeated(step, 1)
    assert once.live_bytes().tolist() == step.live_bytes().tolist()
    sim = simulate_caching(once)
    assert last_step_peaks(sim.reserved, sim.allocated, step, 1) == (sim.peak_reserved, sim.peak_allocated)


def test_a_first_step_cannot_be_repeated():
    """An optimizer's first step creates its state: the step keeps buffers no starting storage matches."""
    first = make_trace({"size": [10, 100], "alloc": [0, 2], "free": [4, 4]})
    with pytest.raises(RepeatError, match="not a steady step"):
        repeated(first, 2)


def test_simulate_steps_gives_the_last_runs_peaks_and_refuses_a_first_step(tmp_path):
    import json

    from click.testing import CliRunner

    from memplan.cli import main
    from memplan.traces.format import save

    steady, first = tmp_path / "steady.json", tmp_path / "first.json"
    save(replacing_step(), steady)
    save(make_trace({"size": [10, 100], "alloc": [0, 2], "free": [4, 4]}), first)
    result = CliRunner().invoke(main, ["simulate", str(steady), "--steps", "3", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["repeated"]["steps"] == 3 and doc["repeated"]["peak_reserved"] >= doc["caching"]["peak_allocated"]
    assert json.loads(CliRunner().invoke(main, ["simulate", str(steady), "--json"]).stdout)["repeated"] is None
    refused = CliRunner().invoke(main, ["simulate", str(first), "--steps", "2"])
    assert refused.exit_code == 1 and refused.output.strip().splitlines()[-1].startswith("Error: the step keeps")
