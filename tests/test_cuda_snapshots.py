"""The project's own real CUDA snapshots (tests/data/cuda-snapshots, benchmarks/record_snapshots.py on an H200) against
what this CPU machine predicts: the import against torch.cuda's own counters, the caching-allocator simulator
address by address, and `--fake --device cuda` traces of the same steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memplan.planner.simulate.fidelity import fidelity, recorded_steps
from memplan.planner.simulate.snapshot_check import replay_snapshot
from memplan.traces.distributed import rank_path, trace_ranks
from memplan.traces.format import load
from memplan.traces.snapshot import read_snapshot, snapshot_to_trace
from memplan.traces.trace_model import trace_step

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
RECORDED = {step.name: step for step in recorded_steps(ROOT / "tests" / "data" / "cuda-snapshots", ROOT)}
FAST = {"bert-tiny-fp32", "llama-tiny-bf16-mixed", "tiny-llama-config-fp32"}  # the rest run in the slow lane
# A recorded step whose prediction differs for a reason outside memplan, with the reason.
KNOWN = {
    "hf_llama-tiny-bf16-mixed": "transformers 5.17 (the GPU's) caches the values of a training step's DynamicCache "
    "in fp32, a newer one in the values' bf16: 65,536 B (-0.086%) less at the peak",
    **{
        name: "torch 2.11's flash attention (the GPU's) keeps its philox seed in 8 bytes, torch 2.13's meta function "
        "(the fake trace's) in 16: 8 B more per attention call with dropout"
        for name in ("hf_bert-tiny-bf16-mixed", "hf_gpt2-tiny-bf16-mixed")
    },
}
# Recorded steps whose simulated reserved differs more, with the reason and the bound it stays within.
STREAMS = (
    "FSDP2 all-gathers and reduce-scatters on CUDA streams of their own, whose blocks the caching allocator keeps "
    "apart; a fake trace has one stream (issue 33): one 2 MiB segment fewer"
)
RESERVED_KNOWN = {name: (0.03, STREAMS) for name in ("llama-tiny-fsdp2-fp32", "llama-tiny-fsdp2-bf16")}
PEAK_TOLERANCE = 0.001  # a prediction's peak within 0.1% of the real one (exact but for KNOWN)
RESERVED_TOLERANCE = 0.01  # the simulator's peak reserved on it within 1% of the step's from an emptied cache
IN_ORDER = 0.9  # at least 90% of the real allocations made in the same order with the same size


def lane(names) -> list:
    return [pytest.param(name, marks=() if name in FAST else pytest.mark.slow) for name in names]


def test_there_are_recorded_steps_of_each_kind():
    dtypes = {step.step.dtype for step in RECORDED.values()}
    assert len(RECORDED) >= 20 and dtypes == {"float32", "bfloat16", "bf16-mixed"}
    assert {step.facts["gpu"] for step in RECORDED.values()} == {"NVIDIA H200"}
    assert all(step.snapshot.is_file() for step in RECORDED.values())


@pytest.mark.parametrize("name", lane(RECORDED))
def test_the_imported_snapshot_and_the_simulator_match_torch_s_own_counters(name):
    """The trace of a snapshot peaks at torch.cuda's peak of requested bytes, and the caching-allocator simulator,
    started from the snapshot's segments, returns every address the real allocator did and its peaks."""
    recorded = RECORDED[name]
    snapshot = read_snapshot(recorded.snapshot)
    counted = recorded.facts["recorded_step"]["at_end"]
    assert snapshot_to_trace(snapshot).peak()[0] == counted["requested_peak"]
    replayed = replay_snapshot(snapshot)
    assert replayed.exact, replayed.mismatches[:3]
    assert (replayed.peak_allocated, replayed.peak_reserved) == (counted["allocated_peak"], counted["reserved_peak"])


@pytest.mark.parametrize("name", lane(RECORDED))
def test_a_fake_cuda_trace_here_predicts_the_real_step(name, monkeypatch, tmp_path):
    """`--fake --device cuda` for the GPU the step ran on (a distributed model file on a one-rank fake process
    group, as it ran on a one-rank NCCL one): its peak, the simulator's reserved on it, and the order of its
    allocations against the real step's."""
    recorded = RECORDED[name]
    for variable, value in {
        **recorded.env,
        "CUBLAS_WORKSPACE_CONFIG": recorded.facts["cublas_workspace_config"],
    }.items():
        if value is None:
            monkeypatch.delenv(variable, raising=False)
        else:
            monkeypatch.setenv(variable, value)
    real = snapshot_to_trace(read_snapshot(recorded.snapshot), name)
    if recorded.nproc:
        trace_ranks(recorded.step.replace(fake=True), tmp_path / "rank.json.gz", recorded.nproc)
        predicted = load(rank_path(tmp_path / "rank.json.gz", 0))
    else:
        predicted = trace_step(recorded.step.replace(fake=True))
    result = fidelity(real, predicted, recorded.reserved_from_empty)
    figures = f"peak {result.peak:,} against {result.real_peak:,}; {result.in_order}/{result.allocations} in order"
    if name in KNOWN:
        assert result.peak != result.real_peak, f"{name} is exact now: drop it from KNOWN ({KNOWN[name]})"
    else:
        assert result.peak == result.real_peak, figures
    assert abs(result.peak_error) <= PEAK_TOLERANCE, figures
    tolerance = RESERVED_KNOWN.get(name, (RESERVED_TOLERANCE, ""))[0]
    assert abs(result.reserved_error) <= tolerance, f"reserved {result.reserved_error:+.3%}"
    assert result.in_order_share >= IN_ORDER, figures
