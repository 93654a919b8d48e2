"""A trace as a PyTorch memory snapshot (the dict `torch.cuda.memory._dump_snapshot` pickles), which
pytorch.org/memory_viz and `torch.cuda._memory_viz` open.

`device_traces[0]` holds, in the order the allocator sees them (planner.simulate.caching_allocator.event_order),
one `alloc` per buffer (those alive before recording first) and a `free_requested` + `free_completed` pair per
free, with the `segment_alloc`/`segment_map` entries that made room for them. Addresses come from the caching
allocator simulated on the trace, or from a plan's offsets inside one arena segment. `segments` is the state
after the last entry: the viewer rebuilds every earlier state by walking the entries back from it. Each entry's
frames name the buffer and its labels (op, module, phase, category; traces.inputs.snapshot.LABEL_FRAMES, which
`memplan import` reads back), innermost first as PyTorch records them; `time_us` holds the trace's logical time.
Buffers of 0 bytes (which PyTorch serves without its allocator) and, on a plan, buffers freed where they are
allocated (they hold no byte of the arena) have no entry.
"""

from __future__ import annotations

import os
import pickle
from collections import Counter

import numpy as np

from memplan.files import OutputError, atomic_write
from memplan.planner.plan import Plan, check_plan, plan_problem
from memplan.planner.problem import align_up
from memplan.planner.simulate.alloc_conf import N_INTERVALS, TIE_BREAKS, AllocConf, parse_alloc_conf
from memplan.planner.simulate.caching_allocator import FAKE_BASE, ROUND_LARGE, CachingAllocator, event_order
from memplan.traces.format import Trace
from memplan.traces.inputs.snapshot import BUFFER_FRAME, LABEL_FRAMES

SUFFIX = ".pickle"  # what torch.cuda.memory._dump_snapshot writes and the viewers are given
PICKLE_PROTOCOL = 4  # the viewer's own unpickler (MemoryViz.js) reads protocols 2 to 4
DEVICE = 0
SEGMENT_CATEGORY = "unknown"  # a segment holds no one category (and older viewers need 'unknown' present)
ACTIVE, INACTIVE = "active_allocated", "inactive"


def buffer_frames(trace: Trace, name: str) -> list[list[dict]]:
    """Per buffer, the frames the viewer shows as its stack: `buffer:INDEX:NAME`, then `op:0:aten::mm`,
    `module:0:...`, `phase:0:...`, `category:0:...` (empty labels left out); equal label frames are one object,
    so the pickle stores each once."""
    shared: dict[tuple[str, str], dict] = {}

    def frame(kind: str, value: str) -> dict:
        key = (kind, value)
        if key not in shared:
            shared[key] = {"filename": kind, "line": 0, "name": value}
        return shared[key]

    columns = [getattr(trace, label) for label in LABEL_FRAMES]
    return [
        [{"filename": BUFFER_FRAME, "line": i, "name": name}]
        + [frame(label, column[i]) for label, column in zip(LABEL_FRAMES, columns) if column[i]]
        for i in range(len(trace))
    ]


def _entry(action: str, addr: int, size: int, stream: int, time: int, frames: list, category: str) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": time, "frames": frames,
            "category": category}  # fmt: skip


def _block(addr: int, size: int, requested: int, frames: list | None) -> dict:
    """A block of a segment: allocated (with the frames of its buffer) when `frames` is given, else free."""
    state = INACTIVE if frames is None else ACTIVE
    return {"address": addr, "size": size, "requested_size": requested, "state": state, "frames": frames or []}


def _segment(blocks: list[dict], stream: int, small: bool, expandable: bool, frames: list) -> dict:
    """A segment of the final state, as torch.cuda.memory._snapshot() describes it, from its blocks."""
    allocated = sum(b["size"] for b in blocks if b["state"] == ACTIVE)
    return {
        "device": DEVICE,
        "address": blocks[0]["address"],
        "total_size": sum(b["size"] for b in blocks),
        "allocated_size": allocated,
        "active_size": allocated,
        "requested_size": sum(b["requested_size"] for b in blocks if b["state"] == ACTIVE),
        "stream": stream,
        "segment_type": "small" if small else "large",
        "segment_pool_id": (0, 0),
        "is_expandable": expandable,
        "frames": frames,
        "blocks": blocks,
    }


def allocator_settings(conf: AllocConf, alloc_conf: str) -> dict:
    """The snapshot's `allocator_settings` for a simulated conf, keyed as PyTorch records them (and as
    planner.simulate.alloc_conf.conf_from_snapshot_settings reads them back)."""
    return {
        "PYTORCH_CUDA_ALLOC_CONF": alloc_conf,
        "max_split_size": -1 if conf.max_split_size is None else conf.max_split_size,
        "garbage_collection_threshold": conf.garbage_collection_threshold,
        "expandable_segments": conf.expandable_segments,
        "roundup_power2_divisions": {str(1 << k): conf.roundup_power2_divisions[k] for k in range(N_INTERVALS)},
    }


def caching_snapshot(trace: Trace, conf: AllocConf = AllocConf(), alloc_conf: str = "", name: str = "trace") -> dict:
    """The snapshot of `trace` run on PyTorch's caching allocator (simulated with `conf`, whose text is
    `alloc_conf`): the addresses, rounded block sizes and segments the simulator gives every buffer."""
    frames = buffer_frames(trace, name)
    allocator = CachingAllocator(conf)
    sizes, streams, categories = trace.size.tolist(), trace.stream.tolist(), trace.category
    entries: list[dict] = []
    addr_of: dict[int, int] = {}  # buffer -> its address while it is live
    owner: dict[int, int] = {}  # address -> the live buffer there
    segment_frames: dict[int, list] = {}  # segment address -> frames of the allocation that made it
    for t, i, is_alloc in zip(*event_order(trace)):
        size, stream = sizes[i], streams[i]
        if not size:
            continue
        if is_alloc:
            made = len(allocator.events)
            addr = allocator.malloc(size, stream)
            for e in allocator.events[made:]:
                segment_frames.setdefault(e.addr, frames[i])
                entries.append(_entry(e.action, e.addr, e.size, e.stream, t, frames[i], SEGMENT_CATEGORY))
            entries.append(_entry("alloc", addr, size, stream, t, frames[i], categories[i]))
            addr_of[i], owner[addr] = addr, i
        else:
            addr = addr_of.pop(i)
            allocator.free(addr)
            del owner[addr]
            for action in ("free_requested", "free_completed"):
                entries.append(_entry(action, addr, size, stream, t, frames[i], categories[i]))
    segments = []
    for seg, blocks in allocator.segment_blocks():
        run: list[dict] = []  # an expandable segment shows as one segment per run of mapped pages, as PyTorch's
        for b in [*blocks, None]:
            if b is not None and b.mapped:
                if b.allocated:
                    run.append(_block(b.addr, b.size, b.requested, frames[owner[b.addr]]))
                else:
                    run.append(_block(b.addr, b.size, 0, None))
            elif run:
                context = [] if seg.expandable else segment_frames.get(seg.addr, [])
                segments.append(_segment(run, seg.stream, seg.small, seg.expandable, context))
                run = []
    settings = allocator_settings(conf, alloc_conf)
    return snapshot_dict(trace, entries, segments, settings, f"caching allocator {alloc_conf}".strip(), name)


def plan_snapshot(trace: Trace, plan: Plan, name: str = "trace") -> dict:
    """The snapshot of `trace` run on `plan` (checked against the trace first: PlanError otherwise): one arena
    segment with every buffer at its offset, block sizes rounded to the plan's alignment; a plan of the step's
    own buffers puts the whole-window ones back to back in a second segment after the arena."""
    problem = plan_problem(plan, trace)
    check_plan(plan, problem)
    frames = buffer_frames(trace, name)
    block_size = align_up(trace.size, plan.alignment)
    base = FAKE_BASE
    outside_base = base + -(-plan.arena // ROUND_LARGE) * ROUND_LARGE
    outside_offsets = np.cumsum(np.where(problem.outside, block_size, 0)) - block_size
    addr = np.where(problem.outside, outside_base + outside_offsets, base + np.asarray(plan.offsets, np.int64))
    holds = (trace.size > 0) & (trace.alloc < trace.free)
    stream = trace.streams[0] if len(trace) else 0
    arenas = [(base, int(plan.arena)), (outside_base, int(block_size[problem.outside].sum()))]
    arenas = [(a, size) for a, size in arenas if size > 0]
    entries = [_entry("segment_alloc", a, size, stream, 0, [], SEGMENT_CATEGORY) for a, size in arenas]
    sizes, streams, categories, addrs = trace.size.tolist(), trace.stream.tolist(), trace.category, addr.tolist()
    for t, i, is_alloc in zip(*event_order(trace)):
        if holds[i]:
            actions = ("alloc",) if is_alloc else ("free_requested", "free_completed")
            entries += [_entry(a, addrs[i], sizes[i], streams[i], t, frames[i], categories[i]) for a in actions]
    live = np.flatnonzero(holds & (trace.free == trace.end))
    segments = []
    for a, size in arenas:
        inside = sorted((addrs[i], i) for i in live if a <= addrs[i] < a + size)
        blocks, cursor = [], a
        for start, i in inside:
            if start > cursor:
                blocks.append(_block(cursor, start - cursor, 0, None))
            blocks.append(_block(start, int(block_size[i]), sizes[i], frames[i]))
            cursor = start + int(block_size[i])
        if cursor < a + size:
            blocks.append(_block(cursor, a + size - cursor, 0, None))
        segments.append(_segment(blocks, stream, False, False, []))
    return snapshot_dict(trace, entries, segments, {}, f"plan ({plan.status}, {plan.solver})", name)


def snapshot_dict(trace: Trace, entries: list[dict], segments: list[dict], settings: dict, addresses: str,
                  name: str) -> dict:  # fmt: skip
    """The snapshot: segments in address order, device 0's entries, the allocator settings, and what memplan
    made it from (under `memplan`, a key the viewer ignores)."""
    placed = sum(1 for e in entries if e["action"] == "alloc")
    about = {"trace": name, "addresses": addresses, "buffers": len(trace), "without_entry": len(trace) - placed}
    return {
        "segments": sorted(segments, key=lambda s: s["address"]),
        "device_traces": [entries],
        **({"allocator_settings": settings} if settings else {}),
        "memplan": {**about, "meta": dict(trace.meta)},
    }


def make_snapshot(
    trace: Trace, plan: Plan | None = None, alloc_conf: str = "", tie_break: str = TIE_BREAKS[0], name: str = "trace"
) -> dict:
    """The snapshot of `trace`: on `plan` when given (checked against the trace), else on the caching allocator
    simulated with PYTORCH_CUDA_ALLOC_CONF `alloc_conf`; `name` (the trace's file) is in every buffer's frames."""
    if plan is not None:
        return plan_snapshot(trace, plan, name)
    return caching_snapshot(trace, parse_alloc_conf(alloc_conf, tie_break), alloc_conf, name)


def check_snapshot_path(path: str | os.PathLike) -> None:
    """OutputError unless the file name ends in .pickle, as PyTorch's snapshots do."""
    if not os.fspath(path).endswith(SUFFIX):
        raise OutputError(f"{os.fspath(path)}: a memory snapshot's file name must end in {SUFFIX}")


def write_snapshot(snapshot: dict, path: str | os.PathLike) -> None:
    """Pickle the snapshot atomically to `path` (a .pickle file), in the protocol the viewers read (2 to 4)."""
    check_snapshot_path(path)
    atomic_write(path, pickle.dumps(snapshot, protocol=PICKLE_PROTOCOL))


def snapshot_summary(snapshot: dict) -> dict:
    """What a snapshot holds, counted from its own entries: entries by action, segments, and the bytes the
    entries imply (bytes live in tensors and reserved at their peaks, with the entry where live bytes peak)."""
    entries = snapshot["device_traces"][0] if snapshot["device_traces"] else []
    actions = Counter(e["action"] for e in entries)
    allocated = reserved = peak_allocated = peak_reserved = 0
    peak_entry = None
    for k, e in enumerate(entries):
        action = e["action"]
        if action == "alloc":
            allocated += e["size"]
            if allocated > peak_allocated:
                peak_allocated, peak_entry = allocated, k
        elif action == "free_completed":
            allocated -= e["size"]
        elif action in ("segment_alloc", "segment_map"):
            reserved += e["size"]
            peak_reserved = max(peak_reserved, reserved)
        elif action in ("segment_free", "segment_unmap"):
            reserved -= e["size"]
    segments = snapshot["segments"]
    return {
        "entries": len(entries),
        "actions": dict(sorted(actions.items())),
        "segments": len(segments),
        "reserved_bytes": sum(s["total_size"] for s in segments),
        "allocated_bytes": sum(s["allocated_size"] for s in segments),
        "peak_live_bytes": peak_allocated,
        "peak_entry": peak_entry,
        "peak_reserved_bytes": peak_reserved,
        **{key: snapshot["memplan"][key] for key in ("trace", "addresses", "buffers", "without_entry")},
    }
