"""A user's own FSDP2 and DDP programs traced on the fake process group under fake tensors
(traces/ranks/fake_wrappers.py): each rank's trace against the same program on real gloo ranks, and the sharding's
arithmetic."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from step_traces import state_bytes

from memplan.errors import MemplanError
from memplan.planner.problem import problem_from_trace
from memplan.planner.simulate.fidelity import reproduced, sizes_in_order
from memplan.planner.verify import verify_plan
from memplan.planner.workloads.llama import PRESETS, Llama
from memplan.solvers import solve
from memplan.step import StepSpec
from memplan.traces.ranks.family import traces_by_rank
from memplan.traces.ranks.launch import trace_ranks

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
FSDP2 = str(ROOT / "examples" / "llama_fsdp2.py")
DDP = str(ROOT / "examples" / "gpt2_ddp.py")
# gloo's ranks hold CPU scalars (DTensor's wrapped Python numbers) a fake trace leaves out: a few bytes at the peak
SCALARS = 16


def ranks(model_file: str, nproc: int, traced_ranks, fake: bool, seq: int = 32):
    """Each rank's trace of the model file's step on `nproc` ranks: fake (one process) or real gloo processes, traced
    once for the tests that read it (conftest.traced_ranks: the sharding's bytes and the gloo comparison read the
    same fake FSDP2 ranks)."""
    return traced_ranks(StepSpec(model_file, 2, seq, fake=fake), nproc)


def known(alive: dict[str, int]) -> dict[str, int]:
    return {category: size for category, size in alive.items() if category != "unknown"}


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_ranks_hold_the_sharding_s_bytes(traced_ranks, monkeypatch, world):
    """Each rank's parameters are 1/N of each parameter, padded to equal shards (plus the unsharded rotary buffer),
    and AdamW's state twice that plus one step counter a parameter."""
    monkeypatch.setenv("MEMPLAN_PRESET", "tiny")
    model = Llama(PRESETS["tiny"])
    shards = sum(
        math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) * p.element_size() for p in model.parameters()
    )
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    counters = 4 * len(list(model.parameters()))  # fp32 step counters, on the CPU beside CPU parameters
    traces = ranks(FSDP2, world, traced_ranks, fake=True)
    for trace in traces:
        alive = state_bytes(trace)
        assert alive["parameter"] == shards + buffers
        assert alive["optimizer"] == 2 * shards + counters
    assert len({trace.peak()[0] for trace in traces}) == 1  # FSDP's ranks are alike


@pytest.mark.slow
@pytest.mark.parametrize("model_file", [FSDP2, DDP], ids=["fsdp2", "ddp"])
def test_fake_ranks_match_gloo_ranks(traced_ranks, monkeypatch, model_file):
    """The same program on two real gloo processes and on the fake process group: the same state when the step
    begins, every allocation of the fake rank made, in order and with its size, by the real one (which also holds
    gloo's own staging buffers), and the fake peak never above the real one (gloo's CPU scalars aside). The real
    peaks move from run to run: gloo's ranks finish a reduce-scatter or an all-reduce when their threads do, so
    FSDP2 may still hold a step's reduce-scatter buffers when the next begins, and DDP a bucket (925 KB more on a
    loaded machine, equal when idle); on NCCL (tests/test_cuda_snapshots.py) the
    fake FSDP2 and DDP ranks' peaks equal the real ones."""
    monkeypatch.setenv("MEMPLAN_PRESET", "tiny")
    fake, real = ranks(model_file, 2, traced_ranks, fake=True), ranks(model_file, 2, traced_ranks, fake=False)
    for predicted, measured in zip(fake, real):
        # gloo's held buffers aside: unnamed, what gloo's threads have not released when the step begins (a DDP
        # bucket its rebuild replaced); the buckets it keeps are named (communication) on both
        assert known(state_bytes(predicted)) == known(state_bytes(measured))
        fake_sizes = sizes_in_order(predicted)
        assert reproduced(sizes_in_order(measured), fake_sizes) == len(fake_sizes)
        assert predicted.peak()[0] <= measured.peak()[0] + SCALARS


def test_fsdp2_fake_cuda_ranks(tmp_path, monkeypatch):
    """--fake --device cuda: the ranks run in turn on this process's one (fake) CUDA device, so FSDP2 finds every
    rank's parameters on the device its mesh names (rank 1 included), and the ranks hold the same shards."""
    monkeypatch.setenv("MEMPLAN_PRESET", "tiny")
    output = tmp_path / "fsdp2.json.gz"
    trace_ranks(StepSpec(FSDP2, 2, 16, fake=True, device="cuda"), output, 2)
    traces = traces_by_rank(output)
    assert state_bytes(traces[0]) == state_bytes(traces[1])
    for trace in traces:
        fsdp_streams_are_in_the_trace(trace)


def fsdp_streams_are_in_the_trace(trace):
    """FSDP2's all-gather and reduce-scatter run on streams of their own, ordered with the default stream by its
    waits and events: the all-gather outputs on the copy-in stream (allocated under it), the reduce-scatter outputs
    on the reduce-scatter stream, syncs both ways between each and the default stream; the plan that reuses bytes
    across streams through them verifies, and with the syncs dropped the same plan is refused."""
    names = {name: int(s) for s, name in trace.meta["streams"].items() if name != "ordering"}
    assert set(names) == {"default", "fsdp all-gather copy-in", "fsdp all-gather", "fsdp reduce-scatter"}
    copy_in, gather, scatter = (names[f"fsdp {n}"] for n in ("all-gather copy-in", "all-gather", "reduce-scatter"))
    on = {s: [op for op, t in zip(trace.op, trace.stream.tolist()) if t == s] for s in names.values()}
    assert on[copy_in] and set(on[copy_in]) == {"all_gather"} and on[scatter] and not on[gather]
    pairs = {(a, b) for _, a, b in trace.syncs}
    assert {(0, copy_in), (gather, 0), (0, scatter), (scatter, 0)} <= pairs
    problem = problem_from_trace(trace)
    plan = solve(problem, time_limit=5)
    verify_plan(problem, plan.offsets, plan.arena)
    unsynced = replace(trace, syncs=[])
    with pytest.raises(MemplanError):
        verify_plan(problem_from_trace(unsynced), plan.offsets, plan.arena)


def test_a_mesh_made_from_a_fake_tensor_is_refused(tmp_path):
    """A DeviceMesh given a tensor built under fake tensors has no rank numbers to read: a clear error."""
    model_file = tmp_path / "mesh.py"
    model_file.write_text(
        "import torch\nfrom torch.distributed.device_mesh import DeviceMesh\n"
        "from memplan.planner.workloads.llama import PRESETS, build_workload\n"
        "def build(batch_size, seq_len, dtype, device):\n"
        "    DeviceMesh('cpu', torch.arange(2))\n"
        "    return build_workload(batch_size, seq_len, dtype, device, config=PRESETS['tiny'])\n"
    )
    with pytest.raises(Exception, match="its rank numbers are unknown"):
        trace_ranks(StepSpec(str(model_file), 2, 16, fake=True), tmp_path / "t.json.gz", 2)


def test_a_torch_without_the_pipeline_warm_up_hook_still_traces_fake_ranks(tmp_path, monkeypatch):
    """torch 2.11 (the lent GPUs') has no _PipelineSchedule._warmup_p2p, which the fake process group wraps for torch
    2.13's pipelines: an FSDP2 or DDP program still traces there (it failed on every model file before)."""
    from torch.distributed.pipelining.schedules import _PipelineSchedule

    monkeypatch.delattr(_PipelineSchedule, "_warmup_p2p")
    monkeypatch.setenv("MEMPLAN_PRESET", "tiny")
    output = tmp_path / "fake" / "trace.json.gz"  # traced here, under the patch: not the session's shared traces
    trace_ranks(StepSpec(DDP, 2, 32, fake=True), output, 1)
    assert traces_by_rank(output)[0].peak()[0] > 0
