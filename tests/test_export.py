"""`memplan export`: a trace as a PyTorch memory snapshot, read back with PyTorch's own viewer code
(torch.cuda._memory_viz) and replayed entry by entry from an empty device: every allocation and free of the
trace, at addresses never handed out twice while alive, inside the segments the entries made, with the trace's
peak, ending in the file's final `segments`; `memplan import` of the file gives the same buffers back."""

from __future__ import annotations

import base64
import json
import pickle
import pickletools
import re
import subprocess
import sys
from bisect import bisect_left, insort
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from torch.cuda import _memory_viz

import memplan
from memplan.cli import main
from memplan.errors import MemplanError, PlanError
from memplan.planner.simulate.alloc_conf import parse_alloc_conf
from memplan.planner.simulate.caching_allocator import event_order, simulate_caching
from memplan.planner.simulate.snapshot_export import make_snapshot
from memplan.traces.format import load, make_trace
from memplan.traces.inputs.snapshot import LABEL_FRAMES, import_snapshot, load_plain_pickle

DATA = Path(__file__).resolve().parents[1] / "traces" / "data"
GPT2 = DATA / "gpt2_small.b2s128.baseline.trace.json.gz"
BERT = DATA / "bert_large_slice.b2s512.tempo.trace.json.gz"
# The opcodes the viewer's own unpickler reads (`unpickle` in torch/utils/viz/MemoryViz.js, which
# pytorch.org/memory_viz runs); any other opcode in the file stops it with "UNKNOWN OPCODE".
VIEWER_OPCODES = {
    "APPEND", "APPENDS", "BINFLOAT", "BINGET", "BININT", "BININT1", "BININT2", "BINPUT", "BINUNICODE", "DICT",
    "EMPTY_DICT", "EMPTY_LIST", "EMPTY_TUPLE", "FRAME", "LIST", "LONG1", "LONG_BINGET", "LONG_BINPUT", "MARK",
    "MEMOIZE", "NEWFALSE", "NEWTRUE", "NONE", "PROTO", "SETITEM", "SETITEMS", "SHORT_BINUNICODE", "STOP", "TUPLE",
    "TUPLE1", "TUPLE2", "TUPLE3",
}  # fmt: skip


def no_flamegraph(lines: str) -> str:
    """_memory_viz's flamegraph input as is (its default downloads flamegraph.pl to draw an SVG)."""
    return lines


class Ranges:
    """Disjoint [start, end) byte ranges, merged when they touch: the device's mapped segments."""

    def __init__(self):
        self.starts: list[int] = []
        self.ends: dict[int, int] = {}

    def add(self, start: int, end: int) -> None:
        k = bisect_left(self.starts, start)
        assert k == len(self.starts) or end <= self.starts[k], "segment overlaps the next one"
        assert k == 0 or self.ends[self.starts[k - 1]] <= start, "segment overlaps the one before"
        insort(self.starts, start)
        self.ends[start] = end

    def holds(self, start: int, end: int) -> bool:
        merged = self.merged()
        return any(a <= start and end <= b for a, b in merged)

    def merged(self) -> list[tuple[int, int]]:
        out: list[list[int]] = []
        for s in self.starts:
            if out and out[-1][1] == s:
                out[-1][1] = self.ends[s]
            else:
                out.append([s, self.ends[s]])
        return [(a, b) for a, b in out]


def replay(snapshot: dict) -> dict:
    """Device 0's entries walked from an empty device, checking each: an allocation is at an address no live
    block overlaps, inside a mapped segment; a free names a live block with its size. Returns the allocations
    and frees (buffer index from the innermost frame), the live blocks left and the peaks."""
    segments, live, starts = Ranges(), {}, []
    allocs, frees, live_bytes, peak, reserved, peak_reserved = [], [], 0, 0, 0, 0
    for k, e in enumerate(snapshot["device_traces"][0]):
        action, addr, size = e["action"], e["addr"], e["size"]
        if action in ("segment_alloc", "segment_map"):
            segments.add(addr, addr + size)
            reserved += size
            peak_reserved = max(peak_reserved, reserved)
        elif action == "alloc":
            j = bisect_left(starts, addr)
            assert j == len(starts) or addr + size <= starts[j], f"entry {k}: overlaps the next live block"
            assert j == 0 or starts[j - 1] + live[starts[j - 1]]["size"] <= addr, f"entry {k}: overlaps a live block"
            assert segments.holds(addr, addr + size), f"entry {k}: outside every segment"
            insort(starts, addr)
            live[addr] = e
            allocs.append((e["frames"][0]["line"], e))
            live_bytes += size
            peak = max(peak, live_bytes)
        elif action == "free_requested":
            assert addr in live, f"entry {k}: free of an address that is not allocated"
        elif action == "free_completed":
            assert addr in live and live[addr]["size"] == size, f"entry {k}: free does not match its allocation"
            del starts[bisect_left(starts, addr)]
            frees.append((live.pop(addr)["frames"][0]["line"], e))
            live_bytes -= size
        else:
            raise AssertionError(f"entry {k}: unexpected action {action}")
    return {"allocs": allocs, "frees": frees, "live": live, "segments": segments, "peak": peak,
            "peak_reserved": peak_reserved}  # fmt: skip


def check_final_state(snapshot: dict, replayed: dict) -> None:
    """The file's `segments` are the state the entries end in: the same mapped ranges, each tiled by its blocks,
    and its allocated blocks the live ones (address, requested size, frames)."""
    segments = sorted(snapshot["segments"], key=lambda s: s["address"])
    assert segments == snapshot["segments"]
    ends = Ranges()
    for seg in segments:
        ends.add(seg["address"], seg["address"] + seg["total_size"])
        cursor = seg["address"]
        for b in seg["blocks"]:
            assert b["address"] == cursor and b["size"] >= b["requested_size"]
            cursor += b["size"]
        assert cursor == seg["address"] + seg["total_size"]
        assert seg["allocated_size"] == sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
    assert ends.merged() == replayed["segments"].merged()
    active = {b["address"]: b for s in segments for b in s["blocks"] if b["state"] == "active_allocated"}
    assert active.keys() == replayed["live"].keys()
    for addr, e in replayed["live"].items():
        assert active[addr]["requested_size"] == e["size"] and active[addr]["frames"] is e["frames"]


def check_against_trace(snapshot: dict, trace) -> dict:
    """Every buffer with bytes has one alloc and, unless it lives to the end, one free, in the allocator's order,
    with the trace's size, stream, category and labels; the live peak the entries imply is the trace's."""
    replayed = replay(snapshot)
    check_final_state(snapshot, replayed)
    expected = [(i, a) for _, i, a in zip(*event_order(trace)) if trace.size[i] > 0]
    entries = [e for e in snapshot["device_traces"][0] if e["action"] in ("alloc", "free_completed")]
    got = [(e["frames"][0]["line"], e["action"] == "alloc") for e in entries]
    assert got == expected
    for i, e in replayed["allocs"]:
        assert (e["size"], e["stream"], e["category"]) == (trace.size[i], trace.stream[i], trace.category[i])
        assert e["time_us"] == trace.alloc[i]
        labels = {f["filename"]: f["name"] for f in e["frames"][1:]}
        assert labels == {label: getattr(trace, label)[i] for label in LABEL_FRAMES if getattr(trace, label)[i]}
    assert all(e["time_us"] == trace.free[i] for i, e in replayed["frees"])
    assert replayed["peak"] == trace.peak()[0]
    return replayed


@pytest.fixture(scope="module")
def gpt2():
    return load(GPT2)


@pytest.fixture(scope="module")
def exported(gpt2, tmp_path_factory):
    """The bundled GPT-2 trace exported by the command, and the snapshot as read back from the file."""
    path = tmp_path_factory.mktemp("export") / "gpt2.pickle"
    r = CliRunner().invoke(main, ["export", str(GPT2), "-o", str(path), "--json"])
    assert r.exit_code == 0, r.output
    return path, json.loads(r.stdout), load_plain_pickle(path.read_bytes())  # plain data only


def test_every_allocation_and_free_of_the_trace_replays_at_the_simulated_addresses(gpt2, exported):
    _, summary, snapshot = exported
    replayed = check_against_trace(snapshot, gpt2)
    sim = simulate_caching(gpt2)
    assert all(e["addr"] == sim.addr[i] for i, e in replayed["allocs"])
    assert replayed["peak_reserved"] == sim.peak_reserved
    assert summary["actions"]["alloc"] == len(gpt2) and summary["without_entry"] == 0
    assert summary["actions"]["free_completed"] == int((gpt2.free < gpt2.end).sum())
    assert (summary["peak_live_bytes"], summary["peak_reserved_bytes"]) == (gpt2.peak()[0], sim.peak_reserved)


def test_pytorchs_viewer_code_reads_the_file(exported):
    path, summary, snapshot = exported
    ops = {op.name for op, _, _ in pickletools.genops(path.read_bytes())}
    assert ops <= VIEWER_OPCODES, ops - VIEWER_OPCODES
    for html in (
        _memory_viz.trace_plot(snapshot),
        _memory_viz.trace_plot(snapshot, plot_segments=True),
        _memory_viz.segment_plot(snapshot),
    ):  # the page carries the snapshot whole, for MemoryViz.js
        payload = json.loads(re.search(r"const local_files = (\[.*\])", html).group(1))[0]["base64"]
        assert pickle.loads(base64.b64decode(payload)) == snapshot
    stats = _memory_viz.segsum(snapshot)  # checks its own accounting of every segment
    assert f"segments: {summary['segments']}\n" in stats
    memory, segments = (
        flamegraph(snapshot, format_flamegraph=no_flamegraph).splitlines()
        for flamegraph in (_memory_viz.memory, _memory_viz.segments)
    )
    for lines in (memory, segments):
        assert sum(int(line.rsplit(" ", 1)[1]) for line in lines) == summary["reserved_bytes"]
    assert any(line.startswith("stream_0;active_allocated;category:0:parameter;phase:0:other;") for line in memory)
    assert _memory_viz.trace(snapshot).startswith(f"Device 0 ----------------\n{summary['entries']} entries\n")
    assert _memory_viz.compare(snapshot["segments"], [], format_flamegraph=no_flamegraph)


def test_the_command_in_the_docs_draws_the_timeline(exported, tmp_path):
    path, _, _ = exported
    out = tmp_path / "gpt2.html"
    cmd = [sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(path), "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    assert "MemoryViz.js" in out.read_text()


def test_import_of_the_export_gives_the_same_buffers_back_with_their_labels(gpt2, exported):
    path, _, _ = exported
    back = import_snapshot(path)
    order = [i for _, i, a in zip(*event_order(gpt2)) if a]  # the allocation order: alloc entries
    assert len(back) == len(gpt2)
    assert back.size.tolist() == gpt2.size[order].tolist()
    assert back.stream.tolist() == gpt2.stream[order].tolist()
    for label in LABEL_FRAMES:
        assert getattr(back, label) == [getattr(gpt2, label)[i] for i in order]
    before = int((gpt2.alloc == 0).sum())  # allocated one by one at the start of the file
    assert back.alloc.tolist() == [k + 1 for k in range(before)] + (gpt2.alloc[order[before:]] + before).tolist()
    assert back.free.tolist() == (gpt2.free[order] + before).tolist()
    assert back.peak()[0] == gpt2.peak()[0]


def test_expandable_segments_map_pages_and_show_one_segment_per_mapped_run():
    trace = load(BERT)
    conf = "expandable_segments:True"
    snapshot = make_snapshot(trace, alloc_conf=conf)
    replayed = check_against_trace(snapshot, trace)
    actions = {e["action"] for e in snapshot["device_traces"][0]}
    assert actions == {"segment_map", "alloc", "free_requested", "free_completed"}
    assert all(s["is_expandable"] for s in snapshot["segments"])
    assert replayed["peak_reserved"] == simulate_caching(trace, parse_alloc_conf(conf)).peak_reserved
    assert snapshot["allocator_settings"]["expandable_segments"] is True
    _memory_viz.segsum(snapshot)


def small_trace():
    """Two streams, a buffer alive before recording and freed in it, one of 0 bytes, one freed where it is
    allocated, one never freed."""
    return make_trace(
        {
            "size": [4096, 3 << 20, 0, 1000, 25 << 20, 700, 512],
            "alloc": [0, 1, 2, 3, 4, 6, 7],
            "free": [5, 8, 3, 3, 9, 10, 10],
            "stream": [0, 0, 0, 0, 7, 7, 0],
            "category": ["parameter", "activation", "temporary", "temporary", "activation", "gradient", "unknown"],
            "phase": ["other", "forward", "forward", "forward", "forward", "backward", "backward"],
            "op": ["", "aten::mm", "aten::empty", "aten::add", "aten::cat", "aten::mul", "aten::sum"],
            "module": ["model.w", "model.l1", "", "model.l1", "model.l2", "model.l2", ""],
        },
        syncs=[(4, 0, 7)],
    )


def test_streams_empty_buffers_and_buffers_alive_before_recording():
    trace = small_trace()
    snapshot = make_snapshot(trace)
    replayed = check_against_trace(snapshot, trace)
    assert snapshot["memplan"]["without_entry"] == 1  # the 0-byte buffer: PyTorch serves it without the allocator
    assert {i: e["stream"] for i, e in replayed["allocs"]} == {0: 0, 1: 0, 3: 0, 4: 7, 5: 7, 6: 0}
    assert {s["stream"] for s in snapshot["segments"]} == {0, 7}
    assert [f["filename"] for f in replayed["allocs"][1][1]["frames"]] == [
        "buffer",
        "op",
        "module",
        "phase",
        "category",
    ]


@pytest.mark.parametrize("scope", ["all", "step"])
def test_a_plan_places_every_buffer_at_its_offset_in_one_arena(scope):
    trace = load(BERT)
    plan = memplan.solve(trace, method="greedy", scope=scope)
    snapshot = make_snapshot(trace, plan)
    replayed = check_against_trace(snapshot, trace)
    arena = [e for e in snapshot["device_traces"][0] if e["action"] == "segment_alloc"]
    assert arena[0]["size"] == plan.arena and len(arena) == (1 if scope == "all" else 2)
    inside = [(i, e) for i, e in replayed["allocs"] if plan.offsets[i] >= 0]
    assert all(e["addr"] - arena[0]["addr"] == plan.offsets[i] for i, e in inside)
    assert snapshot["memplan"]["addresses"].startswith("plan")
    _memory_viz.segsum(snapshot)


def test_a_plan_leaves_out_the_buffers_that_hold_no_byte_of_it():
    trace = small_trace()
    snapshot = make_snapshot(trace, memplan.solve(trace))
    assert snapshot["memplan"]["without_entry"] == 2  # 0 bytes, and freed where it is allocated
    replayed = replay(snapshot)
    check_final_state(snapshot, replayed)
    assert sorted(i for i, _ in replayed["allocs"]) == [0, 1, 4, 5, 6]


def test_a_plan_for_another_trace_is_refused_and_nothing_is_written(tmp_path):
    plan = memplan.solve(small_trace())
    with pytest.raises(PlanError, match="different trace"):
        memplan.export_snapshot(load(BERT), tmp_path / "x.pickle", plan=plan)
    with pytest.raises(MemplanError, match=r"must end in \.pickle"):
        memplan.export_snapshot(small_trace(), tmp_path / "x.pkl")
    assert list(tmp_path.iterdir()) == []


def test_the_api_returns_the_snapshot_it_writes(tmp_path):
    trace = small_trace()
    snapshot = memplan.export_snapshot(trace, tmp_path / "small.pickle", alloc_conf="max_split_size_mb:20")
    assert pickle.loads((tmp_path / "small.pickle").read_bytes()) == snapshot
    assert snapshot["allocator_settings"]["max_split_size"] == 20 << 20
    assert np.array_equal(import_snapshot(tmp_path / "small.pickle").size, [4096, 3 << 20, 1000, 25 << 20, 700, 512])


def test_import_keeps_only_the_labels_a_trace_can_hold(tmp_path):
    snapshot = make_snapshot(small_trace())
    frames = next(e for e in snapshot["device_traces"][0] if e["action"] == "alloc")["frames"]
    frames[1:] = [{"filename": "category", "line": 0, "name": "nonsense"}, {"filename": "phase", "line": 0, "name": 3}]
    (tmp_path / "edited.pickle").write_bytes(pickle.dumps(snapshot))
    back = import_snapshot(tmp_path / "edited.pickle")
    assert (back.category[0], back.phase[0], back.op[0], back.module[0]) == ("unknown", "other", "", "")
    assert back.category[1:] == ["activation", "temporary", "activation", "gradient", "unknown"]


def test_the_file_has_every_field_of_a_real_gpu_snapshot(shared, exported):
    """Segments, blocks and entries carry the keys torch.cuda.memory._snapshot() gives them on a GPU (newer
    PyTorch adds `compile_context` and `user_metadata` to entries; older ones, as the viewers, do without)."""
    _, _, snapshot = exported
    ours = {e["action"]: set(e) for e in snapshot["device_traces"][0]}
    for name in ("gpt_ctx128_fullstep", "gpt2_medium_ctx128_training"):  # with segment_alloc; a newer PyTorch's
        path = shared / "traces" / "cuda-snapshots" / f"{name}.pickle"
        real = load_plain_pickle(path.read_bytes())
        assert set(real["segments"][0]) <= set(snapshot["segments"][0]), path.name
        assert set(real["segments"][0]["blocks"][0]) <= set(snapshot["segments"][0]["blocks"][0]), path.name
        for e in real["device_traces"][0]:
            assert set(e) - {"compile_context", "user_metadata"} <= ours[e["action"]], (path.name, e["action"])
