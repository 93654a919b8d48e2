"""The model-file protocol and the `memplan trace` command: good files trace, bad ones give one line; the model's
name is the trace's; a model file imports its siblings and files named like memplan's modules never shadow them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from memplan.cli import main
from memplan.errors import MemplanError, ModelFileError
from memplan.step import StepSpec
from memplan.traces.format import load
from memplan.traces.inputs.model_file import DeviceError, load_workload
from memplan.traces.inputs.trace_model import trace_step

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
MEMPLAN = ROOT / ".venv" / "bin" / "memplan"

GOOD = """
import torch
from torch import nn

def build(batch_size, seq_len, dtype, device):
    model = nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 32))
    ids = torch.randint(0, 32, (batch_size, seq_len), device=device)
    return {"model": model, "inputs": ids,
            "loss": lambda out, ids: nn.functional.cross_entropy(out.flatten(0, 1).float(), ids.flatten()),
            "optimizer": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)}
"""

BAD = {
    "no_function": ("import torch\nMODEL = None\n", "defines no function build(batch_size, seq_len, dtype, device)"),
    "wrong_signature": ("def build(batch):\n    return None\n", "must accept the arguments"),
    "raises": (
        "def build(batch_size, seq_len, dtype, device):\n    raise ValueError('no GPU here\\nsecond line')\n",
        "build() raised ValueError: no GPU here",
    ),
    "import_fails": ("import no_such_module_for_memplan\n", "importing it raised ModuleNotFoundError"),
    "wrong_return": ("def build(batch_size, seq_len, dtype, device):\n    return [1, 2]\n", "build() returned list"),
    "missing_inputs": (
        "from torch import nn\ndef build(batch_size, seq_len, dtype, device):\n    return {'model': nn.Linear(2, 2)}\n",
        "without the key 'inputs'",
    ),
    "not_a_module": (
        "def build(batch_size, seq_len, dtype, device):\n    return {'model': 3, 'inputs': 1}\n",
        "build()['model'] is int, not a torch.nn.Module",
    ),
    "bad_optimizer": (
        "import torch\nfrom torch import nn\ndef build(batch_size, seq_len, dtype, device):\n"
        "    return {'model': nn.Linear(2, 2), 'inputs': torch.ones(1, 2), 'optimizer': 'adam'}\n",
        "build()['optimizer'] is str",
    ),
}


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    return path


def one_error_line(result) -> str:
    """The single `Error: ...` line of a failed command (stderr also carries progress lines)."""
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in result.output and result.stdout == ""
    return errors[0]


def test_a_good_model_file_builds_the_workload_it_describes(tmp_path):
    w = load_workload(StepSpec(write(tmp_path, "good", GOOD), batch=3, seq=5, dtype="bfloat16"))
    assert w.inputs.shape == (3, 5)
    assert isinstance(w.optimizer, torch.optim.SGD)
    assert all(p.dtype == torch.bfloat16 for p in w.model.parameters())
    assert w.name == "good"
    assert torch.isfinite(w.step())


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_broken_model_file_gives_one_line_naming_the_problem(tmp_path, case):
    text, expected = BAD[case]
    with pytest.raises(ModelFileError) as err:
        load_workload(StepSpec(write(tmp_path, case, text), batch=2, seq=4))
    message = str(err.value)
    assert expected in message and "\n" not in message


def test_an_unknown_preset_of_a_bundled_model_file_is_reported(monkeypatch):
    monkeypatch.setenv("MEMPLAN_PRESET", "huge")
    with pytest.raises(ModelFileError, match=r"build\(\) raised ValueError: MEMPLAN_PRESET='huge' is not one of"):
        load_workload(StepSpec(EXAMPLES / "gpt2.py", batch=2, seq=4))


def test_a_missing_model_file_is_named(tmp_path):
    with pytest.raises(ModelFileError, match="no such model file"):
        load_workload(StepSpec(tmp_path / "absent.py", batch=2, seq=4))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_on_a_machine_without_it_is_refused_before_building(tmp_path):
    with pytest.raises(DeviceError, match="CUDA is not available"):
        load_workload(StepSpec(write(tmp_path, "good", GOOD), batch=2, seq=4, device="cuda"))
    out = tmp_path / "t.json.gz"
    result = CliRunner().invoke(main, ["trace", str(tmp_path / "good.py"), "--device", "cuda", "-o", str(out)])
    assert result.exit_code != 0 and not out.exists()
    assert one_error_line(result) and "CUDA is not available" in result.stderr


def test_layers_mode_is_applied_to_the_built_model_and_unknown_modes_are_refused(tmp_path):
    w = load_workload(StepSpec(EXAMPLES / "bert.py", batch=2, seq=8, mode="tempo"))
    kinds = {type(m).__module__ for m in w.model.modules()}
    assert any(k.startswith("memplan.planner.layers") for k in kinds)
    assert {id(p) for g in w.optimizer.param_groups for p in g["params"]} == {id(p) for p in w.model.parameters()}
    with pytest.raises(MemplanError) as err:
        StepSpec(EXAMPLES / "bert.py", mode="no-such-mode")
    assert "\n" not in str(err.value) and "no-such-mode" in str(err.value)


def test_an_unknown_layers_mode_is_refused_before_build_runs(tmp_path):
    """`--layers` is checked first: a wrong mode never costs a build (which may be minutes for a large model)."""
    marker = tmp_path / "built"
    model = write(
        tmp_path,
        "marks",
        f"{GOOD}\n_build = build\n\n\ndef build(batch_size, seq_len, dtype, device):\n"
        f"    open({str(marker)!r}, 'w').close()\n"
        "    return _build(batch_size, seq_len, dtype, device)\n",
    )
    for command in (
        ["trace", str(model)],
        ["replay", "plan.json", str(model)],
        ["fit", str(model), "--memory", "1GiB"],
    ):
        result = CliRunner().invoke(main, [*command, "--layers", "no-such-mode"])
        assert result.exit_code != 0 and one_error_line(result) and "no-such-mode" in result.stderr, command
        assert not marker.exists(), command


def test_cli_without_build_function_exits_nonzero_with_one_line_and_writes_nothing(tmp_path):
    model = write(tmp_path, "nobuild", BAD["no_function"][0])
    out = tmp_path / "nobuild.trace.json.gz"
    result = CliRunner().invoke(main, ["trace", str(model), "-o", str(out)])
    assert result.exit_code != 0
    assert not out.exists() and not list(tmp_path.glob("*.gz")) and not list(tmp_path.glob(".*tmp"))
    assert "defines no function build" in one_error_line(result)


def test_cli_reports_a_failing_training_step_in_one_line(tmp_path):
    text = GOOD.replace(
        '"loss": lambda out, ids: nn.functional.cross_entropy(out.flatten(0, 1).float(), ids.flatten()),',
        '"loss": lambda out, ids: out.float().view(7, -1).mean(),',
    )
    out = tmp_path / "t.json.gz"
    result = CliRunner().invoke(main, ["trace", str(write(tmp_path, "badloss", text)), "--seq", "4", "-o", str(out)])
    assert result.exit_code != 0 and not out.exists()
    assert "badloss: the warm-up step raised RuntimeError: shape '[7, -1]' is invalid" in one_error_line(result)


def test_cli_traces_a_model_file_and_prints_the_summary_as_json(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = write(tmp_path, "good", GOOD)
    result = CliRunner().invoke(main, ["trace", str(model), "--batch", "2", "--seq", "4", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    out = tmp_path / "good.as-built.trace.json.gz"
    assert summary["output"] == "good.as-built.trace.json.gz" and out.exists()
    trace = load(out)
    assert summary["peak_bytes"] == trace.peak()[0] and summary["buffers"] == len(trace)
    assert trace.meta["batch"] == 2 and trace.meta["seq"] == 4 and trace.meta["model"] == "good"
    assert set(summary["at_peak_by_category"]) <= {
        "parameter",
        "gradient",
        "optimizer",
        "activation",
        "input",
        "temporary",
    }
    assert sum(summary["at_peak_by_category"].values()) == summary["peak_bytes"]
    assert [b["size"] for b in summary["largest"]] == sorted(trace.size.tolist(), reverse=True)[:5]
    # SGD with momentum: one momentum buffer per parameter, no step counters
    params = 32 * 8 * 4 + (8 * 32 + 32) * 4
    assert sum(int(s) for s, c in zip(trace.size, trace.category) if c == "optimizer") == params


def test_cli_text_summary_of_the_bundled_bert(tmp_path, monkeypatch):
    monkeypatch.delenv("MEMPLAN_PRESET", raising=False)  # tiny
    out = tmp_path / "bert.trace.json.gz"
    result = CliRunner().invoke(main, ["trace", str(EXAMPLES / "bert.py"), "--seq", "16", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "peak live:" in result.stdout and "largest buffers:" in result.stdout
    assert load(out).meta["model"] == "bert-2x64"  # the name the model file's Workload gives, not the file's


# --- the model's name: the "name" key of build()'s dict, or Workload.name; without one, the file's name ---

NAMING_MODEL = """
import torch
from torch import nn
{extra}

def build(batch_size, seq_len, dtype, device):
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16)).to(device=device, dtype=dtype)
    ids = torch.randint(0, 16, (batch_size, seq_len), device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return {returns}
"""
NAMED = NAMING_MODEL.format(extra="", returns='{"model": model, "inputs": ids, "name": "mynet"}')
UNNAMED = NAMING_MODEL.format(extra="", returns='{"model": model, "inputs": ids}')
WORKLOAD = "from memplan.traces.inputs.workload import Workload"
NAMED_WORKLOAD = NAMING_MODEL.format(extra=WORKLOAD, returns='Workload(model, ids, optimizer, name="mynet")')
UNNAMED_WORKLOAD = NAMING_MODEL.format(extra=WORKLOAD, returns="Workload(model, ids, optimizer)")


@pytest.mark.slow  # 3-10 s: out of the fast lane, which stays under 3 minutes
def test_the_model_files_name_is_the_traces_model(tmp_path):
    """The model's name is the trace's meta "model" for every command that traces it (trace, run, fit and
    replay all go through trace_step), real or fake."""
    cases = {"named": NAMED, "unnamed": UNNAMED, "named_workload": NAMED_WORKLOAD, "unnamed_workload": UNNAMED_WORKLOAD}
    expected = {
        "named": "mynet",
        "unnamed": "unnamed",
        "named_workload": "mynet",
        "unnamed_workload": "unnamed_workload",
    }
    for stem, text in cases.items():
        path = write(tmp_path, stem, text)
        workload = load_workload(StepSpec(path, batch=2, seq=4))
        assert workload.name == expected[stem]  # what replay reports
        assert trace_step(StepSpec(path, batch=2, seq=4)).meta["model"] == expected[stem], stem  # trace, run, fit
        assert trace_step(StepSpec(path, batch=2, seq=4, fake=True)).meta["model"] == expected[stem], stem


def test_cli_trace_records_the_model_files_name(tmp_path):
    path = write(tmp_path, "netfile", NAMED)
    out = tmp_path / "t.json.gz"
    result = CliRunner().invoke(main, ["trace", str(path), "--batch", "2", "--seq", "4", "-o", str(out)])
    assert result.exit_code == 0, result.output
    trace = load(out)
    assert trace.meta["model"] == "mynet" and trace.meta["model_file"] == str(path)


# --- imports: a model file imports its sibling modules (its folder is first on sys.path while memplan imports
# it, and stays there for build()'s lazy imports), and files beside it named like memplan's modules (cli.py,
# traces.py, planner.py) never shadow memplan's own, which are all under the `memplan.` namespace ---

SIBLINGS_MODEL = """
import torch

from {sibling} import Net  # a sibling module of this file


def build(batch_size, seq_len, dtype, device):
    from {lazy} import VOCAB  # imported when build() runs, after memplan imported this file
    ids = torch.randint(0, VOCAB, (batch_size, seq_len), device=device)
    return {{"model": Net(VOCAB), "inputs": ids, "name": "siblings"}}
"""
SIBLING_NET = """
from torch import nn


class Net(nn.Sequential):
    def __init__(self, vocab):
        super().__init__(nn.Embedding(vocab, 8), nn.Linear(8, vocab))
"""
DECOY = "raise ImportError('a user file named like a memplan module was imported: {name}')\n"


def siblings_folder(tmp_path: Path, tag: str) -> Path:
    """A model folder: model.py importing its siblings, and decoys named like memplan's modules."""
    sibling, lazy = f"mynet_{tag}", f"vocab_{tag}"  # names of this test's own: sys.modules caches them
    (tmp_path / "model.py").write_text(textwrap.dedent(SIBLINGS_MODEL.format(sibling=sibling, lazy=lazy)))
    (tmp_path / f"{sibling}.py").write_text(textwrap.dedent(SIBLING_NET))
    (tmp_path / f"{lazy}.py").write_text("VOCAB = 16\n")
    for name in ("cli", "traces", "planner", "solvers", "api"):
        (tmp_path / f"{name}.py").write_text(DECOY.format(name=name))
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
    work = siblings_folder(tmp_path, "cli")
    monkeypatch.chdir(work)
    result = CliRunner().invoke(main, ["trace", "model.py", "--batch", "2", "--seq", "4", "-o", "t.json.gz"])
    assert result.exit_code == 0, result.output
    assert load(work / "t.json.gz").meta["model"] == "siblings"
    assert sys.path.count(str(work.resolve())) == 1
    assert "traces" not in sys.modules and "cli" not in sys.modules  # the decoys were never imported


@pytest.mark.slow  # 3-10 s: out of the fast lane, which stays under 3 minutes
@pytest.mark.skipif(not MEMPLAN.exists(), reason="needs the virtualenv's memplan script")
def test_memplan_trace_run_from_the_model_files_folder(tmp_path):
    work = siblings_folder(tmp_path, "proc")
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
