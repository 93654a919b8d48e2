"""ZeRO-1 (examples/gpt2_ddp.py with MEMPLAN_DDP_OPTIMIZER=zero: DDP and ZeroRedundancyOptimizer over AdamW) on the
fake process group and on gloo, and the buffers traced as `communication`: DDP's gradient buckets, FSDP2's
all-gather and reduce-scatter buffers (traces/ranks/communication.py)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from step_traces import buffer_events, state_bytes

from memplan.planner.workloads.gpt2 import GPT2, PRESETS
from memplan.step import StepSpec
from memplan.traces.format import Trace
from memplan.traces.ranks.launch import RankError, trace_ranks

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
DDP = str(ROOT / "examples" / "gpt2_ddp.py")
FSDP2 = str(ROOT / "examples" / "llama_fsdp2.py")
SCALARS = 16  # bytes of CPU scalars (internal) a gloo rank may hold at its peak beside the fake rank's buffers
STEP_COUNTER = 4  # AdamW's step counter: one fp32 scalar a parameter, beside CPU parameters


def ranks(model_file: str, nproc: int, traced_ranks, fake: bool, seq: int = 32) -> list[Trace]:
    """Each rank's trace of the model file's step on `nproc` ranks: fake (one process) or real gloo processes,
    traced once for the tests that read it (conftest.traced_ranks)."""
    return traced_ranks(StepSpec(model_file, 2, seq, fake=fake), nproc)


def zero_partition(world: int) -> list[list[torch.nn.Parameter]]:
    """ZeroRedundancyOptimizer's partition, computed here: the parameters whole, largest first (a stable sort), each
    to the rank holding the fewest elements so far (the lowest such rank)."""
    params = list(GPT2(PRESETS["tiny"]).parameters())
    held, parts = [0] * world, [[] for _ in range(world)]
    for p in sorted(params, key=lambda p: p.numel(), reverse=True):
        rank = held.index(min(held))
        parts[rank].append(p)
        held[rank] += p.numel()
    return parts


def communication(trace: Trace) -> list[tuple[int, str, str, int, int]]:
    """(size, op, phase, alloc, free) of every communication buffer."""
    return [
        (int(trace.size[i]), trace.op[i], trace.phase[i], int(trace.alloc[i]), int(trace.free[i]))
        for i in range(len(trace))
        if trace.category[i] == "communication"
    ]


def same_buffers(fake: Trace, real: Trace) -> None:
    """The fake rank equals the gloo rank buffer for buffer: the same buffers alive when the step begins (the gloo
    rank made its DDP bucket later, rebuilding it in the second warm-up step: compared as a multiset), the same
    allocations and frees in the same order with the same sizes and labels (gloo's own buffers aside: internal),
    and the same peak but for the gloo rank's CPU scalars. The gloo rank may also hold, unnamed, what one of gloo's
    threads has not yet released when the step begins (the bucket its rebuild replaced, a 4-byte index of it), freed
    when that thread lets go: the only buffers it holds beyond the fake rank's, and its peak is within them."""
    start_fake, start_real = (sum(1 for a in t.alloc if a == 0) for t in (fake, real))
    predicted, measured = buffer_events(fake), buffer_events(real)
    at_start, at_start_real = Counter(predicted[:start_fake]), Counter(measured[:start_real])
    assert not at_start - at_start_real
    leftovers = at_start_real - at_start
    assert all(category == "unknown" for (*_, category) in leftovers)
    released = [e for e in measured[start_real:] if e[0] < 0 and (-e[0], *e[1:]) in leftovers]
    assert predicted[start_fake:] == [e for e in measured[start_real:] if e not in released]
    held = sum(size * count for (size, *_), count in leftovers.items())
    assert fake.peak()[0] <= real.peak()[0] <= fake.peak()[0] + SCALARS + held


@pytest.mark.parametrize("world", [2, 4])
def test_zero_ranks_hold_their_partition_s_adamw_state(traced_ranks, monkeypatch, world):
    """Each ZeRO-1 rank holds AdamW's two moments for its own partition of the parameters and a step counter per
    parameter of it, to the byte (ranks may differ); every rank holds all the parameters and DDP's one bucket."""
    monkeypatch.setenv("MEMPLAN_DDP_OPTIMIZER", "zero")
    parts = zero_partition(world)
    everything = sum(p.numel() * p.element_size() for part in parts for p in part)
    traces = ranks(DDP, world, traced_ranks, fake=True)
    for rank, trace in enumerate(traces):
        alive = state_bytes(trace)
        owned = sum(p.numel() * p.element_size() for p in parts[rank])
        assert alive["optimizer"] == 2 * owned + STEP_COUNTER * len(parts[rank])
        assert alive["parameter"] == everything
        assert alive["communication"] == everything  # tiny's gradients fit DDP's first bucket
        assert "unknown" not in alive
    assert sum(state_bytes(trace)["optimizer"] for trace in traces) == 2 * everything + STEP_COUNTER * sum(
        map(len, parts)
    )


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_zero_fake_ranks_equal_gloo_ranks(traced_ranks, monkeypatch, world):
    """ZeRO-1 on real gloo processes and on the fake process group: every rank equal buffer for buffer. The fake
    process group's broadcasts of the updated parameters from their owners move nothing (the parameters are updated
    in place: no buffer depends on their values)."""
    monkeypatch.setenv("MEMPLAN_DDP_OPTIMIZER", "zero")
    fake, real = ranks(DDP, world, traced_ranks, fake=True), ranks(DDP, world, traced_ranks, fake=False)
    for predicted, measured in zip(fake, real):
        same_buffers(predicted, measured)


@pytest.mark.slow
def test_ddp_fake_ranks_equal_gloo_ranks(traced_ranks, monkeypatch):
    """Plain DDP (AdamW on every rank) on two gloo processes and on the fake process group: equal buffer for
    buffer, the bucket labelled on both."""
    monkeypatch.delenv("MEMPLAN_DDP_OPTIMIZER", raising=False)
    fake, real = ranks(DDP, 2, traced_ranks, fake=True), ranks(DDP, 2, traced_ranks, fake=False)
    for predicted, measured in zip(fake, real):
        same_buffers(predicted, measured)
        buckets = [(size, op, phase) for size, op, phase, *_ in communication(predicted)]
        assert buckets == [(size, op, phase) for size, op, phase, *_ in communication(measured)] != []
        assert all(alloc == 0 and free == measured.end for *_, alloc, free in communication(measured))


def test_ddp_buckets_are_communication(traced_ranks, monkeypatch):
    """DDP's gradient bucket is `communication`, op `all_reduce`, alive through the whole step (the reducer keeps it
    across steps): the gradients' bytes."""
    monkeypatch.delenv("MEMPLAN_DDP_OPTIMIZER", raising=False)
    everything = sum(p.numel() * p.element_size() for p in GPT2(PRESETS["tiny"]).parameters())
    for trace in ranks(DDP, 2, traced_ranks, fake=True):
        assert communication(trace) == [(everything, "all_reduce", "other", 0, trace.end)]
        assert "unknown" not in state_bytes(trace)


def test_fsdp2_collective_buffers_are_communication(traced_ranks, monkeypatch):
    """FSDP2's all-gather outputs (forward, and again in the backward for the layers it resharded) and reduce-scatter
    inputs (backward) are `communication`, op naming the collective, each freed within the step; the reduce-scatter
    outputs FSDP2 keeps as the sharded gradients are gradients, half the input's bytes on two ranks."""
    monkeypatch.setenv("MEMPLAN_PRESET", "tiny")
    for trace in ranks(FSDP2, 2, traced_ranks, fake=True):
        buffers = communication(trace)
        gathers = [b for b in buffers if b[1] == "all_gather"]
        scatters = [b for b in buffers if b[1] == "reduce_scatter"]
        assert len(gathers) + len(scatters) == len(buffers)
        assert {b[2] for b in gathers} == {"forward", "backward"} and {b[2] for b in scatters} == {"backward"}
        assert all(0 < alloc < free < trace.end for _, _, _, alloc, free in buffers)
        gradients = sorted(int(s) for s, c in zip(trace.size, trace.category) if c == "gradient")
        assert gradients == sorted(size // 2 for size, *_ in scatters)


@pytest.mark.slow
def test_fsdp2_collective_buffers_are_communication_on_gloo_too(traced_ranks, monkeypatch):
    """The same FSDP2 program on two gloo processes: the same collective buffers, in the same order, with the same
    sizes, collectives and phases as on the fake process group."""
    monkeypatch.setenv("MEMPLAN_PRESET", "tiny")
    fake, real = ranks(FSDP2, 2, traced_ranks, fake=True), ranks(FSDP2, 2, traced_ranks, fake=False)
    for predicted, measured in zip(fake, real):
        labels = [(size, op, phase) for size, op, phase, *_ in communication(predicted)]
        assert labels == [(size, op, phase) for size, op, phase, *_ in communication(measured)]
        assert len(labels) == 8


def test_a_bad_optimizer_setting_is_one_line(tmp_path, monkeypatch):
    """MEMPLAN_DDP_OPTIMIZER names adamw or zero: anything else is refused with one line, nothing written."""
    monkeypatch.setenv("MEMPLAN_DDP_OPTIMIZER", "sgd")
    with pytest.raises(RankError, match="MEMPLAN_DDP_OPTIMIZER='sgd' is not one of adamw, zero"):
        trace_ranks(StepSpec(DDP, 2, 16, fake=True), tmp_path / "t.json.gz", 2)
    assert not list(tmp_path.glob("*.json.gz"))
