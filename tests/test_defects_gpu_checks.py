"""Defects the first GPU run found (docs/gpu-validation.md), pinned down on the CPU.

- A CUDA capture refused every model: AdamW keeps its step counters on the CPU, and the capture
  counted them as the CUDA model's storages made before recording.
- `--fake --device cuda` ran torch's AdamW through its per-tensor loop (a fake tensor is not a type
  torch.optim trusts with foreach kernels) and allocated dropout's output before its mask, where CUDA
  runs foreach and allocates the mask first.
- Replay step times included the time spent digesting every gradient for the bitwise comparison.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.optim.optimizer import _default_to_fused_or_foreach

from memplan.planner.replay.fingerprint import RunPrints
from memplan.planner.replay.runner import run_steps
from memplan.planner.report.trace_text import render_trace
from memplan.planner.workloads import bert
from memplan.traces.capture import capture_step
from memplan.traces.fake import FOREACH_TYPES, FakeCapture
from memplan.traces.recorder import recording
from memplan.traces.summary import summarize
from memplan.traces.workload import Workload


def test_optimizer_state_on_another_device_is_not_the_captured_devices():
    """A tensor the optimizer keeps on another device (here `meta`, as a CUDA AdamW keeps `step` on the CPU)
    is neither an error nor a buffer of the trace."""

    def build():
        torch.manual_seed(0)
        model = nn.Linear(16, 16)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        optimizer.state[model.weight]["elsewhere"] = torch.empty(1000, device="meta")
        return Workload(model, torch.randn(4, 16), optimizer, name="elsewhere")

    trace = capture_step(build)
    assert 4000 not in trace.size.tolist()
    parameter_bytes = sorted(int(s) for s, c in zip(trace.size, trace.category) if c == "parameter")
    assert parameter_bytes == [16 * 4, 16 * 16 * 4]


def test_fake_cuda_tensors_get_the_optimizers_foreach_kernels_only_inside_the_capture():
    with recording(torch.device("cuda"), fake=True) as recorder, FakeCapture(recorder, "cuda"):
        on_cuda, on_cpu = torch.empty(4, device="cuda"), torch.empty(4)
        assert _default_to_fused_or_foreach([on_cuda], False) == (False, True)
        assert _default_to_fused_or_foreach([on_cpu], False) == (False, False)  # the CPU has no foreach kernels
    assert all(t.__name__ != "FakeTensor" for t in FOREACH_TYPES)


def test_fake_cuda_dropout_allocates_the_mask_first_and_claims_only_cuda_storages():
    with recording(torch.device("cuda"), fake=True) as recorder, FakeCapture(recorder, "cuda"):
        x = torch.empty(8, 128, device="cuda")
        recorder.begin_step()
        output, mask = torch.ops.aten.native_dropout(x, 0.1, True)
        torch.ones(3, device="cpu")  # not the CUDA trace's
        events = recorder.end_step()
    assert events.size.tolist() == [8 * 128, 8 * 128 * 4]  # bool mask, then the fp32 output
    assert (output.shape, output.dtype, mask.dtype) == (x.shape, torch.float32, torch.bool)


def test_a_trace_with_measured_cuda_peaks_shows_them_beside_its_own():
    trace = capture_step(lambda: bert.build_workload(2, 16))
    peak = trace.peak()[0]
    trace.meta["cuda_measured"] = {"peak_requested": peak - 512}
    text = render_trace(summarize(trace))
    assert "PyTorch measured the same step's peak at" in text and "+512 bytes from it" in text
    del trace.meta["cuda_measured"]
    assert "PyTorch measured" not in render_trace(summarize(trace))


def test_replay_step_times_leave_out_the_gradient_digests():
    workload = bert.build_workload(2, 16)
    workload.step()
    prints = RunPrints()
    seconds = run_steps(workload, 2, contextlib.nullcontext, prints)
    assert len(prints.grads) == 2 and prints.seconds > 0
    assert all(s > 0 for s in seconds)
