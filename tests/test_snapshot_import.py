"""`memplan import`: the restricted unpickler refuses objects without running them; snapshots become traces."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
from click.testing import CliRunner

from memplan.cli import main
from memplan.errors import SnapshotError
from memplan.traces.format import load
from memplan.traces.inputs.snapshot import (
    import_snapshot,
    import_summary,
    load_plain_pickle,
    parse_snapshot,
    snapshot_to_trace,
    with_failed_requests,
)
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


def _snapshot(*entries) -> dict:
    return {"segments": [], "device_traces": [list(entries)]}


def _rows(trace) -> list[tuple[int, int, int, int]]:
    """(alloc, free, size, addr) of every buffer, sorted."""
    return sorted(zip(trace.alloc.tolist(), trace.free.tolist(), trace.size.tolist(), trace.addr.tolist()))


def test_an_out_of_memory_error_is_kept_with_a_time_of_its_own():
    """PyTorch's `oom` entry has no address: its request (rounded), the device's free bytes and where it came from
    go to meta `ooms`, at a time no other event has; the frees that follow it (the exception unwinding) are kept."""
    oom = {"action": "oom", "size": 40 * MiB, "device_free": 30 * MiB, "stream": 7, "time_us": 5,
           "frames": _entry("alloc", 0, 0, line=21)["frames"]}  # fmt: skip
    trace = snapshot_to_trace(parse_snapshot(_snapshot(
        _entry("alloc", 1 << 20, 4 * MiB, line=20), oom, _entry("free_completed", 1 << 20, 4 * MiB),
    )))  # fmt: skip
    assert trace.meta["ooms"] == [{"entry": 1, "time": 2, "size": 40 * MiB, "device_free": 30 * MiB, "stream": 7,
                                   "time_us": 5, "op": "model.py:21 forward", "phase": "other"}]  # fmt: skip
    assert _rows(trace) == [(1, 3, 4 * MiB, 1 << 20)]
    assert not trace.live_at(2).tolist() == []  # the buffer was live when the request failed
    with_request, requests = with_failed_requests(trace)
    assert requests == [1] and (with_request.alloc[1], with_request.free[1], with_request.size[1]) == (2, 2, 40 * MiB)
    assert import_summary(trace)["oom"]["size"] == 40 * MiB and import_summary(trace)["ooms"] == 1


@pytest.mark.parametrize(
    ("entries", "refusal"),
    [
        pytest.param(  # the issue's double free: a phantom 1,024 B buffer gave a peak of 2,560 B against 1,536
            [("alloc", 0, 1024), ("alloc", 1024, 512), ("free_completed", 0, 1024), ("free_completed", 0, 1024)],
            "[0][3]: free_completed of address 0x0, already freed at entry 2 and not allocated since (a double free)",
            id="free-completed-twice",
        ),
        pytest.param(
            [("alloc", 0, 512), ("free_requested", 0, 512), ("free_requested", 0, 512), ("free_completed", 0, 512)],
            "[0][2]: free_requested of address 0x0, whose free was already requested at entry 1 (a double free)",
            id="free-requested-twice",
        ),
        pytest.param(  # a block from before recording, freed twice
            [("free_completed", 4096, 512), ("free_completed", 4096, 512)],
            "[0][1]: free_completed of address 0x1000, already freed at entry 0",
            id="before-recording-freed-twice",
        ),
        pytest.param(
            [("alloc", 0, 512), ("alloc", 0, 512)],
            "[0][1]: alloc at address 0x0, which is still live (allocated at entry 0)",
            id="alloc-at-live",
        ),
        pytest.param(  # record_stream: the block is the program's until its free completes
            [("alloc", 0, 512), ("free_requested", 0, 512), ("alloc", 0, 512), ("free_completed", 0, 512)],
            "[0][2]: alloc at address 0x0, which is still live (allocated at entry 0, its free requested at entry 1)",
            id="alloc-while-free-pending",
        ),
        pytest.param(
            [("alloc", 0, 512), ("resize", 0, 1024)],
            "[0][1]: unknown action 'resize'; PyTorch writes alloc, free_requested, free_completed",
            id="unknown-action",
        ),
    ],
)
def test_entries_pytorch_never_writes_are_refused_by_their_index(entries, refusal):
    snap = _snapshot(*(_entry(*e) for e in entries))
    with pytest.raises(SnapshotError) as e:
        snapshot_to_trace(parse_snapshot(snap))
    assert refusal in str(e.value) and str(e.value).startswith("device_traces[0][")


def test_a_ring_buffer_frees_blocks_allocated_before_it_and_record_stream_frees_late():
    """A snapshot of the last N entries (`max_entries`) frees blocks it never saw allocated, its first free perhaps
    without its request: each is one buffer from before recording, and the address may be allocated again. A block
    freed while another stream used it (record_stream) is the program's until `free_completed`."""
    trace = snapshot_to_trace(parse_snapshot(_snapshot(*(_entry(*e) for e in [
        ("free_completed", 0, 512),  # its free_requested fell out of the ring
        ("free_requested", 4096, 1024), ("free_completed", 4096, 1024),
        ("alloc", 0, 512), ("alloc", 8192, 512),
        ("free_requested", 0, 512), ("alloc", 16384, 512), ("free_completed", 0, 512),  # freed late: record_stream
        ("free_requested", 8192, 512),  # the recording ends before its free completes
    ]))))  # fmt: skip
    assert _rows(trace) == [(0, 1, 512, 0), (0, 2, 1024, 4096), (3, 6, 512, 0), (4, 7, 512, 8192), (5, 7, 512, 16384)]


def test_a_snapshot_recorded_without_free_completed_frees_at_free_requested():
    """`_record_memory_history(skip_actions=["free_completed"])` leaves only the requests: they close the blocks."""
    entries = [("alloc", 0, 512), ("free_requested", 0, 512), ("alloc", 0, 1024), ("free_requested", 0, 1024)]
    trace = snapshot_to_trace(parse_snapshot(_snapshot(*(_entry(*e) for e in entries))))
    assert _rows(trace) == [(1, 2, 512, 0), (3, 4, 1024, 0)]


def test_the_malformed_double_free_snapshot_was_the_issue_s_phantom_peak():
    """tests/data/malformed/pickle/double_free.pickle without its second free is a valid snapshot of peak 1,536 B;
    the second free made today's importer invent a 1,024 B buffer alive from the start (2,560 B)."""
    path = Path(__file__).parent / "data" / "malformed" / "pickle" / "double_free.pickle"
    raw = load_plain_pickle(path.read_bytes())
    raw["device_traces"][0] = raw["device_traces"][0][:4] + raw["device_traces"][0][6:]
    assert snapshot_to_trace(parse_snapshot(raw)).peak()[0] == 1536
