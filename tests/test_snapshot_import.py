"""`memplan import`: the restricted unpickler refuses objects without running them; snapshots become traces."""

from __future__ import annotations

import os
import pickle

import pytest
from click.testing import CliRunner

from memplan.cli import main
from memplan.errors import SnapshotError
from memplan.traces.format import load
from memplan.traces.snapshot import import_snapshot, load_plain_pickle, parse_snapshot, snapshot_to_trace
from memplan.units import MiB

SNAPSHOTS = ("gpt_ctx128_fullstep", "gpt2_medium_ctx128_training", "gpt2_medium_ctx512_training")


class _RunsCommand:
    """Unpickling this would call os.system(command)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class _Plain:
    """An ordinary class instance."""

    def __init__(self):
        self.x = 1


def _evil_pickle(marker) -> bytes:
    return pickle.dumps({"segments": [], "device_traces": [[_RunsCommand(f"touch {marker}")]]})


def test_object_pickle_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(SnapshotError, match="posix.system|os.system|nt.system"):
        load_plain_pickle(_evil_pickle(marker))
    assert not marker.exists()


@pytest.mark.parametrize("value", [_Plain(), {1, 2}, b"bytes", bytearray(b"x"), 1j, frozenset()])
def test_anything_but_plain_data_is_refused(value):
    with pytest.raises(SnapshotError, match="refused"):
        load_plain_pickle(pickle.dumps({"segments": [], "device_traces": [], "x": [value]}))


def test_plain_data_and_truncated_pickles():
    data = {"a": [1, 2.5, "s", None, True, (3, 4)]}
    assert load_plain_pickle(pickle.dumps(data)) == data
    with pytest.raises(SnapshotError, match="not a readable pickle"):
        load_plain_pickle(pickle.dumps(data)[:-5])


def test_cli_refuses_object_pickle_with_one_line_and_no_output(tmp_path):
    marker, bad, out = tmp_path / "ran", tmp_path / "evil.pickle", tmp_path / "out.trace.json.gz"
    bad.write_bytes(_evil_pickle(marker))
    result = CliRunner().invoke(main, ["import", str(bad), "-o", str(out)])
    assert result.exit_code == 1
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "refused" in errors[0]
    assert not out.exists() and not marker.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["evil.pickle"]


def test_not_a_snapshot_is_refused():
    with pytest.raises(SnapshotError, match="segments"):
        parse_snapshot({"device_traces": []})
    with pytest.raises(SnapshotError, match="top level"):
        parse_snapshot([1, 2])


def _entry(action, addr, size, line=0):
    frames = [
        {"name": "malloc", "filename": "CUDACachingAllocator.cpp", "line": 0},
        {"name": "linear", "filename": "/x/site-packages/torch/nn/functional.py", "line": 9},
        {"name": "forward", "filename": "/home/u/model.py", "line": line},
    ]
    return {"action": action, "addr": addr, "size": size, "stream": 7, "time_us": 0, "frames": frames}


def test_hand_made_snapshot_keeps_blocks_from_before_recording():
    base = 1 << 30
    snap = {
        "segments": [
            {
                "device": 0,
                "address": base,
                "total_size": 20 * MiB,
                "stream": 7,
                "segment_type": "large",
                "blocks": [
                    {
                        "address": base,
                        "size": 4 * MiB,
                        "requested_size": 4 * MiB - 100,
                        "state": "active_allocated",
                        "frames": [],
                    },  # alive before, never freed
                    {
                        "address": base + 4 * MiB,
                        "size": 2 * MiB,
                        "requested_size": 2 * MiB,
                        "state": "active_allocated",
                        "frames": [],
                    },  # allocated while recording
                    {
                        "address": base + 6 * MiB,
                        "size": 14 * MiB,
                        "requested_size": 0,
                        "state": "inactive",
                        "frames": [],
                    },
                ],
            }
        ],
        "device_traces": [
            [
                _entry("free_requested", base + 6 * MiB, 3 * MiB),
                _entry("free_completed", base + 6 * MiB, 3 * MiB),  # allocated before recording
                _entry("alloc", base + 4 * MiB, 2 * MiB, line=12),
                _entry("alloc", base + 6 * MiB, 5 * MiB, line=13),
                _entry("free_requested", base + 6 * MiB, 5 * MiB),
                _entry("free_completed", base + 6 * MiB, 5 * MiB),
                _entry("segment_alloc", base, 20 * MiB),  # ignored
            ]
        ],
    }
    trace = snapshot_to_trace(parse_snapshot(snap))
    rows = sorted(zip(trace.alloc.tolist(), trace.free.tolist(), trace.size.tolist(), trace.addr.tolist(), trace.op))
    assert trace.end == 5
    assert rows == [
        (0, 1, 3 * MiB, base + 6 * MiB, ""),
        (0, 5, 4 * MiB - 100, base, ""),
        (2, 5, 2 * MiB, base + 4 * MiB, "model.py:12 forward"),
        (3, 4, 5 * MiB, base + 6 * MiB, "model.py:13 forward"),
    ]
    assert set(trace.stream.tolist()) == {7} and set(trace.category) == {"unknown"}


def _independent_peak(raw: dict) -> tuple[int, int, int]:
    """(peak allocated bytes, alloc entries, blocks alive before recording) from the snapshot's own entries."""
    entries = raw["device_traces"][0]
    live: dict[int, int] = {}
    freed_unrecorded, n_unrecorded = 0, 0
    for e in entries:
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
        elif e["action"] == "free_completed":
            if live.pop(e["addr"], None) is None:
                freed_unrecorded += e["size"]
                n_unrecorded += 1
    still = [
        b for s in raw["segments"] for b in s["blocks"] if b["state"] == "active_allocated" and b["address"] not in live
    ]
    current = freed_unrecorded + sum(b["requested_size"] for b in still)
    peak, live = current, {}
    for e in entries:
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            current += e["size"]
        elif e["action"] == "free_completed":
            current -= live.pop(e["addr"], e["size"])
        peak = max(peak, current)
    n_alloc = sum(1 for e in entries if e["action"] == "alloc")
    return peak, n_alloc, n_unrecorded + len(still)


def test_allocations_of_the_autograd_engine_are_backward_and_name_their_node():
    engine = [
        {"name": "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc()", "filename": "??"},
        {"name": "at::_ops::mul_Tensor::call(at::Tensor const&, at::Tensor const&)", "filename": "??"},
        {"name": "torch::autograd::generated::MulBackward0::apply(std::vector<at::Tensor>&&)", "filename": "??"},
        {"name": "torch::autograd::Engine::evaluate_function(std::shared_ptr<GraphTask>&)", "filename": "??"},
    ]
    internal = [engine[0], engine[1], engine[3]]  # the engine's own work: no node on the stack
    snap = {
        "segments": [],
        "device_traces": [
            [
                _entry("alloc", 1 << 20, 512, line=5),
                {"action": "alloc", "addr": 2 << 20, "size": 512, "stream": 0, "time_us": 1, "frames": engine},
                {"action": "alloc", "addr": 3 << 20, "size": 512, "stream": 0, "time_us": 2, "frames": internal},
            ]
        ],
    }
    trace = snapshot_to_trace(parse_snapshot(snap))
    assert trace.op == ["model.py:5 forward", "MulBackward0", "aten::mul_Tensor"]
    assert trace.phase == ["other", "backward", "backward"]


def test_gpt_ctx128_import_matches_its_own_entries(shared):
    path = shared / "traces/cuda-snapshots/gpt_ctx128_fullstep.pickle"
    raw = load_plain_pickle(path.read_bytes())
    peak, n_alloc, n_before = _independent_peak(raw)
    trace = import_snapshot(path)
    assert len(trace) == n_alloc + n_before
    assert int((trace.alloc > 0).sum()) == n_alloc == 6771
    assert trace.peak()[0] == peak
    assert any(op.endswith(" forward") for op in trace.op)
    # every allocation made while recording names where it came from; backward ones their autograd node
    assert all(trace.op[i] for i in trace.recorded)
    backward = [trace.op[i] for i in trace.recorded if trace.phase[i] == "backward"]
    assert len(backward) > 1000 and sum(op.endswith("Backward0") for op in backward) > len(backward) / 2


@pytest.mark.parametrize("name", SNAPSHOTS)
def test_every_shared_snapshot_imports_and_round_trips(shared, tmp_path, name):
    out = tmp_path / f"{name}.trace.json.gz"
    result = CliRunner().invoke(
        main, ["import", str(shared / f"traces/cuda-snapshots/{name}.pickle"), "-o", str(out), "--json"]
    )
    assert result.exit_code == 0, result.output
    trace = load(out)
    assert len(trace) > 6000 and trace.meta["source"] == "cuda-snapshot"
    assert (trace.addr > 0).all()
