"""The Python API checks its arguments as the command line checks the same options: each refusal a MemplanError
subclass within 10 s (never an AttributeError, a TypeError or torch's RuntimeError), with the same defaults, and
nonsense the command line refuses (a capacity of -1, an empty GPU name) is refused here too, not answered."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from timeouts import within
from torch import nn

import memplan
from memplan.errors import MemplanError

CORPUS = Path(__file__).resolve().parent / "data" / "malformed"
TRACE_FILE = CORPUS / "good.trace.json"
PLAN_FILE = CORPUS / "good.plan.json"
MODEL = Path(__file__).resolve().parents[1] / "examples" / "bert.py"  # never built: its arguments fail first
SECONDS = 10


def record_a_step(**options):
    """A fake step of a tiny model recorded with `options`, built inside the block on the device it plans."""
    device = options.get("device") or ("cuda" if options.get("gpu") else "cpu")
    with memplan.record(**{"fake": True, **options}) as recording:
        model = nn.Linear(4, 4).to(device)
        optimizer = torch.optim.AdamW(model.parameters())
        with recording.step(model, optimizer):
            model(torch.randn(2, 4, device=device)).sum().backward()
            optimizer.step()
    return recording.trace


TRACE = memplan.load_trace(TRACE_FILE)
BAD = {
    "simulate(trace, gpu=123)": lambda: memplan.simulate(TRACE, gpu=123),
    "simulate(trace, gpu='')": lambda: memplan.simulate(TRACE, gpu=""),
    "simulate(123)": lambda: memplan.simulate(123),
    "simulate('missing.json')": lambda: memplan.simulate("missing.json"),
    "simulate(trace, capacity=-1)": lambda: memplan.simulate(TRACE, capacity=-1),
    "simulate(trace, capacity=0)": lambda: memplan.simulate(TRACE, capacity=0),
    "simulate(trace, capacity=1.5)": lambda: memplan.simulate(TRACE, capacity=1.5),
    "simulate(trace, capacity='lots')": lambda: memplan.simulate(TRACE, capacity="lots"),
    "simulate(trace, alloc_conf=5)": lambda: memplan.simulate(TRACE, alloc_conf=5),
    "simulate(trace, plan=5)": lambda: memplan.simulate(TRACE, plan=5),
    "solve(trace, time_limit=0)": lambda: memplan.solve(TRACE, time_limit=0),
    "solve(trace, time_limit='5')": lambda: memplan.solve(TRACE, time_limit="5"),
    "solve(trace, capacity=-1)": lambda: memplan.solve(TRACE, capacity=-1),
    "solve(trace, alignment=0)": lambda: memplan.solve(TRACE, alignment=0),
    "solve(None)": lambda: memplan.solve(None),
    "verify('plan.json', trace)": lambda: memplan.verify(None, TRACE),
    "export_snapshot(None)": lambda: memplan.export_snapshot(None),
    "export_snapshot(trace, 5)": lambda: memplan.export_snapshot(TRACE, 5),
    "compare(trace)": lambda: memplan.compare(TRACE),
    "compare([trace], time_limit=-1)": lambda: memplan.compare([TRACE], time_limit=-1),
    "plot([trace], 5)": lambda: memplan.plot([TRACE], 5),
    "save_trace(5, path)": lambda: memplan.save_trace(5, "t.json"),
    "load_trace(None)": lambda: memplan.load_trace(None),
    "fit(model)": lambda: memplan.fit(MODEL),
    "fit(model, -1)": lambda: memplan.fit(MODEL, -1),
    "fit(model, gpu=5)": lambda: memplan.fit(MODEL, gpu=5),
    "fit(model, 1 << 30, gpu='H100')": lambda: memplan.fit(MODEL, 1 << 30, gpu="H100"),
    "optimize(model, -1)": lambda: memplan.optimize(MODEL, -1),
    "optimize(model)": lambda: memplan.optimize(MODEL),
    "trace_model_file(model, device='tpu')": lambda: memplan.trace_model_file(MODEL, device="tpu"),
    "trace_model_file(model, max_parameters=0)": lambda: memplan.trace_model_file(MODEL, max_parameters=0),
    "gpu(5)": lambda: memplan.gpu(5),
    "record(fake=True, device='tpu')": lambda: record_a_step(device="tpu"),
    "record(fake=True, device=5)": lambda: record_a_step(device=5),
    "record(fake=True, device='cuda', gpu='')": lambda: record_a_step(device="cuda", gpu=""),
    "record(fake=True, device='cuda', gpu=123)": lambda: record_a_step(device="cuda", gpu=123),
    "record(fake=True, device='cpu', gpu='H200')": lambda: record_a_step(device="cpu", gpu="H200"),
    "record(fake='yes')": lambda: record_a_step(fake="yes"),
    "record(fake=True, output=5)": lambda: record_a_step(output=5),
    "record(device='cuda') without a GPU": lambda: record_a_step(device="cuda", fake=False),
}


@pytest.mark.parametrize("call", list(BAD))
def test_a_bad_argument_is_a_memplan_error(call, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if call == "record(device='cuda') without a GPU" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with within(SECONDS), pytest.raises(MemplanError) as raised:
        BAD[call]()
    message = str(raised.value)
    assert "\n" not in message and 0 < len(message) < 400, message
    assert list(tmp_path.iterdir()) == []


def test_the_api_answers_as_the_command_line_does():
    """A trace's path is read as the command line reads it; a size is parsed as --capacity parses it; a GPU named
    without a device makes record's step CUDA (as --gpu implies --device cuda) and plans it for that GPU."""
    by_path = memplan.simulate(str(TRACE_FILE), capacity="1GiB", plan=str(PLAN_FILE))
    by_value = memplan.simulate(TRACE, capacity=1 << 30, plan=memplan.load_plan(PLAN_FILE, TRACE))
    assert by_path.figures() == by_value.figures()
    trace = record_a_step(gpu="H200")
    assert (trace.meta["device"], trace.meta["gpu"]) == ("cuda", "H200")
