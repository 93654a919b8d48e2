"""CUDA memory snapshots (`torch.cuda.memory._dump_snapshot`): safe loading and conversion to a Trace.

A snapshot is a pickle; it is read with an unpickler that builds only dict, list, tuple, str,
int, float, bool and None, so a file holding any object is refused before anything runs; its bytes and
nesting are bounded (memplan/limits.py), and a container that holds itself is refused.
The trace keeps one buffer per `alloc` entry plus one per block that was allocated before
recording began (alloc time 0); times count the `alloc` and `free_completed` entries and the `oom` entries (an
out-of-memory error: the request that failed, kept in the trace's meta `ooms` with a time of its own at which
nothing else happens, so a simulation can make the request there). Entries are checked as PyTorch writes them
(ACTIONS): an unknown action, a double free and an allocation at a live address are refused with the entry's
index. A snapshot memplan exported (planner/simulate/snapshot_export.py) names each buffer's labels in its frames
(LABEL_FRAMES), and they come back as the trace's labels.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from dataclasses import dataclass, field
from typing import Any

from memplan.errors import SnapshotError, TraceError
from memplan.files import read_input
from memplan.limits import MAX_PICKLE_BYTES, MAX_PICKLE_DEPTH, LimitError, check_nesting, short_repr
from memplan.traces.format import CATEGORIES, COLUMNS, INT_COLUMNS, PHASES, Trace, make_trace
from memplan.units import MiB, human_bytes

PLAIN_TYPES = (dict, list, tuple, str, int, float, bool, type(None))
SNAPSHOT_DEPTH = 8  # how deep PyTorch's snapshots nest (dict, device list, entries, entry, frames, frame, ...)
KEYS = ("segments", "device_traces")
FREE_ACTIONS = ("free_completed", "free")  # when the allocator gets a block back ("free": old snapshots)
FREE_REQUESTED = "free_requested"  # the program let go of the block; with record_stream it is reused only later
OOM = "oom"  # the allocator raised OutOfMemoryError: no address; `size` (rounded) and `device_free` instead
# TraceEntry's actions (c10/core/CachingDeviceAllocator.h, torch/cuda/memory.py's _snapshot); "free": old snapshots
ACTIONS = ("alloc", FREE_REQUESTED, *FREE_ACTIONS, "segment_alloc", "segment_free", "segment_map", "segment_unmap",
           "snapshot", OOM)  # fmt: skip
ENGINE_FRAME = "torch::autograd::Engine::evaluate_function"
AUTOGRAD_NODE = re.compile(r"torch::autograd::(?:generated::)?(\w+)::apply\(")
ATEN_OP = re.compile(r"at::_ops::(\w+)::call\(")  # the op and its overload: sum_dim_IntList
# memplan's frames, innermost first: `buffer:INDEX:NAME`, then one frame per label, `category:0:activation`
BUFFER_FRAME = "buffer"
LABEL_FRAMES = ("op", "module", "phase", "category")
LABEL_VALUES = {"phase": PHASES, "category": CATEGORIES}  # labels with a closed set of values


class _PlainUnpickler(pickle.Unpickler):
    """Refuses every global lookup and persistent id, so no class or callable can be reached."""

    def find_class(self, module: str, name: str):
        raise SnapshotError(f"refused: the pickle asks for {module}.{name}; a snapshot holds plain data only")

    def persistent_load(self, pid):
        raise SnapshotError("refused: the pickle holds a persistent reference; a snapshot holds plain data only")


def load_plain_pickle(data: bytes) -> Any:
    """Decode pickle bytes that may hold only dict, list, tuple, str, int, float, bool and None, at most
    MAX_PICKLE_BYTES long and MAX_PICKLE_DEPTH deep, without cycles (a walk of them would never end)."""
    if len(data) > MAX_PICKLE_BYTES:
        raise LimitError(
            f"holds more than {human_bytes(MAX_PICKLE_BYTES)}, the most memplan reads of a snapshot (limits.py)"
        )
    try:
        obj = _PlainUnpickler(io.BytesIO(data)).load()
    except SnapshotError:
        raise
    except Exception as e:  # any malformed pickle: truncated, bad opcode, ...
        first = str(e).splitlines()[0] if str(e) else ""
        raise SnapshotError(f"not a readable pickle ({type(e).__name__}: {first[:200]})") from None
    try:
        check_nesting(obj, MAX_PICKLE_DEPTH, PLAIN_TYPES)
    except TypeError as e:
        raise SnapshotError(f"refused: the pickle holds a {e}; a snapshot holds plain data only") from None
    except LimitError as e:
        raise LimitError(f"refused: {e} (limits.MAX_PICKLE_DEPTH); a snapshot nests {SNAPSHOT_DEPTH} deep") from None
    except ValueError as e:
        raise SnapshotError(f"refused: {e}; a snapshot holds none") from None
    return obj


@dataclass
class SnapshotEntry:
    """One trace entry of a device: action, address, size (the request for alloc/free), stream, op."""

    action: str
    addr: int  # 0 for an `oom` entry, which has none
    size: int  # an `oom` entry's: the request rounded as the allocator rounds it
    stream: int
    op: str  # where an `alloc` (or an `oom`'s failed request) came from, when its frames say
    time_us: int
    backward: bool = False  # made while the autograd engine ran
    device_free: int = 0  # an `oom` entry's: the bytes cudaMemGetInfo reported free
    labels: dict[str, str] = field(default_factory=dict)  # memplan's labels, when memplan exported the snapshot


@dataclass
class SnapshotBlock:
    """One block of a segment in the final snapshot state."""

    addr: int
    size: int
    requested: int
    state: str
    op: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class SnapshotSegment:
    """One segment of the final snapshot state, with its blocks in address order."""

    addr: int
    size: int
    stream: int
    small: bool
    expandable: bool
    blocks: list[SnapshotBlock]


@dataclass
class Snapshot:
    """The parts of a snapshot memplan uses, for one device."""

    device: int
    entries: list[SnapshotEntry]
    segments: list[SnapshotSegment]
    settings: dict[str, Any]
    optimizer_windows: list[tuple[int, int]] = field(default_factory=list)  # (start_us, end_us)


def top_user_frame(frames: Any) -> str:
    """'file.py:LINE fn' of the innermost Python frame outside torch itself (else any Python frame);
    for an allocation with no Python frame (the autograd engine's own thread), the autograd node
    that made it (`MeanBackward0`)."""
    if not isinstance(frames, list):
        return ""
    fallback = ""
    for f in frames:
        if not isinstance(f, dict):
            continue
        name, line = str(f.get("filename", "")), f.get("line", 0)
        if not name.endswith(".py"):
            continue
        label = f"{os.path.basename(name)}:{line} {f.get('name', '')}"
        if "/torch/" not in name.replace(os.sep, "/"):
            return label
        fallback = fallback or label
    return fallback or _autograd_node(frames)


def _autograd_node(frames: list) -> str:
    """The class of the innermost autograd node whose apply() is on the C++ stack, else the innermost
    aten op (`aten::sum`), else ''."""
    names = [str(f.get("name", "")) for f in frames if isinstance(f, dict)]
    for pattern, label in ((AUTOGRAD_NODE, "{}"), (ATEN_OP, "aten::{}")):
        for name in names:
            match = pattern.match(name)
            if match:
                return label.format(match.group(1))
    return ""


def memplan_labels(frames: Any) -> dict[str, str]:
    """The labels memplan's export put in a buffer's frames ({'op': 'aten::mm', 'category': ...}); {} for frames
    memplan did not write, and a phase or category outside the trace format's values is left out."""
    if not isinstance(frames, list) or not frames or not isinstance(frames[0], dict):
        return {}
    if frames[0].get("filename") != BUFFER_FRAME:
        return {}
    labels = {}
    for f in frames[1:]:
        kind, value = (f.get("filename"), f.get("name")) if isinstance(f, dict) else (None, None)
        if kind in LABEL_FRAMES and isinstance(value, str) and value in LABEL_VALUES.get(kind, (value,)):
            labels[kind] = value
    return labels


def in_backward(frames: Any) -> bool:
    """Whether the autograd engine is on the stack (the allocation belongs to a backward pass)."""
    return isinstance(frames, list) and any(
        isinstance(f, dict) and str(f.get("name", "")).startswith(ENGINE_FRAME) for f in frames
    )


def _int(d: dict, key: str, where: str) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool):
        raise SnapshotError(f"{where}.{key}: expected an integer, got {short_repr(v)}")
    return v


def _optimizer_windows(annotations: Any, device: int) -> list[tuple[int, int]]:
    """Time windows (µs) of `Optimizer.step` annotations on the device."""
    windows, start = [], None
    for a in annotations if isinstance(annotations, list) else []:
        if not isinstance(a, dict) or a.get("device", device) != device:
            continue
        if not str(a.get("name", "")).startswith("Optimizer.step"):
            continue
        if a.get("stage") == "START":
            start = a.get("time_us")
        elif a.get("stage") == "END" and isinstance(start, int) and isinstance(a.get("time_us"), int):
            windows.append((start, a["time_us"]))
            start = None
    return windows


def parse_snapshot(raw: Any, device: int | None = None) -> Snapshot:
    """Check the snapshot's shape and pick one device (default: the one with the most trace entries)."""
    if not isinstance(raw, dict):
        raise SnapshotError(f"snapshot: expected a dict at the top level, got {type(raw).__name__}")
    for key in KEYS:
        if not isinstance(raw.get(key), list):
            raise SnapshotError(f"snapshot.{key}: missing or not a list (is this a torch.cuda.memory snapshot?)")
    traces = raw["device_traces"]
    if device is None:
        counts = [len(t) if isinstance(t, list) else 0 for t in traces]
        device = max(range(len(counts)), key=lambda i: counts[i]) if counts and max(counts) > 0 else 0
    elif not 0 <= device < max(len(traces), 1):
        raise SnapshotError(f"device {device}: the snapshot has traces for devices 0..{len(traces) - 1}")
    entries_raw = traces[device] if device < len(traces) else []
    if not isinstance(entries_raw, list):
        raise SnapshotError(f"snapshot.device_traces[{device}]: expected a list")
    entries = []
    for i, e in enumerate(entries_raw):
        where = f"device_traces[{device}][{i}]"
        if not isinstance(e, dict) or not isinstance(e.get("action"), str):
            raise SnapshotError(f"{where}: expected an entry with an 'action'")
        action = e["action"]
        if action not in ACTIONS:
            raise SnapshotError(f"{where}: unknown action {short_repr(action)}; PyTorch writes {', '.join(ACTIONS)}")
        request = action in ("alloc", OOM)  # entries whose frames say where a request came from
        entries.append(
            SnapshotEntry(
                action=action,
                addr=0 if action == OOM else _int(e, "addr", where),
                size=_int(e, "size", where),
                stream=_int(e, "stream", where) if "stream" in e else 0,
                op=top_user_frame(e.get("frames")) if request else "",
                time_us=e["time_us"] if isinstance(e.get("time_us"), int) else 0,
                backward=request and in_backward(e.get("frames")),
                labels=memplan_labels(e.get("frames")) if action == "alloc" else {},
                device_free=_int(e, "device_free", where) if action == OOM else 0,
            )
        )
    segments = []
    for i, s in enumerate(raw["segments"]):
        where = f"segments[{i}]"
        if not isinstance(s, dict) or not isinstance(s.get("blocks"), list):
            raise SnapshotError(f"{where}: expected a segment with 'blocks'")
        if s.get("device", device) != device:
            continue
        blocks, addr = [], _int(s, "address", where)
        for j, b in enumerate(s["blocks"]):
            bw = f"{where}.blocks[{j}]"
            if not isinstance(b, dict):
                raise SnapshotError(f"{bw}: expected a dict")
            size = _int(b, "size", bw)
            blocks.append(
                SnapshotBlock(
                    addr=b["address"] if isinstance(b.get("address"), int) else addr,
                    size=size,
                    requested=b.get("requested_size", size) or 0,
                    state=str(b.get("state", "")),
                    op=top_user_frame(b.get("frames")),
                    labels=memplan_labels(b.get("frames")),
                )
            )
            addr = blocks[-1].addr + size
        total = _int(s, "total_size", where)
        small = s.get("segment_type") == "small" if "segment_type" in s else total == 2 * MiB
        segments.append(
            SnapshotSegment(
                addr=_int(s, "address", where),
                size=total,
                stream=_int(s, "stream", where) if "stream" in s else 0,
                small=small,
                expandable=bool(s.get("is_expandable", False)),
                blocks=blocks,
            )
        )
    settings = raw.get("allocator_settings") if isinstance(raw.get("allocator_settings"), dict) else {}
    return Snapshot(
        device=device,
        entries=entries,
        segments=sorted(segments, key=lambda s: s.addr),
        settings=settings,
        optimizer_windows=_optimizer_windows(raw.get("external_annotations"), device),
    )


def read_snapshot(path: str | os.PathLike, device: int | None = None) -> Snapshot:
    """Load a snapshot file safely and parse it for one device."""
    name = os.fspath(path)
    data = read_input(path, SnapshotError, limit=MAX_PICKLE_BYTES)
    try:
        return parse_snapshot(load_plain_pickle(data), device)
    except (SnapshotError, LimitError) as e:
        raise type(e)(f"{name}: {e}") from None


def is_live_block(block: SnapshotBlock) -> bool:
    """Whether a final-state block holds a tensor (allocated, or freed but awaiting stream events)."""
    return block.state.startswith("active")


def closing_actions(entries: list[SnapshotEntry]) -> tuple[str, ...]:
    """The actions that give a block back to the allocator: `free_completed` (PyTorch's own; a block freed while
    another stream still used it, record_stream, completes later), or `free_requested` in a snapshot recorded
    with `skip_actions=["free_completed"]`, which has no other."""
    if any(e.action in FREE_ACTIONS for e in entries) or not any(e.action == FREE_REQUESTED for e in entries):
        return FREE_ACTIONS
    return (FREE_REQUESTED,)


def _hex(addr: int) -> str:
    return f"{addr:#x}"


def snapshot_to_trace(snap: Snapshot, source: str = "") -> Trace:
    """One buffer per `alloc` entry plus one per block allocated before recording (alloc 0).

    A buffer's free time is its `free_completed` entry (when the allocator got the memory back);
    buffers never freed live to the end; pre-recording blocks come from frees without an
    allocation in the trace and from final allocated blocks the trace never allocated. A ring buffer
    (`max_entries`) keeps the latest entries, so only a block allocated before its first entry can be freed
    without an allocation; a second free of an address, an allocation at a live one and (in parse_snapshot) an
    unknown action are refused, naming the entry. Each `oom` entry takes a time of its own and is kept in meta
    `ooms`.
    """
    size, alloc, free, stream, addr, op, phase, module, category = [], [], [], [], [], [], [], [], []
    open_at: dict[int, int] = {}  # address -> buffer index of the live buffer there
    made_at: dict[int, int] = {}  # address -> entry index of its live buffer's allocation
    requested: dict[int, int] = {}  # address -> entry index of a free_requested not completed yet
    freed: dict[int, int] = {}  # address -> entry index of the free that gave it back (not allocated since)
    ooms: list[dict] = []
    windows = snap.optimizer_windows
    closing = closing_actions(snap.entries)

    def phase_of(e: SnapshotEntry) -> str:
        if any(a <= e.time_us <= b for a, b in windows):
            return "optimizer"
        return "backward" if e.backward else "other"

    def add(sz, t_alloc, st, a, o, ph, labels=None) -> int:
        labels = labels or {}
        size.append(sz), alloc.append(t_alloc), free.append(-1), stream.append(st), addr.append(a)
        op.append(labels.get("op", o)), phase.append(labels.get("phase", ph))
        module.append(labels.get("module", "")), category.append(labels.get("category", "unknown"))
        return len(size) - 1

    def refuse(k: int, what: str) -> SnapshotError:
        return SnapshotError(f"device_traces[{snap.device}][{k}]: {what}")

    def second_free(k: int, e: SnapshotEntry) -> None:
        if e.addr in freed:
            raise refuse(k, f"{e.action} of address {_hex(e.addr)}, already freed at entry {freed[e.addr]} and not "
                            "allocated since (a double free)")  # fmt: skip

    t = 0
    for k, e in enumerate(snap.entries):
        if e.action == "alloc":
            if e.addr in open_at or e.addr in requested:
                when = f"allocated at entry {made_at[e.addr]}" if e.addr in made_at else "allocated before recording"
                pending = f", its free requested at entry {requested[e.addr]}" if e.addr in requested else ""
                raise refuse(k, f"alloc at address {_hex(e.addr)}, which is still live ({when}{pending})")
            t += 1
            freed.pop(e.addr, None)
            made_at[e.addr] = k
            open_at[e.addr] = add(e.size, t, e.stream, e.addr, e.op, phase_of(e), e.labels)
        elif e.action in closing:
            second_free(k, e)
            t += 1
            requested.pop(e.addr, None)
            made_at.pop(e.addr, None)
            i = open_at.pop(e.addr, None)
            if i is None:  # allocated before recording began
                i = add(e.size, 0, e.stream, e.addr, "", "other")
            free[i] = t
            freed[e.addr] = k
        elif e.action == FREE_REQUESTED:
            second_free(k, e)
            if e.addr in requested:
                raise refuse(k, f"free_requested of address {_hex(e.addr)}, whose free was already requested at "
                                f"entry {requested[e.addr]} (a double free)")  # fmt: skip
            requested[e.addr] = k
        elif e.action == OOM:
            t += 1  # the failed request's own time: nothing else happens then
            ooms.append({"entry": k, "time": t, "size": e.size, "device_free": e.device_free, "stream": e.stream,
                         "time_us": e.time_us, "op": e.op, "phase": phase_of(e)})  # fmt: skip
    end = t + 1
    for seg in snap.segments:
        for b in seg.blocks:
            if is_live_block(b) and b.addr not in open_at:
                add(b.requested, 0, seg.stream, b.addr, b.op, "other", b.labels)
    free = [end if f < 0 else f for f in free]
    meta = {
        "source": "cuda-snapshot",
        "snapshot": source,
        "device": "cuda",
        "cuda_device": snap.device,
        "alloc_conf": str(snap.settings.get("PYTORCH_CUDA_ALLOC_CONF", "") or ""),
    }
    if ooms:
        meta["ooms"] = ooms
    columns = {"size": size, "alloc": alloc, "free": free, "stream": stream, "addr": addr, "op": op, "phase": phase}
    return make_trace({**columns, "module": module, "category": category}, meta=meta)


def read_snapshot_trace(path: str | os.PathLike, device: int | None = None) -> tuple[Snapshot, Trace]:
    """Read a snapshot file and import one device's trace: the parsed snapshot and its trace (every error names
    the file)."""
    snap = read_snapshot(path, device)
    try:
        return snap, snapshot_to_trace(snap, source=os.path.basename(os.fspath(path)))
    except (SnapshotError, TraceError, LimitError) as e:  # entries out of order; a value no trace can hold
        raise type(e)(f"{os.fspath(path)}: {e}") from None


def import_snapshot(path: str | os.PathLike, device: int | None = None) -> Trace:
    """Read a snapshot file and return its trace for one device."""
    return read_snapshot_trace(path, device)[1]


def import_summary(trace: Trace) -> dict:
    """Short JSON-ready description of an imported trace: counts, streams and the peak."""
    peak, when = trace.peak()
    before = int((trace.alloc == 0).sum())
    return {
        "buffers": len(trace),
        "allocated_in_trace": len(trace) - before,
        "before_recording": before,
        "never_freed": int((trace.free == trace.end).sum()),
        "events_end": trace.end,
        "streams": trace.streams,
        "peak_live_bytes": peak,
        "peak_time": when,
        "cuda_device": trace.meta.get("cuda_device"),
        "alloc_conf": trace.meta.get("alloc_conf", ""),
        "ooms": len(trace.meta.get("ooms", [])),
        "oom": last_oom(trace),
    }


def with_failed_requests(trace: Trace) -> tuple[Trace, list[int]]:
    """The imported trace with each out-of-memory error's request (meta `ooms`) made at the failure's own time
    and freed right after, and those buffers' indices: the program as it ran, for a simulation to serve, or fail
    at, the same request. What the program would have done had a request been served is not in the snapshot."""
    ooms = trace.meta.get("ooms") or []
    if not ooms:
        return trace, []
    columns = {c: getattr(trace, c).tolist() if c in INT_COLUMNS else list(getattr(trace, c)) for c in COLUMNS}
    start = len(trace)
    for o in ooms:
        row = {"size": o["size"], "alloc": o["time"], "free": o["time"], "stream": o["stream"], "addr": -1,
               "internal": 0, "category": "unknown", "phase": o.get("phase", "other"), "op": o.get("op", ""),
               "module": ""}  # fmt: skip
        for c in COLUMNS:
            columns[c].append(row[c])
    return make_trace(columns, trace.syncs, trace.meta), list(range(start, start + len(ooms)))


def last_oom(trace: Trace) -> dict | None:
    """The last out-of-memory error an imported snapshot recorded (meta `ooms`: its entry, time, the request's
    rounded size, device_free, stream, time_us, op, phase), or None."""
    ooms = trace.meta.get("ooms") or []
    return dict(ooms[-1]) if ooms else None
