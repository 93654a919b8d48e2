"""FSDP2 over tensor parallelism on a 2-D DeviceMesh (examples/llama_fsdp2.py with MEMPLAN_TP): each rank's trace on
the fake process group against the same program on real gloo ranks, and the 2-D sharding's arithmetic."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from step_traces import comparable, first_difference, state_bytes

from memplan.planner.workloads.llama import PRESETS, Llama
from memplan.step import StepSpec
from memplan.traces.format import Trace
from memplan.traces.ranks.launch import RankError, trace_ranks

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
FSDP2 = str(ROOT / "examples" / "llama_fsdp2.py")
COLUMNS = ("attention.q", "attention.k", "attention.v", "mlp.gate", "mlp.up")  # split by output rows over tp
ROWS = ("attention.o", "mlp.down")  # split by input columns over tp
SCALARS = 16  # bytes of CPU scalars a gloo rank may hold beside the fake rank's buffers


def ranks(traced_ranks, nproc: int, fake: bool) -> list[Trace]:
    """Each rank's trace of the 2-D step on `nproc` ranks: fake (one process) or real gloo processes, traced once for
    the tests that read it (conftest.traced_ranks)."""
    return traced_ranks(StepSpec(FSDP2, 2, 32, fake=fake), nproc)


def shard_bytes(model: torch.nn.Module, dp: int, tp: int) -> int:
    """A rank's parameter bytes: 1/tp of each tensor-parallel weight (rows or columns), then FSDP2's 1/dp of that along
    its first dimension, padded to equal shards; the replicated ones 1/dp only."""
    total = 0
    for name, p in model.named_parameters():
        rows, columns = p.shape[0], p.numel() // p.shape[0]
        if name.endswith(tuple(f"{n}.weight" for n in COLUMNS)):
            rows //= tp
        elif name.endswith(tuple(f"{n}.weight" for n in ROWS)):
            columns //= tp
        total += math.ceil(rows / dp) * columns * p.element_size()
    return total


def gradient_bytes_at_optimizer(trace: Trace) -> int:
    """Bytes the backward allocated that are alive when the optimizer step begins: FSDP2's sharded gradients, views
    of its reduce-scatter outputs (category temporary: see docs/parallel.md's "Not yet")."""
    start = min(int(a) for a, phase in zip(trace.alloc, trace.phase) if a > 0 and phase == "optimizer")
    alive = [i for i in range(len(trace)) if 0 < trace.alloc[i] < start <= trace.free[i]]
    return sum(int(trace.size[i]) for i in alive if trace.phase[i] == "backward")


@pytest.mark.parametrize(("world", "tp"), [(4, 2), (8, 2)])
def test_ranks_hold_the_2d_sharding_s_bytes(traced_ranks, monkeypatch, world, tp):
    """Every rank's parameters and gradients are its shards of the (dp, tp) sharding, AdamW's state twice that plus
    one step counter a parameter; the ranks are alike."""
    monkeypatch.setenv("MEMPLAN_PRESET", "tiny")
    monkeypatch.setenv("MEMPLAN_TP", str(tp))
    model = Llama(PRESETS["tiny"])
    shards = shard_bytes(model, world // tp, tp)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    counters = 4 * len(list(model.parameters()))
    traces = ranks(traced_ranks, world, fake=True)
    for trace in traces:
        alive = state_bytes(trace)
        assert alive["parameter"] == shards + buffers
        assert alive["optimizer"] == 2 * shards + counters
        assert gradient_bytes_at_optimizer(trace) == shards
    assert len({trace.peak()[0] for trace in traces}) == 1


def test_tp_splits_what_fsdp_alone_does_not(traced_ranks, monkeypatch):
    """At 4 ranks, 2 x 2 holds more parameter bytes a rank than FSDP2 over 4 (the embedding, norms and head are
    sharded over 2 only), by exactly the two shardings' difference."""
    monkeypatch.setenv("MEMPLAN_PRESET", "tiny")
    model = Llama(PRESETS["tiny"])
    monkeypatch.setenv("MEMPLAN_TP", "2")
    two_d = ranks(traced_ranks, 4, fake=True)[0]
    monkeypatch.setenv("MEMPLAN_TP", "1")
    one_d = ranks(traced_ranks, 4, fake=True)[0]
    assert state_bytes(two_d)["parameter"] > state_bytes(one_d)["parameter"]
    assert state_bytes(one_d)["parameter"] - state_bytes(two_d)["parameter"] == shard_bytes(model, 4, 1) - shard_bytes(
        model, 2, 2
    )


@pytest.mark.slow
def test_fake_ranks_equal_gloo_ranks_buffer_for_buffer(traced_ranks, monkeypatch):
    """2 x 2 on four gloo processes and on the fake process group: every rank holds the same buffers when the step
    begins and allocates the same ones in the same order with the same sizes and labels, tensor parallelism's
    all-reduces included (gloo's reduce-scatter buffers and CPU scalars aside); every buffer no collective works on
    is freed at the same point with the same category. When a gloo rank frees a collective's buffer depends on
    gloo's threads (an all-reduce's clone or a reduce-scatter's input may outlive its step on a loaded machine); the
    fake peak is never above the real one (CPU scalars aside)."""
    monkeypatch.setenv("MEMPLAN_PRESET", "tiny")
    monkeypatch.setenv("MEMPLAN_TP", "2")
    fake, real = ranks(traced_ranks, 4, fake=True), ranks(traced_ranks, 4, fake=False)
    for predicted, measured in zip(fake, real):
        fake, gloo = comparable(predicted), comparable(measured, gloo=True)
        assert fake == gloo, first_difference(fake, gloo)
        assert predicted.peak()[0] <= measured.peak()[0] + SCALARS


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MEMPLAN_TP": "3"}, "MEMPLAN_TP=3 does not divide the 4 ranks"),
        ({"MEMPLAN_TP": "4"}, "MEMPLAN_TP=4 does not divide the 2 kv heads"),
        ({"MEMPLAN_TP": "0"}, "MEMPLAN_TP='0' is not a whole number of at least 1"),
        ({"MEMPLAN_LAYERS": "two"}, "MEMPLAN_LAYERS='two' is not a whole number"),
    ],
)
def test_bad_settings_are_one_line(tmp_path, monkeypatch, env, message):
    """MEMPLAN_TP must divide the ranks, the heads and the kv heads; MEMPLAN_TP and MEMPLAN_LAYERS are whole numbers.
    Nothing is written."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RankError, match=message):
        trace_ranks(StepSpec(FSDP2, 2, 16, fake=True), tmp_path / "t.json.gz", 4)
    assert not list(tmp_path.glob("*.json.gz"))
