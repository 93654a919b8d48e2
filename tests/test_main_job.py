"""`memplan run`: the main job on a tiny model writes a report, two pictures and a verified plan per mode."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from memplan.cli import main
from memplan.modes import SWEPT_MODES as MODES  # what run and tradeoff sweep
from memplan.planner.jobs.run import RunOptions, RunResult
from memplan.planner.plan import load_plan
from memplan.planner.report.run_report import step_sentence
from memplan.step import StepSpec
from memplan.traces.format import load, to_dict
from memplan.traces.inputs.trace_model import CaptureChoice, as_built_patch, as_built_trace, trace_step


@pytest.mark.slow  # 3-10 s: out of the fast lane, which stays under 3 minutes
def test_run_writes_report_pictures_and_one_row_per_mode(tmp_path):
    out = tmp_path / "out"
    r = CliRunner().invoke(
        main,
        [
            "run",
            "examples/bert.py",
            "-o",
            str(out),
            "--seq",
            "64",
            "--batch",
            "2",
            "--time-limit",
            "2",
            "--replay-steps",
            "1",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert [row["mode"] for row in s["rows"]] == list(MODES)
    base = s["rows"][0]
    for row in s["rows"]:
        trace = load(row["trace_file"])
        plan = load_plan(row["plan_file"], trace)
        assert row["peak_live"] == trace.peak()[0]
        assert plan.arena == row["plan_arena"] >= row["bound"]
        assert row["saving"] == 1 - row["peak_live"] / base["peak_live"]  # like with like: against as-built
    assert base["mode"] == "as-built" and not base["changed"] and "nothing patched" in base["patch"]
    baseline = next(row for row in s["rows"] if row["mode"] == "baseline")
    assert not baseline["changed"]  # memplan's BERT is built with baseline's layers
    assert "baseline (changes nothing)" in (out / "report.md").read_text()
    tempo = next(row for row in s["rows"] if row["mode"] == "tempo")
    assert tempo["peak_live"] < base["peak_live"] and tempo["changed"]
    assert s["replay"]["bitwise_equal"] and s["replay"]["mode"] == "tempo"
    assert s["replay"]["fallback_count"] == 0 and s["capture"] == "real"
    report = (out / "report.md").read_text()
    assert all(f"--layers {m} " in report for m in MODES)
    for png in ("timeline.png", "address_space.png"):
        img = Image.open(out / png).convert("L")
        assert img.size[0] > 400 and len(np.unique(np.asarray(img))) > 20


@pytest.mark.slow
def test_run_on_fake_traces_says_so_and_replays_nothing(tmp_path):
    """... and with --gpu, gives each mode's verdict on that GPU, in the summary and in report.md."""
    out = tmp_path / "out"
    args = ["run", "examples/llama.py", "-o", str(out), "--seq", "32", "--time-limit", "1", "--capture", "fake"]
    r = CliRunner().invoke(main, [*args, "--gpu", "l4", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["capture"] == "fake" and s["replay"] is None
    assert all(load(row["trace_file"]).meta["fake"] for row in s["rows"])
    report = (out / "report.md").read_text()
    assert "with fake tensors (--capture fake)" in report and "no replay: the traces are fake" in report
    assert all(f"--layers {m} --fake " in report for m in MODES)
    assert s["gpu"]["name"] == "L4" and "## On L4" in report and "--gpu L4" in report
    for row in s["rows"]:
        v = row["verdict"]
        assert v["fits"] and v["program"]  # judged over the whole program: construction, the warm-up, the step
        assert v["peak_reserved"] >= v["step_peak_reserved"] > 0
        assert v["headroom"] == v["memory"] - v["peak_reserved"] - v["outside_bytes"]
        whole = "the whole program (2 training steps, construction included)"
        assert f"- **{row['mode']}**: {whole} fits L4 (21.99 GiB): peak reserved" in report


def test_a_mode_that_leaves_the_model_as_built_takes_the_as_built_trace():
    """`run` traces baseline on memplan's BERT (built with baseline's layers) no more: the as-built trace relabelled is
    the trace baseline's own capture makes, but for the original addresses, which no two captures share."""
    step = StepSpec("examples/bert.py", batch=1, seq=8)
    patch = as_built_patch(step.replace(mode="baseline"))
    assert patch is not None and patch["mode"] == "baseline" and not patch["changed"]
    assert as_built_patch(step.replace(mode="tempo")) is None  # it swaps layers: traced
    assert as_built_patch(step.replace(mode="selective")) is None  # it recomputes the attention core: traced
    assert as_built_patch(step.replace(mode="baseline", fake=True)) is None  # fake traces are traced, each
    relabelled = to_dict(as_built_trace(trace_step(step), "baseline", patch))
    traced = to_dict(trace_step(step.replace(mode="baseline")))
    assert relabelled["meta"]["layers"] == "baseline" and relabelled["program"]["meta"]["layers"] == "baseline"
    for document in (relabelled, traced):
        document["buffers"].pop("addr")
    assert relabelled == traced


def test_run_with_a_missing_model_file_is_one_line(tmp_path):
    r = CliRunner().invoke(main, ["run", str(tmp_path / "nope.py"), "-o", str(tmp_path / "o")])
    assert r.exit_code != 0
    assert r.output.strip().count("\n") == 0 and "no such model file" in r.output
    assert not (tmp_path / "o").exists()


FAILS_THIRD_TIME = """
from pathlib import Path
from memplan.planner.workloads.bert import build_workload

COUNT = Path(__file__).with_name("builds.txt")

def build(batch_size, seq_len, dtype, device):
    n = int(COUNT.read_text()) if COUNT.exists() else 0
    COUNT.write_text(str(n + 1))
    if n == 2:
        raise RuntimeError("third build fails")
    return build_workload(batch_size, seq_len, dtype, device)
"""


def test_a_run_failing_midway_leaves_nothing_and_keeps_other_files(tmp_path):
    model = tmp_path / "m" / "model.py"
    model.parent.mkdir()
    model.write_text(FAILS_THIRD_TIME)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    r = CliRunner().invoke(
        main, ["run", str(model), "-o", str(out), "--seq", "16", "--time-limit", "1", "--replay-steps", "1"]
    )
    assert r.exit_code == 1 and "third build fails" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "out"]  # no private folder left either
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_report_names_the_optimizer_the_trace_names_and_no_other():
    def sentence(optimizer):
        return step_sentence(
            RunResult(
                options=RunOptions(StepSpec("m.py"), out_dir="out"),
                capture=CaptureChoice(fake=True, reason="--capture fake"),
                optimizer=optimizer,
                rows=[],
                reference="as-built",
                replay=None,
                report_md="out/report.md",
                timeline_png="out/timeline.png",
                address_space_png="out/address_space.png",
                seconds=1.0,
            ).summary()
        )

    assert sentence("SGD").startswith("One training step (forward, backward, SGD) of `m.py` at batch 2")
    assert "AdamW" not in sentence("SGD")
    assert sentence(None).startswith("One training step (forward, backward) of `m.py`")
