"""memplan's fake FSDP2 trace against PyTorch's own FSDPMemTracker (torch.distributed._tools.fsdp2_mem_tracker) on
the same step: rank 0 of the fake process group, under fake tensors, after a warm-up step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.testing._internal.distributed.fake_pg import FakeStore

from memplan.step import StepSpec
from memplan.traces.inputs.model_file import import_model_file
from memplan.traces.ranks import fake_wrappers

torch.set_num_threads(1)

FSDP2 = str(Path(__file__).resolve().parents[1] / "examples" / "llama_fsdp2.py")
BATCH, SEQ = 2, 32


def tracker_peak(monkeypatch, world: int) -> int:
    """FSDPMemTracker's peak bytes (its "Total" on the CPU) over rank 0's second step of the model file, on the fake
    process group under PyTorch's FakeTensorMode (with memplan's DeviceMesh and DDP answers, as a --fake trace has)."""
    for owner, name, replacement in fake_wrappers.patches():
        monkeypatch.setattr(owner, name, replacement)
    build = import_model_file(FSDP2)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with FakeTensorMode():
            torch.manual_seed(0)
            workload = build(BATCH, SEQ, torch.float32, "cpu")
            workload.step()  # the warm-up step: AdamW's state is made
            tracker = FSDPMemTracker(workload.model, workload.optimizer)
            tracker.track_inputs(workload.inputs if isinstance(workload.inputs, tuple) else (workload.inputs,))
            with tracker:
                workload.step()
    finally:
        dist.destroy_process_group()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def memplan_peak(traced_ranks, world: int) -> int:
    """Rank 0's peak in `memplan trace --nproc world --fake` of the same step (the FSDP2 tests' trace of it, traced
    once: conftest.traced_ranks)."""
    return traced_ranks(StepSpec(FSDP2, BATCH, SEQ, fake=True), world)[0].peak()[0]


@pytest.mark.parametrize(
    ("world", "env"),
    [(2, {}), (4, {}), (2, {"MEMPLAN_FSDP_PRECISION": "bf16"}), (4, {"MEMPLAN_TP": "2"})],
    ids=["fsdp2-2", "fsdp2-4", "bf16-2", "2x2-tp"],
)
def test_peak_equals_fsdp_mem_tracker_s(traced_ranks, monkeypatch, world, env):
    """The issue asks for agreement within FSDPMemTracker's 10%; on the CPU (no allocator rounding in either) the
    two peaks are equal to the byte, in fp32, under FSDP2's bf16 policy and on a 2-D (dp, tp) mesh."""
    monkeypatch.setenv("MEMPLAN_PRESET", "tiny")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    theirs = tracker_peak(monkeypatch, world)
    ours = memplan_peak(traced_ranks, world)
    assert abs(ours - theirs) <= 0.10 * theirs
    assert ours == theirs
