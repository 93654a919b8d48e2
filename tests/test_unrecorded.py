"""A trace says what its step read but it lacks: storages made before recording began (a tensor a model file makes at
import), in `memplan trace`'s text and --json and in `memplan simulate`'s; memplan's own shared tables are not
among them."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from memplan.cli import main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

CACHED_AT_IMPORT = """
import torch
from torch import nn

SCALE = torch.full((64, 1000), 0.5)  # made at import, before recording: read by every step's loss


def build(batch_size, seq_len, dtype, device):
    model = nn.Linear(1000, 1000)
    return {"model": model, "inputs": torch.randn(64, 1000), "loss": lambda out, _: (out * SCALE).sum()}
"""


def invoke(*args) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def test_a_tensor_made_at_a_model_files_import_is_named_by_trace_and_simulate(tmp_path):
    model = tmp_path / "cached.py"
    model.write_text(CACHED_AT_IMPORT)
    out = tmp_path / "cached.trace.json.gz"
    code, stdout, stderr = invoke("trace", model, "-o", out, "--json")
    assert code == 0, stderr
    missing = json.loads(stdout)["unrecorded"]
    assert missing["storages"] == 1 and missing["bytes"] == 64 * 1000 * 4
    assert missing["largest"] == [{"name": "", "bytes": 256000, "op": "aten::mul", "module": "loss"}]
    code, stdout, _ = invoke("trace", model, "-o", out)
    assert code == 0 and "warning: the step read 1 storages (250.00 KiB, 256,000 bytes)" in stdout
    assert "aten::mul in loss 250.00 KiB" in stdout
    code, stdout, _ = invoke("simulate", out, "--json")
    assert code == 0 and json.loads(stdout)["unrecorded"] == missing
    code, stdout, _ = invoke("simulate", out)
    assert code == 0 and "warning: the step read 1 storages" in stdout


def test_a_bundled_model_and_tempos_shared_tables_lack_nothing(tmp_path):
    """Tempo's GELU reads an inverse table the process made at import (planner/layers/inverse.py): memplan's own
    constant, left out of what a trace lacks, so the bundled model under tempo is traced with no warning."""
    out = tmp_path / "t.json"
    code, stdout, stderr = invoke("trace", EXAMPLES / "gpt2.py", "--layers", "tempo", "-o", out, "--json")
    assert code == 0, stderr
    assert json.loads(stdout)["unrecorded"] == {}
