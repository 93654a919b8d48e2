"""memplan fit: its batch fits and one more does not, checked here by direct traces; the boundary search
takes a logarithmic number of traces and gives the answer of stepping batch by batch; sizes; bad inputs."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import memplan.planner.jobs.fit as fit_job
from memplan.cli import main
from memplan.planner.jobs.fit import MAX_BATCH, FitError, Point, fit_model
from memplan.planner.problem import problem_from_trace
from memplan.planner.report.fit_table import render_fit
from memplan.planner.simulate.caching_allocator import simulate_caching
from memplan.solvers import CapacityError, solve
from memplan.solvers.bounds import lower_bound
from memplan.step import StepSpec
from memplan.traces.capture import capture_step
from memplan.traces.inputs.model_file import load_workload

MODEL = str(Path(__file__).resolve().parents[1] / "examples" / "bert.py")
GPT2 = str(Path(__file__).resolve().parents[1] / "examples" / "gpt2.py")
SEQ = 32
MEMORY = 24 << 20


@pytest.fixture(autouse=True)
def tiny_preset(monkeypatch):
    monkeypatch.setenv("MEMPLAN_PRESET", "tiny")


def direct_trace(batch, mode):
    return capture_step(lambda: load_workload(StepSpec(MODEL, batch=batch, seq=SEQ, mode=mode)))


def plan_fits(trace, memory):
    """A plan within `memory` exists (found), or provably not (lower bound above, or the solver's proof)."""
    problem = problem_from_trace(trace)
    if lower_bound(problem) > memory:
        return False
    try:
        solve(problem, time_limit=5.0, capacity=memory)
    except CapacityError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["baseline", "tempo+selective"])
def test_fit_agrees_with_direct_traces(mode):
    result = fit_model(StepSpec(MODEL, seq=SEQ), MEMORY, modes=(mode,), time_limit=2.0)
    (fit,) = result.modes
    b = fit.batch["caching"]
    assert b >= 4  # more than the measured sizes: the prediction and boundary search did work
    assert simulate_caching(direct_trace(b, mode), capacity=MEMORY).oom is None
    assert simulate_caching(direct_trace(b + 1, mode), capacity=MEMORY).oom is not None
    p = fit.batch["plan"]
    assert p >= b  # a plan never needs more than the caching allocator reserves
    assert plan_fits(direct_trace(p, mode), MEMORY)
    assert not plan_fits(direct_trace(p + 1, mode), MEMORY)
    summary = result.summary()["modes"][0]
    assert summary["traces"] == fit.traces >= 5
    assert summary["plan"]["at_batch"] <= MEMORY < summary["plan"]["at_next"]
    # b+1 is out of reach for any plan: the bound is above the memory, or the solver proved it
    assert summary["plan"]["next_proven"] is True


TINY_MODEL = """
import torch
from torch import nn

def build(batch_size, seq_len, dtype, device):
    model = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 64)).to(device=device, dtype=dtype)
    ids = torch.randint(0, 64, (batch_size, seq_len), device=device)
    return {"model": model, "inputs": ids, "loss": lambda out, _: out.float().mean()}
"""


def test_memory_beyond_the_largest_batch_is_an_answer_at_least_that_batch(tmp_path):
    """A tiny model on an H200 fits any batch the search traces: `at least 4096` is the answer (exit 0), flagged as
    a lower bound in the text and in --json, with no figure at b+1 (never traced)."""
    model = tmp_path / "tiny.py"
    model.write_text(TINY_MODEL)
    result = CliRunner().invoke(
        main, ["fit", str(model), "--gpu", "H200", "--layers", "as-built", "--seq", "8", "--json"]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    text = render_fit(summary)  # what the command prints without --json
    assert f">={MAX_BATCH}" in text and f"{MAX_BATCH} is a lower bound" in text
    (mode,) = summary["modes"]
    for allocator in ("caching", "plan"):
        assert mode[allocator]["batch"] == MAX_BATCH and mode[allocator]["at_least"] is True
        assert mode[allocator]["at_next"] is None and mode[allocator]["at_batch"] > 0
    assert MAX_BATCH + 1 not in {p["batch"] for p in mode["points"]}


def test_a_real_trace_too_large_for_this_machine_is_refused(monkeypatch):
    import memplan.planner.jobs.fit

    monkeypatch.setattr(memplan.planner.jobs.fit, "host_memory_available", lambda: 64 << 20)
    with pytest.raises(FitError, match=r"tracing batch \d+ would need about .* memory.*: use --capture fake"):
        fit_model(StepSpec(MODEL, seq=SEQ), 1 << 40, modes=("baseline",), time_limit=1.0, capture="real")


def test_auto_capture_is_fake_where_a_real_step_is_slow_or_does_not_fit(monkeypatch):
    import memplan.traces.inputs.trace_model
    from memplan.traces.inputs.trace_model import choose_capture

    monkeypatch.setattr(memplan.traces.inputs.trace_model, "host_memory_available", lambda: 20 << 30)
    assert not choose_capture("auto", 1 << 30).fake and choose_capture("auto", 3 << 30).fake
    monkeypatch.setattr(memplan.traces.inputs.trace_model, "host_memory_available", lambda: 1 << 30)
    assert choose_capture("auto", 1 << 30).fake  # more than 70% of the RAM available
    assert not choose_capture("real", 1 << 40).fake and choose_capture("fake", 1).fake


@pytest.mark.slow
def test_fake_traces_give_the_real_traces_answer():
    """Fake tensors hold what real ones do: the same batch under both allocator models, and JSON says fake."""
    real = fit_model(StepSpec(MODEL, seq=SEQ), MEMORY, modes=("tempo",), time_limit=2.0, capture="real")
    res = CliRunner().invoke(
        main,
        [
            "fit",
            MODEL,
            "--memory",
            str(MEMORY),
            "--seq",
            str(SEQ),
            "--layers",
            "tempo",
            "--time-limit",
            "2",
            "--capture",
            "fake",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert real.capture.name == "real" and doc["capture"] == "fake" and doc["capture_reason"] == "--capture fake"
    assert doc["modes"][0]["caching"]["batch"] == real.modes[0].batch["caching"]
    assert doc["modes"][0]["plan"]["batch"] == real.modes[0].batch["plan"]


@pytest.mark.slow  # 3-10 s: out of the fast lane, which stays under 3 minutes
def test_cli_json():
    res = CliRunner().invoke(
        main, ["fit", MODEL, "--memory", "16MiB", "--seq", str(SEQ), "--layers", "tempo", "--time-limit", "1", "--json"]
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["memory"] == 16 << 20 and [m["mode"] for m in doc["modes"]] == ["tempo"]
    tempo = doc["modes"][0]
    assert tempo["caching"]["batch"] >= 1 and tempo["plan"]["batch"] >= tempo["caching"]["batch"]


@pytest.mark.parametrize(
    "args,words",
    [
        (["--memory", "11 parsecs"], "not a size"),
        (["--memory", "0"], "must be positive"),
        (["--memory", "1GiB", "--layers", "sparse"], "unknown mode"),
        (["--memory", "1GiB", "--alloc-conf", "max_split_size_mb:x"], "max_split_size_mb"),
    ],
)
def test_cli_bad_inputs(args, words):
    modes = [] if "--layers" in args else ["--layers", "baseline"]
    res = CliRunner().invoke(main, ["fit", MODEL, "--seq", str(SEQ), *modes, *args])
    assert res.exit_code != 0
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and words in errors[0] and res.output.rstrip().endswith(errors[0])


def test_a_mode_that_fits_no_batch_is_a_row_of_the_answer():
    """A mode whose batch 1 does not fit is reported with batch 0 and batch 1's figures; the others still run."""
    args = ["fit", MODEL, "--seq", str(SEQ), "--memory", "1MiB", "--layers", "baseline", "--time-limit", "1"]
    res = CliRunner().invoke(main, [*args, "--json"])
    assert res.exit_code == 0, res.output
    (mode,) = json.loads(res.stdout)["modes"]
    assert mode["caching"]["batch"] == mode["plan"]["batch"] == 0 and mode["traces"] == 1
    assert mode["caching"]["at_batch"] is None and mode["caching"]["at_next"] > 1 << 20
    text = CliRunner().invoke(main, ["fit", MODEL, "--seq", str(SEQ), "--memory", "1MiB", "--layers", "baseline"])
    assert "! baseline: no batch fits" in text.output


def test_cli_missing_model_file(tmp_path):
    res = CliRunner().invoke(main, ["fit", str(tmp_path / "nope.py"), "--memory", "1GiB", "--layers", "baseline"])
    assert res.exit_code != 0
    assert res.output.strip().splitlines()[-1].startswith("Error:") and "no such model file" in res.output


# --- the boundary search: secant guesses and bisection between a batch that fits and one that does not ---

BISECT_MEMORY = 1 << 20


def synthetic(caching_limit: int, quadratic_plan: bool):
    """A step whose caching reserved peak grows linearly, predicting about 29, while the OOM retry lets
    batches up to `caching_limit` fit; and whose plan arena is affine (predicted right, 180) or quadratic
    (predicted 143 where 50 fit): predictions off by tens or hundreds of batches."""

    memory = BISECT_MEMORY

    def point(batch: int) -> Point:
        reserved = memory // 10 + batch * (memory // 33)
        arena = memory // 10 + batch * (memory // 200) + quadratic_plan * batch * batch * (memory // 4000)
        return Point(batch, reserved, batch <= caching_limit, arena, arena, arena <= memory, arena > memory)

    return point


def stepping(point, allocator: str) -> int:
    """The answer by exhaustive stepping: the last batch before the first that does not fit."""
    b = 1
    while b < MAX_BATCH and point(b + 1).fits(allocator):
        b += 1
    return b


# (caching answer, plan quadratic, most traces allowed); the search stepping batch by batch took 27, 35, 176, 976
BISECT_CASES = [(8, False, 12), (57, False, 20), (200, True, 32), (1000, False, 40)]


@pytest.mark.parametrize("caching_limit,quadratic_plan,most", BISECT_CASES)
def test_fit_bisects_between_a_fitting_and_a_failing_batch(monkeypatch, caching_limit, quadratic_plan, most):
    """`memplan fit` narrows the bracket by secant guesses and bisection: the traces it takes grow as the
    logarithm of the answer, not linearly, when the affine prediction is off by many batches, and the answer
    is the one stepping batch by batch gives."""
    point = synthetic(caching_limit, quadratic_plan)
    traced: list[int] = []

    def measure(self, batch):
        traced.append(batch)
        return point(batch)

    monkeypatch.setattr(fit_job.BatchProbe, "_measure", measure)
    (mode,) = fit_model(StepSpec("unused.py"), BISECT_MEMORY, modes=("baseline",), capture="real").modes
    assert mode.batch == {"caching": stepping(point, "caching"), "plan": stepping(point, "plan")}
    assert abs(mode.predicted["caching"] - caching_limit) >= 20  # the prediction is off by many batches
    assert len(traced) == len(set(traced)) == mode.traces <= most, traced
    for allocator in ("caching", "plan"):  # b fits and b+1 does not, each by its own trace
        b = mode.batch[allocator]
        assert mode.points[b].fits(allocator) and not mode.points[b + 1].fits(allocator)


def test_fit_answers_the_batches_that_run_when_fragmentation_fails_a_smaller_one(monkeypatch):
    """Fragmentation makes "fits" non-monotone in the batch (batch 1 runs out, larger batches fit): fit gives the
    boundary above the batches that run and names the traced ones below it that do not, never 0."""
    memory = BISECT_MEMORY
    plan_point = synthetic(1000, False)

    def point(batch: int) -> Point:
        p = plan_point(batch)
        return Point(batch, p.caching_peak_reserved, batch not in (1, 2) and batch <= 40, p.plan_arena, p.bound,
                     p.plan_fits, p.plan_miss_proven)  # fmt: skip

    monkeypatch.setattr(fit_job.BatchProbe, "_measure", lambda self, batch: point(batch))
    (mode,) = fit_model(StepSpec("unused.py"), memory, modes=("baseline",), capture="real").modes
    assert mode.batch["caching"] == 40 and mode.points[40].caching_fits and not mode.points[41].caching_fits
    assert mode.runs_out_below("caching") == [1, 2] and mode.runs_out_below("plan") == []


@pytest.mark.slow
def test_fit_of_gpt2_gives_the_answer_of_stepping_batch_by_batch(monkeypatch):
    monkeypatch.delenv("MEMPLAN_PRESET", raising=False)  # tiny
    traced: list[int] = []
    trace = fit_job.trace_step

    def counted(step, **options):
        traced.append(step.batch)
        return trace(step, **options)

    monkeypatch.setattr(fit_job, "trace_step", counted)
    memory, seq = 8 << 20, 16
    (mode,) = fit_model(StepSpec(GPT2, seq=seq), memory, modes=("baseline",), time_limit=2.0).modes
    assert len(traced) == mode.traces <= 14, traced
    every = fit_job.BatchProbe(
        StepSpec(GPT2, seq=seq, mode="baseline"), memory, alloc_conf="", time_limit=2.0, progress=lambda _: None
    )
    for allocator in ("caching", "plan"):
        assert mode.batch[allocator] == stepping(every, allocator) >= 4
