"""`memplan tradeoff`: every layer mode and compile budget measured, the frontiers marked, the figure drawn."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from matplotlib.image import imread

from memplan.cli import main
from memplan.modes import SWEPT_MODES as MODES  # what run and tradeoff sweep
from memplan.planner.jobs.tradeoff import (
    WARMUP_ROUNDS,
    TradeoffOptions,
    TradeoffPoint,
    action_configurations,
    mark_alike,
    mark_frontiers,
)
from memplan.planner.report.tradeoff_table import render_tradeoff
from memplan.step import StepSpec

MODEL = (
    Path(__file__).resolve().parents[1] / "examples" / "llama.py"
)  # the compile tests' model: Inductor's cache is shared


@pytest.fixture(scope="module")
def summary(tmp_path_factory):
    figure = tmp_path_factory.mktemp("tradeoff") / "tradeoff.png"
    args = ["tradeoff", str(MODEL), "--seq", "64", "--budgets", "1,0", "--repeats", "2", "-o", str(figure), "--json"]
    args += ["--no-actions"]  # the actions have their own test
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.slow
def test_json_carries_every_point(summary):
    names = [p["name"] for p in summary["points"]]
    assert names == [*MODES, "compile@1", "compile@0"]
    for p in summary["points"]:
        assert p["plan_arena"] >= p["peak_live"] > 0 and p["caching_peak_reserved"] >= p["peak_live"]
        assert p["flops"] == p["matmul_flops"] + p["elementwise_flops"] > 0
        assert p["step_seconds"] > 0 and p["time_ratio"] > 0
    by_name = {p["name"]: p for p in summary["points"]}
    assert by_name["as-built"]["extra_flops"] == 0 and by_name["as-built"]["time_ratio"] == 1.0
    assert by_name["full"]["extra_flops"] > by_name["tempo"]["extra_flops"] > 0  # full recomputes the most
    assert not by_name["selective"]["changed"] and by_name["selective"]["extra_flops"] == 0  # SDPA keeps no s x s
    assert by_name["full"]["plan_arena"] < by_name["as-built"]["plan_arena"]
    assert by_name["compile@0"]["extra_flops"] > by_name["compile@1"]["extra_flops"]  # budget 0 recomputes more
    assert any(p["pareto_flops"] for p in summary["points"]) and any(p["pareto_time"] for p in summary["points"])


@pytest.mark.slow
def test_figure_is_written_readable_and_not_blank(summary):
    image = imread(summary["figure"])
    assert image.shape[0] > 300 and image.shape[1] > 600
    ink = (image[..., :3] < 0.9).any(axis=-1)
    assert 0.01 < ink.mean() < 0.5  # drawn on, not filled
    assert len(np.unique(image[..., :3].reshape(-1, 3), axis=0)) > 20  # points, lines and text, not one colour


@pytest.mark.slow
def test_a_variant_model_file_is_measured_next_to_the_modes():
    """The reversible GPT-2 as a variant of GPT-2: its point is named by its file, counts its rebuild as extra
    compute and needs less memory than GPT-2 as built."""
    examples = MODEL.parent
    args = ["tradeoff", str(examples / "gpt2.py"), "--seq", "64", "--budgets", "", "--repeats", "1", "--json"]
    args += ["--no-actions"]
    result = CliRunner().invoke(main, [*args, "--variant", str(examples / "gpt2_reversible.py")])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    by_name = {p["name"]: p for p in summary["points"]}
    assert list(by_name) == [*MODES, "gpt2_reversible"]
    reversible, built = by_name["gpt2_reversible"], by_name["as-built"]
    assert reversible["variant"].endswith("gpt2_reversible.py") and reversible["changed"]
    assert reversible["extra_flops"] > 0 and reversible["plan_arena"] < built["plan_arena"]


def point(name, arena, extra, seconds=None):
    figures = dict(buffers=1, peak_live=arena, caching_peak_reserved=arena, caching_peak_allocated=arena,
                   plan_arena=arena, bound=arena, status="optimal", gap=0.0, solver="greedy")  # fmt: skip
    return TradeoffPoint(name, name, None, True, **figures, matmul_flops=0, elementwise_flops=0, flops=0,
                         extra_flops=extra, step_seconds=seconds, time_ratio=None)  # fmt: skip


def test_frontier_marks_exactly_the_undominated():
    points = [point("a", 10, 0, 1.0), point("b", 8, 5, 2.0), point("c", 9, 6, 1.5), point("d", 8, 7, 3.0)]
    mark_frontiers(points)
    assert [p.pareto_flops for p in points] == [True, True, False, False]  # c: b has less of both; d: b is cheaper
    assert [p.pareto_time for p in points] == [True, True, True, False]


LOGGED_MODEL = """
import uuid
from pathlib import Path

import torch
from torch import nn

LOG = Path(__file__).with_name("steps.log")


def build(batch_size, seq_len, dtype, device):
    tag = uuid.uuid4().hex  # this build's workload; its loss logs the tag once per training step
    with LOG.open("a") as f:
        f.write(f"build {tag}\\n")

    def loss(output, inputs):
        with LOG.open("a") as f:
            f.write(f"step {tag}\\n")
        return output.float().pow(2).mean()

    model = nn.Sequential(nn.Linear(seq_len, 64), nn.GELU(), nn.Linear(64, seq_len))
    return {"model": model, "inputs": torch.randn(batch_size, seq_len), "loss": loss}
"""


def test_every_configuration_is_timed_in_interleaved_rounds_with_its_spread(tmp_path):
    """The configurations' workloads are built, then their steps run one of each in turn (warm-up rounds, then the
    timed ones), as the model file's own log of its steps shows; each point keeps its runs, their range and its
    ratio to the model as built round by round, and the text shows the range and which points cannot be told apart."""
    model = tmp_path / "logged.py"
    model.write_text(LOGGED_MODEL)
    repeats = 3
    args = ["tradeoff", str(model), "--seq", "16", "--budgets", "", "--repeats", str(repeats), "--json", "--no-actions"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.stderr
    log = [line.split() for line in (tmp_path / "steps.log").read_text().splitlines()]
    builds = [tag for what, tag in log if what == "build"]
    timed = builds[-len(MODES) :]  # the last builds are the timed workloads, one per configuration, in order
    last_build = max(i for i, (what, _) in enumerate(log) if what == "build")
    steps = [tag for what, tag in log[last_build + 1 :]]
    assert steps == timed * (WARMUP_ROUNDS + repeats)  # round after round, one step of each in turn
    summary = json.loads(result.stdout)
    assert summary["timing"] == "interleaved" and summary["repeats"] == repeats

    points = summary["points"]
    reference = points[0]
    for p in points:
        runs = p["step_runs"]
        assert len(runs) == repeats and p["step_seconds"] == statistics.median(runs)
        assert p["step_seconds_low"] == min(runs) <= p["step_seconds"] <= max(runs) == p["step_seconds_high"]
        ratios = [run / ref for run, ref in zip(runs, reference["step_runs"])]  # run i of each ran in round i
        assert (p["time_ratio_low"], p["time_ratio"], p["time_ratio_high"]) == (
            min(ratios),
            statistics.median(ratios),
            max(ratios),
        )
    assert (reference["time_ratio_low"], reference["time_ratio"], reference["time_ratio_high"]) == (1.0, 1.0, 1.0)
    text = render_tradeoff(summary)
    ref_row = next(line for line in text.splitlines() if line.startswith("as-built"))
    assert "1.00x [1.00-1.00]" in ref_row
    assert f"median of {repeats} rounds timed interleaved" in text
    for p in points:
        if p["time_like"]:
            assert f"  {p['name']} ~ {', '.join(p['time_like'])}" in text


def test_points_whose_ratio_ranges_overlap_are_alike():
    points = [point(n, 10, 0, 1.0) for n in "abcd"]
    for p, (low, high) in zip(points, [(1.0, 1.0), (0.9, 1.1), (1.05, 1.3), (1.4, 1.5)]):
        p.time_ratio_low, p.time_ratio_high = low, high
    mark_alike(points)
    assert [p.time_like for p in points] == [["b"], ["a", "c"], ["b"], []]


def test_configurations_that_do_not_fit_together_are_timed_one_after_another(tmp_path, monkeypatch):
    """When every workload held at once would not fit the RAM available, each is timed alone (the log shows each
    build's steps in a row), the ratio's range is its fastest over the reference's slowest and back, and a note
    says so."""
    import memplan.planner.jobs.tradeoff as job

    monkeypatch.setattr(job, "host_memory_available", lambda: 1)  # a machine with one byte free
    model = tmp_path / "logged.py"
    model.write_text(LOGGED_MODEL)
    options = job.TradeoffOptions(StepSpec(str(model), batch=2, seq=16), budgets=(), repeats=2, actions=False)
    result = job.tradeoff(options)
    log = [line.split() for line in (tmp_path / "steps.log").read_text().splitlines()]
    builds = [i for i, (what, _) in enumerate(log) if what == "build"][-len(MODES) :]
    for start in builds:  # each timed workload is built, then runs all its steps before the next is built
        tag = log[start][1]
        assert [t for _, t in log[start + 1 : start + 1 + WARMUP_ROUNDS + 2]] == [tag] * (WARMUP_ROUNDS + 2)
    summary = result.summary()
    assert summary["timing"] == "one after another" and "not interleaved" in " ".join(summary["notes"])
    reference = summary["points"][0]
    for p in summary["points"]:
        assert p["time_ratio_low"] == p["step_seconds_low"] / reference["step_seconds_high"]
        assert p["time_ratio_high"] == p["step_seconds_high"] / reference["step_seconds_low"]


@pytest.mark.slow
def test_each_action_is_a_point_with_its_memory_compute_and_link_time():
    """Issue 34 item 4: the fused loss, each optimizer choice and the offload modes are points of their own beside
    the modes (fake traces: no step times), offload with its host-link time; an action that cannot apply is a note."""
    bandwidth = 25 * 10**9
    args = ["tradeoff", str(MODEL), "--seq", "64", "--budgets", "", "--capture", "fake", "--json"]
    result = CliRunner().invoke(main, [*args, "--host-bandwidth", "25GB/s"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    by_name = {p["name"]: p for p in summary["points"]}
    actions = ["loss fused", "optimizer adamw-8bit", "optimizer adamw-4bit", "optimizer adamw-host"]
    offloading = ["offload", "tempo+offload", "selective+offload"]
    assert list(by_name) == [*MODES, *actions, *offloading]
    built = by_name["as-built"]
    for name in actions + offloading:
        assert by_name[name]["changed"] and by_name[name]["action"] == name.split()[0].split("+")[-1]
    assert by_name["optimizer adamw-4bit"]["peak_live"] < by_name["optimizer adamw-8bit"]["peak_live"]
    assert by_name["optimizer adamw-8bit"]["peak_live"] < built["peak_live"]
    for name in offloading:
        point = by_name[name]
        assert point["host_moved"] > 0 and point["transfer_seconds"] == 2 * point["host_moved"] / bandwidth
    assert by_name["tempo+offload"]["host_moved"] < by_name["offload"]["host_moved"]
    assert all(by_name[n]["transfer_seconds"] is None for n in [*MODES, *actions])
    text = render_tradeoff(summary)
    assert "host link" in text and next(line for line in text.splitlines() if line.startswith("offload "))
    # without a link, offload is left out and a note says why (the choice the command above made with one: the
    # same function, not 11 more traces)
    configs, notes = action_configurations(TradeoffOptions(StepSpec(str(MODEL), seq=64), budgets=()), fake=True)
    assert [c.name for c in configs] == actions
    assert any("give --host-bandwidth" in note for note in notes)
