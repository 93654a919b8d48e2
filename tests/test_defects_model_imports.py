"""A model file imports its sibling modules (its folder is first on sys.path while memplan imports it, and
stays there for build()'s lazy imports), and files beside it named like memplan's modules (cli.py,
traces.py, planner.py) never shadow memplan's own, which are all under the `memplan.` namespace."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from memplan.cli import main
from memplan.traces.format import load

ROOT = Path(__file__).resolve().parents[1]
MEMPLAN = ROOT / ".venv" / "bin" / "memplan"

MODEL = """
import torch

from {sibling} import Net  # a sibling module of this file


def build(batch_size, seq_len, dtype, device):
    from {lazy} import VOCAB  # imported when build() runs, after memplan imported this file
    ids = torch.randint(0, VOCAB, (batch_size, seq_len), device=device)
    return {{"model": Net(VOCAB), "inputs": ids, "name": "siblings"}}
"""
NET = """
from torch import nn


class Net(nn.Sequential):
    def __init__(self, vocab):
        super().__init__(nn.Embedding(vocab, 8), nn.Linear(8, vocab))
"""
BROKEN = "raise ImportError('a user file named like a memplan module was imported: {name}')\n"


def folder(tmp_path: Path, tag: str) -> Path:
    """A model folder: model.py importing its siblings, and decoys named like memplan's modules."""
    sibling, lazy = f"mynet_{tag}", f"vocab_{tag}"  # names of this test's own: sys.modules caches them
    (tmp_path / "model.py").write_text(textwrap.dedent(MODEL.format(sibling=sibling, lazy=lazy)))
    (tmp_path / f"{sibling}.py").write_text(textwrap.dedent(NET))
    (tmp_path / f"{lazy}.py").write_text("VOCAB = 16\n")
    for name in ("cli", "traces", "planner", "solvers", "api"):
        (tmp_path / f"{name}.py").write_text(BROKEN.format(name=name))
    return tmp_path


@pytest.fixture
def clean_imports(monkeypatch):
    """Leave sys.path and sys.modules as they were (the model file's folder stays for the process)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith(("mynet_", "vocab_", "memplan_model_")):
            del sys.modules[name]


def test_cli_trace_of_a_model_file_that_imports_its_siblings(tmp_path, monkeypatch, clean_imports):
    work = folder(tmp_path, "cli")
    monkeypatch.chdir(work)
    result = CliRunner().invoke(main, ["trace", "model.py", "--batch", "2", "--seq", "4", "-o", "t.json.gz"])
    assert result.exit_code == 0, result.output
    assert load(work / "t.json.gz").meta["model"] == "siblings"
    assert sys.path.count(str(work.resolve())) == 1
    assert "traces" not in sys.modules and "cli" not in sys.modules  # the decoys were never imported


@pytest.mark.skipif(not MEMPLAN.exists(), reason="needs the virtualenv's memplan script")
def test_memplan_trace_run_from_the_model_files_folder(tmp_path):
    work = folder(tmp_path, "proc")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(MEMPLAN), "trace", "model.py", "--batch", "2", "--seq", "4", "-o", "t.json.gz"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert load(work / "t.json.gz").meta["model"] == "siblings"
