"""The whole program as a trace (Trace.program): every allocation from the program's first, each training step's
window marked; the measured step stays the trace, and the verdict judges the program."""

from __future__ import annotations

import dataclasses
import gzip
import json

import numpy as np
import pytest
import torch
from torch import nn

import memplan
from memplan.errors import TraceError
from memplan.gpus import gpu
from memplan.planner.simulate.alloc_conf import AllocConf
from memplan.planner.simulate.caching_allocator import simulate_caching
from memplan.planner.simulate.verdict import Budget, OutsideTerm, judge
from memplan.step import StepSpec
from memplan.traces.format import load, save, trace_digest
from memplan.traces.inputs.trace_model import trace_step


@pytest.fixture(scope="module")
def gpt2_cuda():
    """A fake CUDA step of the bundled tiny GPT-2, with its program (construction, the warm-up, the measured step)."""
    return trace_step(StepSpec("examples/gpt2.py", batch=2, seq=64, fake=True, device="cuda"))


def window_live(trace):
    """The program's live bytes over the measured step's window, from the event before it."""
    program = trace.program
    step = program.steps[program.measured]
    return program.trace.live_bytes()[step.start - 1 : step.end]


def test_the_program_holds_construction_the_warm_up_and_the_measured_step(gpt2_cuda):
    program = gpt2_cuda.program
    assert [s.measured for s in program.steps] == [False, True]
    first, measured = program.steps
    assert 1 < first.start < first.end == measured.start < measured.end <= program.trace.end  # then its teardown
    assert program.where(1) == "construction" and program.where(measured.start) == "step 2 (measured)"
    assert program.where(first.start) == "step 1"
    # nothing was alive before the program's first allocation, and the measured step is the trace, event for event
    assert (program.trace.alloc > 0).all()
    assert np.array_equal(window_live(gpt2_cuda), gpt2_cuda.live_bytes())
    # the warm-up made AdamW's state: optimizer state is among the program's buffers made in step 1
    made_in_first = (program.trace.alloc >= first.start) & (program.trace.alloc < first.end)
    state = [c for c, m in zip(program.trace.category, made_in_first) if m and c == "optimizer"]
    assert len(state) == 2 * sum(1 for c in gpt2_cuda.category if c == "parameter")


def test_a_saved_trace_keeps_its_program_and_the_steps_digest(gpt2_cuda, tmp_path):
    path = tmp_path / "t.json.gz"
    save(gpt2_cuda, path)
    back = load(path)
    assert back.program is not None and back.program.steps == gpt2_cuda.program.steps
    assert np.array_equal(back.program.trace.size, gpt2_cuda.program.trace.size)
    assert trace_digest(back) == trace_digest(dataclasses.replace(gpt2_cuda, program=None))  # plans stay the step's


@pytest.mark.parametrize(
    "steps,error",
    [
        ([[5, 3, True]], "program.steps[0]: expected [start, end, measured]"),
        ([[1, 2, True], [2, 3, True]], "more than one step is marked measured"),
        ([[1, 3, False], [2, 4, True]], "program.steps[1]: starts before step 1 ends"),
        ("x", "program: expected an object"),
    ],
)
def test_a_malformed_program_section_is_one_error(gpt2_cuda, tmp_path, steps, error):
    path = tmp_path / "t.json.gz"
    save(gpt2_cuda, path)
    data = json.loads(gzip.decompress(path.read_bytes()))
    data["program"] = steps if isinstance(steps, str) else {**data["program"], "steps": steps}
    path.write_bytes(gzip.compress(json.dumps(data).encode()))
    with pytest.raises(TraceError, match=error.replace("[", r"\[").replace("]", r"\]")):
        load(path)


def least_capacity(trace) -> int:
    """The least capacity (to 2 MiB) at which the caching allocator serves every request of `trace`, its out-of-memory
    retry included."""
    low, high = 0, simulate_caching(trace).peak_reserved
    while high - low > 2 << 20:
        middle = (low + high) // 2
        low, high = (low, middle) if simulate_caching(trace, capacity=middle).oom is None else (middle, high)
    return high


def test_the_verdict_judges_the_program_where_the_first_step_needs_more():
    """The first step makes AdamW's state among the backward's leftovers: the program needs more of the GPU than the
    measured step from an empty cache, so a GPU that runs the step alone can fail the program, and the verdict says
    so (here in the measured step, in the cache step 1 left), with PyTorch's error."""
    config = "examples/configs/small-llama.json"
    llama = trace_step(StepSpec(config, batch=4, seq=512, dtype="bf16-mixed", fake=True, device="cuda"))
    step_alone = dataclasses.replace(llama, program=None)
    alone = least_capacity(step_alone)
    assert least_capacity(llama.program.trace) > alone
    small = dataclasses.replace(gpu("H100"), memory=alone)
    budget = Budget(small, (OutsideTerm("none", 0, "test"),))
    assert judge(step_alone, budget, AllocConf()).fits
    v = judge(llama, budget, AllocConf())
    assert not v.fits and v.program and v.oom.where == "step 2 (measured)"
    assert v.oom.message.startswith("CUDA out of memory. Tried to allocate ")


def test_record_marks_the_steps_of_a_loop_it_does_not_run():
    """`memplan.record(fake=True)` around a whole loop: each optimizer step ends a step, the first module call after
    it begins the next; the measured step is the one marked."""

    def loop(recording):
        model = nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 100)).to("cuda")
        optimizer = torch.optim.AdamW(model.parameters())
        ids = torch.randint(0, 100, (4, 16), device="cuda")

        def step():
            loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()
        step()
        with recording.step(model, optimizer, inputs=ids):
            step()

    with memplan.record(fake=True, device="cuda") as recording:
        loop(recording)
    program = recording.trace.program
    assert [s.measured for s in program.steps] == [False, False, True]
    assert np.array_equal(window_live(recording.trace), recording.trace.live_bytes())
