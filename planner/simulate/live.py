"""PyTorch's caching allocator simulated live, as a fake GPU's program runs (`memplan check`): each allocation the
capture records is served at once by the simulated allocator at the GPU's capacity, so `torch.cuda`'s memory
statistics answer from it and a request it cannot serve raises `torch.OutOfMemoryError` in the program with PyTorch's
message, where the GPU would raise it. It implements traces.cuda.fake_device's DeviceMemory for the fake CUDA runtime.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from memplan.errors import MemplanError
from memplan.planner.simulate.alloc_conf import AllocConf
from memplan.planner.simulate.caching_allocator import CachingAllocator, SimulatedOOM, gpu_out_of_memory
from memplan.planner.simulate.snapshot_export import caching_snapshot
from memplan.traces.format import Program
from memplan.traces.recorder import Events


@dataclass(frozen=True)
class RaisedOOM:
    """An out-of-memory error the live allocator raised in the program."""

    event: int  # the allocation's position among the events fed (1-based: the program's logical time)
    size: int  # bytes requested
    op: int  # the recorder's label ids of the op and module that asked
    module: int
    phase: int
    allocated: int  # the allocator's allocated and reserved bytes then
    reserved: int
    message: str  # PyTorch's error text


@dataclass
class LiveDevice:
    """A fake GPU's memory: a caching allocator at `memory - outside` bytes fed the program's events in order."""

    memory: int  # the GPU's total memory
    outside: int  # what it holds outside the caching allocator
    conf: AllocConf = field(default_factory=AllocConf)
    raised: list[RaisedOOM] = field(default_factory=list)  # every error raised, in order (a program may catch them)
    events: int = 0  # events fed so far

    def __post_init__(self) -> None:
        self.allocator = CachingAllocator(self.conf, self.memory - self.outside)
        self._address: dict[int, int] = {}  # storage key -> its block's address, while allocated
        self.max_allocated = self.max_reserved = 0  # since the last reset
        self.peak_allocated = self.peak_reserved = 0  # over the whole program
        self._program: Callable[[], Program] | None = None  # the capture's program so far (attach)
        # allocated and reserved bytes after each event fed, in order: what the program's memory did
        self._allocated_after, self._reserved_after = array("q"), array("q")

    # -- the feed -----------------------------------------------------------------------------------
    def feed(self, events: Events) -> None:
        """Serve `events` (allocations and frees, in order); an allocation that cannot be served raises
        torch.OutOfMemoryError after the rest are taken (its storage is dropped when the error unwinds the op)."""
        failed: RaisedOOM | None = None
        columns = (events.key, events.size, events.op, events.module, events.phase)
        a, allocated_after, reserved_after = self.allocator, self._allocated_after, self._reserved_after
        for key, size, op, module, phase in zip(*(c.tolist() for c in columns)):
            self.events += 1
            if size < 0:
                address = self._address.pop(key, None)
                if address is not None:
                    a.free(address)
            else:
                try:
                    self._address[key] = a.malloc(size)
                    self._peaks()
                except SimulatedOOM:
                    if failed is None:
                        failed = self._raised(size, op, module, phase)
            allocated_after.append(a.allocated)
            reserved_after.append(a.reserved)
        if failed is not None:
            raise torch.OutOfMemoryError(failed.message)

    def _raised(self, size: int, op: int, module: int, phase: int) -> RaisedOOM:
        a = self.allocator
        error = gpu_out_of_memory(size, self.conf, self.memory, self.outside, a.allocated, a.reserved)
        oom = RaisedOOM(self.events, size, op, module, phase, a.allocated, a.reserved, error.message)
        self.raised.append(oom)
        return oom

    def _peaks(self) -> None:
        a = self.allocator
        self.max_allocated, self.max_reserved = max(self.max_allocated, a.allocated), max(self.max_reserved, a.reserved)
        self.peak_allocated = max(self.peak_allocated, a.allocated)
        self.peak_reserved = max(self.peak_reserved, a.reserved)

    def series(self, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Allocated and reserved bytes at each logical time of the program in [0, end) (event k, 1-based, is time k),
        as the program met them: with what its caught out-of-memory errors and `empty_cache` calls released."""
        done = min(len(self._reserved_after), max(end - 1, 0))
        allocated, reserved = np.zeros(end, dtype=np.int64), np.zeros(end, dtype=np.int64)
        allocated[1 : done + 1] = np.array(self._allocated_after[:done], dtype=np.int64)
        reserved[1 : done + 1] = np.array(self._reserved_after[:done], dtype=np.int64)
        if 0 < done + 1 < end:  # times after the last event keep its values
            allocated[done + 1 :], reserved[done + 1 :] = allocated[done], reserved[done]
        return allocated, reserved

    # -- traces.cuda.fake_device.DeviceMemory -----------------------------------------------------------------
    def allocated(self) -> int:
        """torch.cuda.memory_allocated(): bytes in allocated blocks."""
        return self.allocator.allocated

    def reserved(self) -> int:
        """torch.cuda.memory_reserved(): bytes in segments."""
        return self.allocator.reserved

    def peak(self, kind: str) -> int:
        """max_memory_allocated() / max_memory_reserved() since the last reset."""
        return self.max_allocated if kind == "allocated" else self.max_reserved

    def reset_peaks(self) -> None:
        """reset_peak_memory_stats(): the peaks restart from the bytes held now."""
        self.max_allocated, self.max_reserved = self.allocator.allocated, self.allocator.reserved

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): release every entirely free cached segment."""
        self.allocator.empty_cache()

    def free_bytes(self) -> int:
        """mem_get_info()'s free: the GPU's memory less what the allocator reserved and what lies outside it."""
        return self.memory - self.outside - self.allocator.reserved

    def attach(self, program: Callable[[], Program]) -> None:
        """Where the program so far comes from (the capture's), for snapshots."""
        self._program = program

    def snapshot(self) -> dict:
        """torch.cuda.memory._snapshot(): the program so far on the caching allocator (planner/simulate/
        snapshot_export.py: every allocation with its op, module, phase and category as frames)."""
        if self._program is None:
            raise MemplanError("a snapshot needs the program: attach() the capture first")
        return caching_snapshot(self._program().trace, self.conf, name="memplan check")

    def stats(self) -> dict[str, int]:
        """torch.cuda.memory_stats()'s keys a program reads most: current and peak allocated and reserved bytes, the
        out-of-memory errors raised."""
        return {
            "allocated_bytes.all.current": self.allocated(),
            "allocated_bytes.all.peak": self.max_allocated,
            "reserved_bytes.all.current": self.reserved(),
            "reserved_bytes.all.peak": self.max_reserved,
            "num_ooms": len(self.raised),
        }
