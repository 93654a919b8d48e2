"""Pipeline parallelism (examples/llama_pipeline.py, planner/parallel/pipeline.py): each rank's trace on the fake
process group against the same program on real gloo ranks, and the micro-batches each schedule keeps in flight."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from step_traces import buffer_events, comparable, first_difference, unfreed_collective_buffers

from memplan.step import StepSpec
from memplan.traces.format import Trace, load
from memplan.traces.ranks.launch import RankError, rank_path, trace_ranks

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = str(ROOT / "examples" / "llama_pipeline.py")
SEQ = 16
SCALARS = 16  # bytes of CPU scalars (internal) a gloo rank may hold at its peak beside the fake rank's buffers


def ranks(traced_ranks, nproc: int, batch: int, fake: bool) -> list[Trace]:
    """Each rank's trace of the pipelined step on `nproc` ranks: fake (one process) or real gloo processes, traced
    once for the tests that read it (conftest.traced_ranks). The tests' Llama is short (MEMPLAN_LAYERS, set by each
    test): two layers a stage, or one for the interleaved one."""
    return traced_ranks(StepSpec(PIPELINE, batch, SEQ, fake=fake), nproc)


def activations_in_flight(trace: Trace) -> int:
    """Activation bytes the stage holds when its first backward begins."""
    first_backward = min(int(a) for a, phase in zip(trace.alloc, trace.phase) if a > 0 and phase == "backward")
    activations = [i for i in range(len(trace)) if trace.category[i] == "activation"]
    return sum(int(trace.size[i]) for i in activations if trace.alloc[i] < first_backward <= trace.free[i])


def in_flight(trace: Trace, microbatches: int) -> float:
    """Micro-batches whose activations the stage holds when its first backward begins: the bytes then over one
    micro-batch's activation bytes (every micro-batch's forward keeps the same: the step's total over their number)."""
    total = sum(int(size) for size, category in zip(trace.size, trace.category) if category == "activation")
    return activations_in_flight(trace) / (total / microbatches)


def receive_buffers(trace: Trace) -> list[int]:
    """Sizes of the P2P receive buffers, all alive from before the step to its end."""
    received = [i for i in range(len(trace)) if trace.category[i] == "communication"]
    assert all(trace.alloc[i] == 0 and trace.free[i] == trace.end for i in received)
    return [int(trace.size[i]) for i in received]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_fake_ranks_equal_gloo_ranks_buffer_for_buffer(traced_ranks, monkeypatch, world):
    """A 1F1B pipeline of 4 micro-batches on real gloo processes and on the fake process group: every rank holds the
    same buffers when the step begins and allocates and frees the same ones, in the same order, with the same sizes
    and labels (gloo's staging buffers, kernels' scratch and CPU scalars aside: internal), so the peaks are equal
    but for those scalars. Stage k keeps world - k micro-batches in flight, stage 0 the most. A Llama of 4 layers:
    two a stage at 2 ranks (the step test_a_schedule_s_micro_batches_in_flight reads: traced once), one at 4 (the
    micro-batches a stage holds do not depend on its layers)."""
    fake = same_on_gloo(traced_ranks, monkeypatch, "1f1b", world, layers=4, microbatches=4)
    assert [in_flight(trace, 4) for trace in fake] == [world - k for k in range(world)]
    assert activations_in_flight(fake[0]) > max(activations_in_flight(trace) for trace in fake[1:])


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "layers"), [("gpipe", 4), ("interleaved-1f1b", 4)])
def test_other_schedules_equal_gloo_ranks(traced_ranks, monkeypatch, schedule, layers):
    """GPipe and interleaved 1F1B (two stages a rank) on two ranks, four micro-batches: the fake ranks equal the gloo
    ranks buffer for buffer too."""
    same_on_gloo(traced_ranks, monkeypatch, schedule, 2, layers=layers, microbatches=4)


@pytest.mark.slow
def test_pp_fsdp_fake_ranks_equal_gloo_ranks(traced_ranks, monkeypatch):
    """2 stages x FSDP2 over 2 (a ("pp", "dp") mesh of 4), 1F1B over 2 micro-batches, on four gloo processes and on
    the fake process group: every rank allocates the same buffers in the same order with the same sizes and labels
    and frees every buffer no collective holds at the same point (gloo's reduce-scatter buffers and CPU scalars
    aside), so the two ranks of a stage agree. Each all-gather output and reduce-scatter input is freed within the
    step on both: a gloo worker thread that drops the last reference to one frees it later than the program did,
    and the recorder sees that free too (it had kept such a buffer alive to the step's end, 184,832 B on one rank of
    a stage). The fake peak is never above the gloo one."""
    monkeypatch.setenv("MEMPLAN_DP", "2")
    monkeypatch.setenv("MEMPLAN_MICROBATCHES", "2")
    monkeypatch.setenv("MEMPLAN_LAYERS", "4")
    fake, real = ranks(traced_ranks, 4, 2, fake=True), ranks(traced_ranks, 4, 2, fake=False)
    for predicted, measured in zip(fake, real):
        fake, gloo = comparable(predicted), comparable(measured, gloo=True)
        assert fake == gloo, first_difference(fake, gloo)
        assert unfreed_collective_buffers(predicted) == unfreed_collective_buffers(measured) == []
        assert predicted.peak()[0] <= measured.peak()[0]


def same_on_gloo(traced_ranks, monkeypatch, schedule: str, world: int, layers: int, microbatches: int) -> list[Trace]:
    """The fake ranks' traces of the schedule's step (batch = micro-batches), each asserted equal to the gloo rank's
    buffer for buffer, its peak within the gloo rank's CPU scalars."""
    monkeypatch.setenv("MEMPLAN_PIPELINE_SCHEDULE", schedule)
    monkeypatch.setenv("MEMPLAN_MICROBATCHES", str(microbatches))
    monkeypatch.setenv("MEMPLAN_LAYERS", str(layers))
    fake = ranks(traced_ranks, world, microbatches, fake=True)
    real = ranks(traced_ranks, world, microbatches, fake=False)
    for predicted, measured in zip(fake, real):
        assert buffer_events(predicted) == buffer_events(measured)
        assert predicted.peak()[0] <= measured.peak()[0] <= predicted.peak()[0] + SCALARS
    return fake


@pytest.mark.parametrize(("schedule", "held"), [("1f1b", [2, 1]), ("gpipe", [4, 4])])
def test_a_schedule_s_micro_batches_in_flight(traced_ranks, monkeypatch, schedule, held):
    """Two stages, four micro-batches: 1F1B's first stage holds min(stages, micro-batches) micro-batches' activations
    when its first backward begins, the last stage one; GPipe's stages hold all four. Stage 0 holds more than the
    last stage under 1F1B, and every stage holds one receive buffer per micro-batch (activations from the previous
    stage, gradients from the next: (batch / micro-batches) x seq x hidden fp32 each)."""
    monkeypatch.setenv("MEMPLAN_PIPELINE_SCHEDULE", schedule)
    monkeypatch.setenv("MEMPLAN_MICROBATCHES", "4")
    monkeypatch.setenv("MEMPLAN_LAYERS", "4")
    traces = ranks(traced_ranks, 2, 4, fake=True)
    assert [in_flight(trace, 4) for trace in traces] == held
    for trace in traces:
        assert receive_buffers(trace) == [1 * SEQ * 64 * 4] * 4
    if schedule == "1f1b":  # the stages' traces differ: stage 0 holds more, though the last holds the logits too
        assert activations_in_flight(traces[0]) > activations_in_flight(traces[1])


@pytest.mark.slow
def test_interleaved_1f1b_runs_two_stages_a_rank(traced_ranks, monkeypatch):
    """Interleaved 1F1B: each rank of two holds two stages (rank r stages r and r + 2) and their receive buffers;
    its stages' calls are forwards, so their saved tensors are activations."""
    monkeypatch.setenv("MEMPLAN_PIPELINE_SCHEDULE", "interleaved-1f1b")
    monkeypatch.setenv("MEMPLAN_MICROBATCHES", "4")
    monkeypatch.setenv("MEMPLAN_LAYERS", "4")
    traces = ranks(traced_ranks, 2, 4, fake=True)
    for trace in traces:
        assert {"model.0.layers.0", "model.1.layers.0"} <= set(trace.module)
        assert len(receive_buffers(trace)) == 3 * 4  # two stages' 4 activations and 4 gradients, less an end's 4
        assert in_flight(trace, 4) > 1
    assert "model.0.embed" in traces[0].module and "model.1.head" in traces[1].module


@pytest.mark.parametrize(
    ("env", "batch", "message"),
    [
        ({"MEMPLAN_PIPELINE_SCHEDULE": "zb"}, 4, "MEMPLAN_PIPELINE_SCHEDULE='zb' is not one of"),
        ({"MEMPLAN_MICROBATCHES": "3"}, 4, "batch 4 does not split into 3 equal micro-batches"),
        ({"MEMPLAN_MICROBATCHES": "1"}, 1, "1f1b needs at least as many micro-batches as pipeline ranks"),
        ({"MEMPLAN_LAYERS": "1"}, 4, "1 layers cannot fill 2 pipeline stages"),
        ({"MEMPLAN_DP": "3"}, 4, "3 data-parallel ranks a stage do not divide the 2 ranks"),
        ({"MEMPLAN_DP": "0"}, 4, "MEMPLAN_DP='0' is not a whole number of at least 1"),
    ],
)
def test_bad_settings_are_one_line(tmp_path, monkeypatch, env, batch, message):
    """A schedule it does not know, a batch that does not split, too few micro-batches for 1F1B or layers for the
    stages, a data-parallel size that does not divide the ranks: one line."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RankError, match=message):
        trace_ranks(StepSpec(PIPELINE, batch, SEQ, fake=True), tmp_path / "t.json.gz", 2)
    assert not list(tmp_path.glob("*.json.gz"))


def test_a_stage_without_its_shapes_is_refused_under_fake(tmp_path):
    """A PipelineStage given no input_args/output_args must be sent its neighbours' shapes, which the fake process
    group cannot do: a clear error, not a failure inside torch."""
    model_file = tmp_path / "pp.py"
    model_file.write_text(
        "import torch\n"
        "import torch.distributed as dist\n"
        "from torch.distributed.pipelining import PipelineStage, ScheduleGPipe\n"
        "from memplan.planner.parallel.pipeline import PipelineWorkload\n"
        "def build(batch_size, seq_len, dtype, device):\n"
        "    model = torch.nn.Linear(8, 8)\n"
        "    stage = PipelineStage(model, dist.get_rank(), dist.get_world_size(), torch.device(device))\n"
        "    schedule = ScheduleGPipe(stage, 2, loss_fn=lambda out, y: out.sum())\n"
        "    return PipelineWorkload(model=model, inputs=(torch.ones(2, 8),), targets=torch.ones(2, 8),\n"
        "        optimizer=torch.optim.SGD(model.parameters()), schedule=schedule, stages=[stage])\n"
    )
    with pytest.raises(RankError, match="pipeline stage 0 was given no input_args and output_args"):
        trace_ranks(StepSpec(str(model_file), 2, SEQ, fake=True), tmp_path / "t.json.gz", 2)


def test_fake_cuda_ranks(tmp_path, monkeypatch):
    """--fake --device cuda: every rank runs in turn on this process's one (fake) CUDA device, rank 1 included; its
    receive buffers are on the device."""
    monkeypatch.setenv("MEMPLAN_MICROBATCHES", "2")
    monkeypatch.setenv("MEMPLAN_LAYERS", "2")
    output = tmp_path / "cuda.json.gz"
    trace_ranks(StepSpec(PIPELINE, 2, SEQ, fake=True, device="cuda"), output, 2)
    for rank in range(2):
        trace = load(rank_path(output, rank))
        assert trace.meta["device"] == "cuda" and trace.meta["rank"] == rank
        assert len(receive_buffers(trace)) == 2
