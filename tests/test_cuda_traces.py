"""The project's own real CUDA traces (tests/data/cuda-traces: `memplan trace --device cuda` on an H200, see the
folder's README.md) against `--fake --device cuda` traced here: the actions and the NCCL ranks that the snapshots of
tests/data/cuda-snapshots do not cover (activation offload's host copies, the 8-bit optimizer's state, DDP's and
FSDP2's communication buffers, and FSDP2's streams and their orderings as the real recorder saw them)."""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from step_traces import bytes_by_category, off_default_sizes

from memplan.planner.simulate.fidelity import reproduced, sizes_in_order
from memplan.step import StepSpec
from memplan.traces.cuda.streams import RELAY
from memplan.traces.format import Trace, load
from memplan.traces.inputs.trace_model import trace_step
from memplan.traces.ranks.launch import rank_path, trace_ranks

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "tests" / "data" / "cuda-traces"
TRACES = sorted(path.name.removesuffix(".json.gz") for path in FOLDER.glob("*.json.gz"))
# the share of the real allocations a fake trace makes in the same order with the same size: the rest are CUDA
# kernels' own scratch (cuBLAS's copy of a stride-0 operand, the quantized optimizer's reductions) no op returns
IN_ORDER = 0.85


def fake_twin(real: Trace, monkeypatch) -> Trace:
    """The real trace's step (its model file, shape, dtype, layer mode and optimizer) traced here under fake CUDA
    tensors for the H200 it ran on; a one-rank NCCL step on a one-rank fake process group."""
    meta = real.meta
    monkeypatch.setenv("MEMPLAN_PRESET", "tiny")
    step = StepSpec(
        str(ROOT / "examples" / Path(meta["model_file"]).name),
        batch=meta["batch"],
        seq=meta["seq"],
        dtype=meta["dtype"],
        device="cuda",
        mode=meta["layers"],
        optimizer=meta["optimizer_choice"],
        fake=True,
        gpu="H200",
    )
    if meta.get("world_size") is None:
        return trace_step(step)
    with tempfile.TemporaryDirectory() as folder:
        trace_ranks(step, Path(folder) / "rank.json.gz", meta["world_size"])
        return load(rank_path(Path(folder) / "rank.json.gz", 0))


def named_syncs(trace: Trace) -> set[tuple[str, str]]:
    """The trace's orderings between streams, by the streams' names (their numbers follow first use); an ordering
    relayed through a stream of its own (traces/cuda/streams.py's RELAY) is taken whole, from its start to its end."""
    names = {int(number): name for number, name in trace.meta["streams"].items()}
    pairs = {(first, then) for _, first, then in trace.syncs}
    relays = {number for number, name in names.items() if name == RELAY}
    whole = {(a, b) for a, b in pairs if a not in relays and b not in relays}
    whole |= {(a, c) for a, r in pairs if r in relays for r2, c in pairs if r2 == r}
    return {(names[a], names[b]) for a, b in whole}


def stream_names(trace: Trace) -> list[str]:
    return sorted(name for name in trace.meta["streams"].values() if name != RELAY)


def test_the_recorded_traces_are_real_cuda_steps():
    assert len(TRACES) >= 6
    for name in TRACES:
        meta = load(FOLDER / f"{name}.json.gz").meta
        assert meta["device"] == "cuda" and meta["fake"] is False and meta["cuda_measured"], name


@pytest.mark.parametrize("name", TRACES)
def test_a_fake_cuda_trace_here_predicts_the_real_cuda_trace(name, monkeypatch):
    """Peak to the byte, the real allocations in order, and what each step's action or parallelism adds: the host
    copies of offload, the optimizer state of the 8-bit AdamW, the communication buffers of DDP and FSDP2, and
    FSDP2's streams, its buffers off the default stream, and orderings the real step also has."""
    real = load(FOLDER / f"{name}.json.gz")
    fake = fake_twin(real, monkeypatch)
    assert fake.peak()[0] == real.peak()[0] == real.meta["cuda_measured"]["peak_requested"]
    in_order = reproduced(sizes_in_order(real), sizes_in_order(fake))
    assert in_order >= IN_ORDER * len(real.recorded), f"{in_order}/{len(real.recorded)} in order"
    if "host" in real.meta:  # offload: the same copies, the same bytes moved each way
        assert Counter(real.meta["host"]["size"]) == Counter(fake.meta["host"]["size"])
    if "optimizer_state" in real.meta:
        assert real.meta["optimizer_state"] == fake.meta["optimizer_state"]
    real_bytes, fake_bytes = bytes_by_category(real), bytes_by_category(fake)
    assert fake_bytes["communication"] == real_bytes["communication"]
    assert fake_bytes["optimizer"] == real_bytes["optimizer"]
    if "streams" in real.meta:  # FSDP2: a fake ordering the real step lacks would let a plan reuse bytes too early
        assert stream_names(real) == stream_names(fake)
        assert set() != named_syncs(fake) <= named_syncs(real)
        assert off_default_sizes(real) == off_default_sizes(fake) != []
