"""benchmarks/tempo_throughput.py (Tempo's throughput experiment, a GPU script) runs end to end on the CPU at a tiny
size, so it does not rot between lent GPUs: each mode's largest batch by memplan's verdict, timed there and at an
equal batch, written as JSON and printed as a table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from memplan.modes import AS_BUILT, TEMPO

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "tempo_throughput.py"


def _script():
    spec = importlib.util.spec_from_file_location("tempo_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_throughput_script_runs_on_the_cpu_at_a_tiny_size(tmp_path, capsys):
    out = tmp_path / "throughput.json"
    # At s 64 a sample's activations outweigh the tiny model's state: each mode's fit brackets its answer (2 and 3) in
    # the four traces of batches 1, 2, 3 and 4 (at s 8 the plan's answer lay near 10: nine traces a mode).
    arguments = ["--device", "cpu", "--tiny", "--models", "bert-large", "--modes", f"{AS_BUILT},{TEMPO}", "--seq", "64"]
    arguments += ["--memory", "8MiB", "--dtype", "float32", "--jobs", "1", "--repeats", "1", "--warmup", "0"]
    _script().main([*arguments, "--out", str(out)])
    document = json.loads(out.read_text())
    (model,) = document["models"]
    assert model["model"] == "bert-tiny" and model["budget"]["memory"] == 8 << 20
    rows = model["modes"]
    assert set(rows) == {AS_BUILT, TEMPO}
    assert rows[TEMPO]["largest"] >= rows[AS_BUILT]["largest"] >= 1  # tempo keeps less a sample
    for row in rows.values():
        assert row["timed"]["batch"] == row["largest"] and row["timed"]["samples_per_second"] > 0
        assert row["equal_seconds"] > 0
    assert model["equal_batch"] == rows[AS_BUILT]["largest"]
    table = capsys.readouterr().out
    assert "samples/s" in table and f"step at b={model['equal_batch']}" in table
