"""The memplan-trace/1 format: the Trace type, its validation, and loading and saving it.

A trace is columnar: buffer i has a requested size, a logical allocation time and a
logical free time (live on [alloc, free)), a stream, labels and its original address.
Logical time counts allocation and free events in the order the allocator saw them.
Time 0 stands for "before recording": buffers that already existed when recording began
(parameters, optimizer state, blocks a CUDA snapshot shows only in its segments) have
alloc 0, and the recorded events take times 1, 2, ... A buffer never freed has free = end.

A trace may carry its whole program (`Trace.program`, the file's "program" section): every buffer from the
program's first allocation (construction, moves, warm-up steps, the measured step and what follows), with each
training step's window marked. The trace itself is the measured step as always (its digest, plans and views are
the step's); the program is what a verdict simulates, since the cache the measured step meets was shaped by it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memplan.errors import TraceError
from memplan.files import atomic_write, read_json
from memplan.limits import MAX_JSON_DEPTH, MAX_STREAMS, TIME_SLACK, LimitError, check_nesting, short_repr

FORMAT = "memplan-trace/1"
CATEGORIES = (
    "parameter",
    "gradient",
    "optimizer",
    "activation",
    "input",
    "temporary",
    "workspace",
    "communication",
    "unknown",
)
PHASES = ("forward", "backward", "optimizer", "other")
INT_COLUMNS = ("size", "alloc", "free", "stream", "addr", "internal")
STR_COLUMNS = ("category", "phase", "op", "module")
COLUMNS = INT_COLUMNS + STR_COLUMNS
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass
class Trace:
    """Every buffer of one recorded step; integer columns are int64 arrays, labels are lists."""

    size: np.ndarray
    alloc: np.ndarray
    free: np.ndarray
    stream: np.ndarray
    addr: np.ndarray  # original address, -1 when unknown
    internal: np.ndarray  # 1: no op returned it (a kernel's scratch, a wrapped Python number); fake tensors miss it
    category: list[str]
    phase: list[str]
    op: list[str]
    module: list[str]
    syncs: list[tuple[int, int, int]] = field(default_factory=list)  # (time, from_stream, to_stream)
    meta: dict[str, Any] = field(default_factory=dict)
    program: Program | None = None  # the whole program this step ran in, when the capture recorded it

    def __len__(self) -> int:
        return int(self.size.shape[0])

    @property
    def end(self) -> int:
        """The end of the recorded window: one past the last event."""
        if len(self) == 0:
            return 0
        return int(max(self.free.max(), self.alloc.max() + 1))

    @property
    def recorded(self) -> np.ndarray:
        """Indices of the buffers allocated during recording, in allocation order."""
        idx = np.nonzero(self.alloc > 0)[0]
        return idx[np.argsort(self.alloc[idx], kind="stable")]

    @property
    def streams(self) -> list[int]:
        return sorted({int(s) for s in self.stream})

    def live_bytes(self) -> np.ndarray:
        """Bytes live during each logical step t in [0, end): live[t] = sum of sizes with alloc <= t < free."""
        return live_bytes(self.size, self.alloc, self.free, self.end)

    def peak(self) -> tuple[int, int]:
        """(peak live bytes, first logical time at which it is reached)."""
        if len(self) == 0:
            return 0, 0
        live = self.live_bytes()
        t = int(np.argmax(live))
        return int(live[t]), t

    def live_at(self, t: int) -> np.ndarray:
        """Indices of the buffers live at logical time t."""
        return np.nonzero((self.alloc <= t) & (self.free > t))[0]


@dataclass(frozen=True)
class ProgramStep:
    """One training step's window in a program's logical time: its events are those at times [start, end)."""

    start: int  # logical time of the step's first event
    end: int  # one past its last event
    measured: bool = False  # the step the trace is


@dataclass
class Program:
    """A whole program as one trace (times count every event from the program's first allocation; alloc 0 only for
    storages made before recording began) and the windows of its training steps, in order."""

    trace: Trace  # every buffer of the program
    steps: list[ProgramStep]  # the training steps, in order; at most one measured

    @property
    def measured(self) -> int | None:
        """The index of the measured step among `steps`, None when none is."""
        return next((k for k, s in enumerate(self.steps) if s.measured), None)

    def where(self, t: int) -> str:
        """The part of the program logical time `t` falls in, in words: `construction`, `step 2 (measured)`,
        `between steps 1 and 2`, `after step 3`."""
        for k, s in enumerate(self.steps, start=1):
            if s.start <= t < s.end:
                return f"step {k}" + (" (measured)" if s.measured else "")
            if t < s.start:
                return "construction" if k == 1 else f"between steps {k - 1} and {k}"
        return f"after step {len(self.steps)}" if self.steps else "the program"


def live_bytes(size: np.ndarray, alloc: np.ndarray, free: np.ndarray, end: int) -> np.ndarray:
    """Per logical time t in [0, end), the sum of `size` over the buffers with alloc <= t < free: the one
    sweep behind every live-bytes series (a trace's, a category's, a plan's)."""
    delta = np.zeros(end + 1, dtype=np.int64)
    np.add.at(delta, alloc, size)
    np.add.at(delta, free, -size)
    return np.cumsum(delta)[:-1]


def columns_digest(size, alloc, free, stream, syncs=()) -> str:
    """sha256 over the int64 little-endian size, alloc, free and stream columns and the syncs."""
    h = hashlib.sha256()
    for col in (size, alloc, free, stream):
        h.update(np.ascontiguousarray(col, dtype="<i8").tobytes())
    h.update(np.asarray(list(syncs), dtype="<i8").reshape(-1).tobytes())
    return "sha256:" + h.hexdigest()


def trace_digest(trace: Trace) -> str:
    """The digest a plan records to name its trace (columns_digest of the trace's columns and syncs)."""
    return columns_digest(trace.size, trace.alloc, trace.free, trace.stream, trace.syncs)


def make_trace(columns: dict[str, Any], syncs=(), meta=None) -> Trace:
    """Build and validate a Trace from plain columns (lists or arrays); missing labels get defaults."""
    buffers = {c: [int(x) for x in v] if c in INT_COLUMNS else list(v) for c, v in columns.items()}
    data = {
        "format": FORMAT,
        "meta": dict(meta or {}),
        "buffers": buffers,
        "syncs": [[int(x) for x in s] for s in syncs],
    }
    return from_dict(data)


def _int_column(name: str, values: Any, n: int | None) -> np.ndarray:
    if not isinstance(values, list):
        raise TraceError(f"buffers.{name}: expected a list, got {type(values).__name__}")
    if n is not None and len(values) != n:
        raise TraceError(f"buffers.{name}: has {len(values)} entries but buffers.size has {n}")
    if set(map(type, values)) <= {int}:  # the usual case, checked at C speed (a bool's type is not int)
        try:
            return np.array(values, dtype=np.int64) if values else np.zeros(0, dtype=np.int64)
        except OverflowError:
            pass  # the loop below names the entry
    for i, v in enumerate(values):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TraceError(f"buffers.{name}[{i}]: expected an integer, got {short_repr(v)}")
        if not INT64_MIN <= v <= INT64_MAX:
            raise TraceError(f"buffers.{name}[{i}]: {v} does not fit in 64 bits")
    return np.asarray(values, dtype=np.int64) if values else np.zeros(0, dtype=np.int64)


def _str_column(name: str, values: Any, n: int) -> list[str]:
    if not isinstance(values, list):
        raise TraceError(f"buffers.{name}: expected a list, got {type(values).__name__}")
    if len(values) != n:
        raise TraceError(f"buffers.{name}: has {len(values)} entries but buffers.size has {n}")
    if set(map(type, values)) <= {str}:  # the usual case, checked at C speed
        return list(values)
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise TraceError(f"buffers.{name}[{i}]: expected a string, got {short_repr(v)}")
    return list(values)


def from_dict(data: Any) -> Trace:
    """Validate a decoded memplan-trace/1 document and return the Trace; errors name the field."""
    if not isinstance(data, dict):
        raise TraceError("trace: expected a JSON object at the top level")
    fmt = data.get("format")
    if fmt != FORMAT:
        raise TraceError(f"format: unknown format version {fmt!r} (expected {FORMAT!r})")
    meta = data.get("meta", {})
    if not isinstance(meta, dict):
        raise TraceError("meta: expected an object")
    try:
        check_nesting(meta, MAX_JSON_DEPTH)
    except LimitError as e:
        raise LimitError(f"meta: {e} (limits.MAX_JSON_DEPTH)") from None
    buffers = data.get("buffers")
    if not isinstance(buffers, dict):
        raise TraceError("buffers: missing or not an object")
    for name in ("size", "alloc", "free"):
        if name not in buffers:
            raise TraceError(f"buffers.{name}: missing column")
    unknown = set(buffers) - set(COLUMNS)
    if unknown:
        raise TraceError(f"buffers.{sorted(unknown)[0]}: unknown column")
    size = _int_column("size", buffers["size"], None)
    n = len(size)
    cols: dict[str, Any] = {"size": size}
    for name in INT_COLUMNS[1:]:
        default = [0] * n if name in ("stream", "internal") else [-1] * n
        cols[name] = _int_column(name, buffers.get(name, default), n)
    for name in STR_COLUMNS:
        default = {"category": "unknown", "phase": "other"}.get(name, "")
        cols[name] = _str_column(name, buffers.get(name, [default] * n), n)

    for name in ("size", "alloc", "free", "stream"):  # stream ids count from 0 (the default stream)
        bad = np.nonzero(cols[name] < 0)[0]
        if len(bad):
            i = int(bad[0])
            raise TraceError(f"buffers.{name}[{i}]: negative value {int(cols[name][i])}")
    bad = np.nonzero(cols["free"] < cols["alloc"])[0]
    if len(bad):
        i = int(bad[0])
        raise TraceError(
            f"buffers.free[{i}]: free at {int(cols['free'][i])} is before its allocation at {int(cols['alloc'][i])}"
        )
    bad = np.nonzero((cols["internal"] != 0) & (cols["internal"] != 1))[0]
    if len(bad):
        i = int(bad[0])
        raise TraceError(f"buffers.internal[{i}]: {int(cols['internal'][i])} is not 0 or 1")
    for name, allowed in (("category", CATEGORIES), ("phase", PHASES)):
        if set(cols[name]) <= set(allowed):
            continue
        for i, v in enumerate(cols[name]):
            if v not in allowed:
                raise TraceError(
                    f"buffers.{name}[{i}]: unknown {name} {short_repr(v)} (expected one of {', '.join(allowed)})"
                )

    syncs_raw = data.get("syncs", [])
    if not isinstance(syncs_raw, list):
        raise TraceError("syncs: expected a list of [time, from_stream, to_stream]")
    syncs = []
    for i, s in enumerate(syncs_raw):
        if not isinstance(s, list) or len(s) != 3 or not all(isinstance(x, int) and not isinstance(x, bool) for x in s):
            raise TraceError(f"syncs[{i}]: expected [time, from_stream, to_stream] integers, got {short_repr(s)}")
        if s[0] < 0:
            raise TraceError(f"syncs[{i}]: negative time {s[0]}")
        if min(s[1], s[2]) < 0:
            raise TraceError(f"syncs[{i}]: negative stream {min(s[1], s[2])}")
        syncs.append((s[0], s[1], s[2]))
    _check_bounds(cols, syncs)
    program = _program(data["program"]) if data.get("program") is not None else None
    return Trace(syncs=syncs, meta=meta, program=program, **cols)


def _program(raw: Any) -> Program:
    """The "program" section: a trace document of its own (without a program) and its steps' windows."""
    if not isinstance(raw, dict) or not isinstance(raw.get("steps"), list):
        raise TraceError("program: expected an object with the program's buffers and its steps")
    inner = {k: v for k, v in raw.items() if k != "steps"}
    if "program" in inner:
        raise TraceError("program.program: a program holds no program of its own")
    try:
        trace = from_dict({"format": FORMAT, **inner})
    except (TraceError, LimitError) as e:
        raise type(e)(f"program.{e}") from None
    steps, end = [], trace.end
    for i, step in enumerate(raw["steps"]):
        ok = isinstance(step, list) and len(step) == 3 and all(type(x) is int for x in step[:2])
        if not ok or not isinstance(step[2], bool) or not 0 <= step[0] <= step[1] <= max(end, 1):
            raise TraceError(f"program.steps[{i}]: expected [start, end, measured] within the program's {end} "
                             f"events, got {short_repr(step)}")  # fmt: skip
        if steps and step[0] < steps[-1].end:
            raise TraceError(f"program.steps[{i}]: starts before step {i} ends")
        steps.append(ProgramStep(step[0], step[1], step[2]))
    if sum(s.measured for s in steps) > 1:
        raise TraceError("program.steps: more than one step is marked measured")
    return Program(trace, steps)


def _check_bounds(cols: dict[str, Any], syncs: list[tuple[int, int, int]]) -> None:
    """LimitError for times beyond what the trace's events can reach, or more streams than reuse safety can hold
    (memplan/limits.py)."""
    n = len(cols["size"])
    latest = 2 * n + TIME_SLACK  # two events per buffer, and room for gaps in a hand-made trace
    for name in ("alloc", "free"):
        bad = np.nonzero(cols[name] > latest)[0]
        if len(bad):
            i = int(bad[0])
            raise LimitError(
                f"buffers.{name}[{i}]: time {int(cols[name][i])} is beyond {latest:,}, twice the {n:,} buffers plus "
                f"{TIME_SLACK:,} (logical times count events; limits.TIME_SLACK)"
            )
    for i, (t, _, _) in enumerate(syncs):
        if t > latest:
            raise LimitError(f"syncs[{i}]: time {t} is beyond {latest:,} (logical times count events)")
    streams = len(np.unique(cols["stream"])) if n else 0
    if streams > MAX_STREAMS:
        raise LimitError(f"buffers.stream: {streams:,} distinct streams; memplan handles at most {MAX_STREAMS} "
                         "(limits.MAX_STREAMS)")  # fmt: skip


def to_dict(trace: Trace) -> dict[str, Any]:
    """The JSON-ready memplan-trace/1 document of a trace."""
    buffers = {name: [int(x) for x in getattr(trace, name)] for name in INT_COLUMNS}
    buffers.update({name: list(getattr(trace, name)) for name in STR_COLUMNS})
    data = {"format": FORMAT, "meta": trace.meta, "buffers": buffers, "syncs": [list(s) for s in trace.syncs]}
    if trace.program is not None:
        inner = to_dict(trace.program.trace)
        del inner["format"]
        inner.pop("program", None)
        data["program"] = {**inner, "steps": [[s.start, s.end, s.measured] for s in trace.program.steps]}
    return data


def load(path: str | os.PathLike) -> Trace:
    """Read and validate a trace (.json or .json.gz)."""
    name = os.fspath(path)
    data = read_json(path, TraceError)
    try:
        return from_dict(data)
    except (TraceError, LimitError) as e:
        raise type(e)(f"{name}: {e}") from None


def save(trace: Trace, path: str | os.PathLike) -> None:
    """Write a trace atomically; gzipped when the name ends in .gz."""
    from_dict(to_dict(trace))  # never write a trace that would not load back
    atomic_write(path, json.dumps(to_dict(trace), separators=(",", ":")))
