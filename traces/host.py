"""The host bytes of a trace: the copies offloaded layers (planner/layers/offload.py) kept in host memory, which a
capture records in the trace's meta "host" as columns on the trace's logical clock, apart from the device's buffers
(which the problem, the solvers and the verifier plan: device bytes only)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memplan.errors import TraceError
from memplan.traces.format import Trace, live_bytes

COLUMNS = ("size", "alloc", "free", "module")


@dataclass(frozen=True)
class HostBytes:
    """Host copies as columns: copy i holds size[i] bytes on [alloc[i], free[i]) of the trace's logical time."""

    size: np.ndarray
    alloc: np.ndarray
    free: np.ndarray
    module: list[str]

    def __len__(self) -> int:
        return len(self.module)

    @property
    def moved(self) -> int:
        """Bytes moved each way: to the host in forward, and back in backward (each copy once)."""
        return int(self.size.sum())

    def live_at(self, t: int) -> int:
        """Host bytes live at logical time `t`."""
        return int(self.size[(self.alloc <= t) & (t < self.free)].sum())

    def peak(self) -> int:
        """The most host bytes live at once (the one live-bytes sweep, traces.format.live_bytes)."""
        if len(self) == 0:
            return 0
        return int(live_bytes(self.size, self.alloc, self.free, int(self.free.max())).max(initial=0))


def host_bytes(trace: Trace) -> HostBytes | None:
    """The trace's host copies (meta "host"); None when it has none (no layer offloaded); TraceError when the meta
    breaks the columns' form."""
    meta = trace.meta.get("host")
    if meta is None:
        return None
    if not isinstance(meta, dict) or any(not isinstance(meta.get(c), list) for c in COLUMNS):
        raise TraceError(f"meta host: expected an object of lists {', '.join(COLUMNS)}")
    if len({len(meta[c]) for c in COLUMNS}) != 1:
        raise TraceError("meta host: its columns differ in length")
    numbers = [meta[c] for c in COLUMNS[:3]]
    if not all(type(v) is int and v >= 0 for column in numbers for v in column):
        raise TraceError("meta host: size, alloc and free must be whole numbers of at least 0")
    size, alloc, free = (np.asarray(column, dtype=np.int64) for column in numbers)
    if np.any(free < alloc) or np.any(free > trace.end):
        raise TraceError(f"meta host: every copy must be freed after it is made, by the trace's end ({trace.end})")
    return HostBytes(size, alloc, free, [str(m) for m in meta["module"]])


def host_summary(trace: Trace, device_peak_time: int) -> dict[str, int]:
    """The host copies in figures (empty without any): how many, bytes moved each way, the host's peak and the host
    bytes live at the device's peak."""
    host = host_bytes(trace)
    if host is None:
        return {}
    return {
        "copies": len(host),
        "moved": host.moved,
        "peak_bytes": host.peak(),
        "at_device_peak": host.live_at(device_peak_time),
    }
