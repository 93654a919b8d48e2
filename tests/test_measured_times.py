"""Step times measured on GPUs (planner/cost/measured_times.json): every figure is one docs/gpu-validation.md
records; `memplan optimize` prices a measured mode's layers at its measured added time on that GPU and shape, and
says so; `memplan tradeoff --gpu` shows the measured times beside its points, or says none were measured."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import pytest

from memplan.gpus import gpu
from memplan.modes import AS_BUILT, BASELINE, SELECTIVE, TEMPO
from memplan.planner.cost.measured import measured_times, measurements
from memplan.planner.cost.rates import Rates
from memplan.planner.jobs.optimize import OptimizeOptions, measured_pricing, work
from memplan.planner.jobs.tradeoff import TradeoffOptions, apply_measured, tradeoff
from memplan.planner.report.optimize_text import pricing_lines
from memplan.planner.report.tradeoff_table import render_tradeoff
from memplan.step import StepSpec

ROOT = Path(__file__).resolve().parents[1]
GPT2 = str(ROOT / "examples" / "gpt2.py")
H200_SHAPE = {"batch": 8, "seq": 1024, "dtype": "bfloat16"}  # what tempo_kernels.py ran on the H200


def test_every_measurement_is_one_the_gpu_validation_record_holds():
    record = (ROOT / "docs" / "gpu-validation.md").read_text()
    assert measurements()
    for m in measurements():
        assert "docs/gpu-validation.md" in m.source and m.date in record and m.torch in record
        for seconds in m.seconds.values():
            assert f"{seconds * 1e3:.1f} ms" in record


def test_a_measurement_matches_its_gpu_model_and_shape_only():
    found = measured_times("H200", "gpt2-12x768", 1024, 8, "bfloat16")
    assert found is not None and found.reference == BASELINE
    assert found.added_per_layer(TEMPO, 12) == pytest.approx((0.0873 - 0.0359) / 12)
    assert found.added_per_layer(SELECTIVE, 12) is None
    assert measured_times("H100-80GB", "gpt2-12x768", 1024, 8, "bfloat16") is None
    assert measured_times("H200", "gpt2-12x768", 1024, 4, "bfloat16") is None
    assert measured_times("H200", "gpt2-12x768", 1024, 8, "float32") is None
    assert measured_times(None, "gpt2-12x768", 1024, 8, "bfloat16") is None


def _rates() -> Rates:
    return Rates(10**15, "H200's dense bf16 peak", None, None, 1e-9)


def test_optimize_prices_a_measured_mode_at_its_measured_time_and_the_rest_by_flops():
    opts = OptimizeOptions(StepSpec(GPT2, **H200_SHAPE), gpu=gpu("H200"))
    layers = tuple(f"h.{i}" for i in range(12))
    modes = (AS_BUILT, TEMPO, SELECTIVE)
    cost = {(j, m): 1000 for j in range(12) for m in modes}  # stand-ins for the FLOP estimates
    trace = types.SimpleNamespace(meta={"model": "gpt2-12x768"})
    pricing = measured_pricing(opts, layers, 8, trace, modes, cost, _rates())
    added = (0.0873 - 0.0359) / 12
    assert pricing["added_per_layer"] == {TEMPO: pytest.approx(added)}
    assert all(cost[j, TEMPO] == work(added, _rates()) for j in range(12))
    assert all(cost[j, SELECTIVE] == 1000 and cost[j, AS_BUILT] == 1000 for j in range(12))
    line = pricing_lines({"pricing": pricing, "gpu": {}})[0]
    assert "tempo +4.28 ms a layer (measured on H200, 2026-11-26, torch 2.11.0+cu130" in line
    other = OptimizeOptions(StepSpec(GPT2, batch=4, seq=1024, dtype="bfloat16"), gpu=gpu("H200"))
    assert measured_pricing(other, layers, 4, trace, modes, dict(cost), _rates()) is None
    assert "priced by its FLOPs" in pricing_lines({"pricing": None, "gpu": {}})[0]
    assert pricing_lines({"pricing": None, "gpu": None}) == []


@pytest.mark.slow
def test_tradeoff_on_a_gpu_shows_measured_times_or_says_there_are_none():
    step = StepSpec(GPT2, batch=2, seq=32).on_gpu(gpu("H200"))
    opts = TradeoffOptions(step, budgets=(), capture="fake", actions=False)
    result = tradeoff(opts)
    summary = result.summary()
    assert summary["measured"] is None and summary["gpu"] == "H200"
    assert any(n.startswith("no step time measured on H200 for gpt2-2x64 s32 b2") for n in summary["notes"])
    assert "on H200" not in render_tradeoff(summary).splitlines()[0]
    # the same points as if the model and shape were the measured ones
    measured_opts = TradeoffOptions(StepSpec(GPT2, **H200_SHAPE).on_gpu(gpu("H200")), budgets=(), actions=False)
    points = [dataclasses.replace(p, model="gpt2-12x768") for p in result.points]
    measured, note = apply_measured(measured_opts, points)
    by_mode = {p.layers: p.measured_seconds for p in points}
    assert by_mode[TEMPO] == 0.0873 and by_mode[BASELINE] == 0.0359 and by_mode[AS_BUILT] is None
    assert measured["gpu"] == "H200" and note.startswith("step times measured on H200, 2026-11-26")
    result.points, result.measured = points, measured
    table = render_tradeoff(result.summary())
    assert "on H200" in table.splitlines()[0] and "87.3 ms" in table
