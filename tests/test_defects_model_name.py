"""A model file's name (the "name" key of build()'s dict, or Workload.name) is the trace's meta "model" for
every command that traces it (trace, run, fit and replay all go through trace_step); without one, the
file's name."""

import textwrap

from click.testing import CliRunner

from memplan.cli import main
from memplan.step import StepSpec
from memplan.traces.format import load
from memplan.traces.model_file import load_workload
from memplan.traces.trace_model import trace_step

MODEL = """
import torch
from torch import nn
{extra}

def build(batch_size, seq_len, dtype, device):
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16)).to(device=device, dtype=dtype)
    ids = torch.randint(0, 16, (batch_size, seq_len), device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return {returns}
"""
NAMED = MODEL.format(extra="", returns='{"model": model, "inputs": ids, "name": "mynet"}')
UNNAMED = MODEL.format(extra="", returns='{"model": model, "inputs": ids}')
WORKLOAD = "from memplan.traces.workload import Workload"
NAMED_WORKLOAD = MODEL.format(extra=WORKLOAD, returns='Workload(model, ids, optimizer, name="mynet")')
UNNAMED_WORKLOAD = MODEL.format(extra=WORKLOAD, returns="Workload(model, ids, optimizer)")


def write(folder, stem, text):
    path = folder / f"{stem}.py"
    path.write_text(textwrap.dedent(text))
    return path


def test_the_model_files_name_is_the_traces_model(tmp_path):
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
