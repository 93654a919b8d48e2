"""A long capture says how it is getting on: a line every MEMPLAN_PROGRESS_SECONDS through the caller's progress
function (the command line's stderr), naming the stage, the phase, the ops run, the bytes live and the module; the
tests make the interval tiny instead of waiting seconds."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import memplan
from memplan.cli import main
from memplan.errors import MemplanError
from memplan.traces.progress import INTERVAL_ENV

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
LINE = "still tracing after"


class WaitsForAReport(nn.Module):
    """Allocates, then blocks until the progress thread has reported twice more, and keeps the latest line: one taken
    after that allocation, mid-forward."""

    def __init__(self, lines: list[str], reported: threading.Event):
        super().__init__()
        self.lines, self.reported, self.seen = lines, reported, ""

    def forward(self, x):
        y = x * 2
        for _ in range(2):  # the first report may have been taken before the allocation
            self.reported.clear()
            assert self.reported.wait(30), "no progress line within 30 s"
        self.seen = self.lines[-1]
        return y


def test_a_line_mid_step_names_the_phase_the_ops_the_bytes_and_the_module(monkeypatch):
    monkeypatch.setenv(INTERVAL_ENV, "0.001")
    lines, reported = [], threading.Event()

    def report(line: str) -> None:
        lines.append(line)
        reported.set()

    waits = WaitsForAReport(lines, reported)
    model = nn.Sequential(nn.Linear(16, 16), waits)
    optimizer = torch.optim.SGD(model.parameters())
    x = torch.randn(4, 16)
    with memplan.record(model, optimizer, inputs=x, progress=report):
        model(x).sum().backward()
        optimizer.step()
    assert all(line.startswith(LINE) for line in lines)
    assert "recording the step (forward)" in waits.seen
    assert "latest allocation in model.1" in waits.seen  # the waiting module's own allocation (x * 2)
    assert " ops run, " in waits.seen and "allocations and frees recorded" in waits.seen and " live" in waits.seen


def test_trace_prints_progress_on_stderr_and_keeps_stdout_json(tmp_path, monkeypatch):
    monkeypatch.setenv(INTERVAL_ENV, "0.001")
    args = ["trace", str(EXAMPLES / "gpt2.py"), "--fake", "--seq", "16", "-o", str(tmp_path / "t.json"), "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.stderr
    assert any(line.startswith(LINE) for line in result.stderr.splitlines())
    assert LINE not in result.stdout
    assert json.loads(result.stdout)["fake"] is True


def test_a_bad_interval_is_one_error_line(tmp_path, monkeypatch):
    monkeypatch.setenv(INTERVAL_ENV, "soon")
    result = CliRunner().invoke(main, ["trace", str(EXAMPLES / "gpt2.py"), "--seq", "16", "-o", str(tmp_path / "t")])
    assert result.exit_code == 1 and result.stderr.strip().splitlines()[-1].startswith("Error:")
    assert INTERVAL_ENV in result.stderr and not (tmp_path / "t").exists()
    with pytest.raises(MemplanError, match=INTERVAL_ENV):
        with memplan.record(progress=print):
            pass
