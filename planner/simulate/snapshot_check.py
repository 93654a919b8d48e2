"""Judge the caching-allocator simulator against a real CUDA snapshot, address by address, and a whole program's.

The segments that existed before recording are rebuilt from the snapshot's final `segments`
(with the blocks allocated before recording in place), new segments get the base addresses of
the trace's `segment_alloc` entries, and every `alloc` entry is replayed: the simulator must
return the address the real allocator returned and create the same new segments at the same step.

A whole program's snapshot (recorded from before its first allocation; `check_program`) is simulated as memplan
simulates any trace, from an empty cache, at the device's capacity, with the request of each out-of-memory error
made where it failed: its peak reserved must be the one the snapshot's own segment entries give, and it must fail
at the same request with the same reserved (so the same free) memory.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from itertools import accumulate

from memplan.errors import MemplanError
from memplan.planner.simulate.alloc_conf import AllocConf, conf_from_snapshot_settings
from memplan.planner.simulate.caching_allocator import (
    MIN_BLOCK,
    SMALL_BUFFER,
    SMALL_SIZE,
    CachingAllocator,
    SimResult,
    round_size,
    simulate_caching,
)
from memplan.traces.format import Trace
from memplan.traces.inputs.snapshot import (
    FREE_ACTIONS,
    OOM,
    Snapshot,
    is_live_block,
    snapshot_to_trace,
    with_failed_requests,
)

SEGMENT_CHANGE = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}  # reserved +/-


@dataclass
class SnapshotCheck:
    """How closely the simulator reproduced a snapshot's allocator decisions."""

    allocs: int  # alloc entries replayed
    addr_matches: int  # of those, served at the real address
    segment_decisions: int  # alloc entries for which the real allocator created segments
    segment_matches: int  # of those, the simulator created the same segment sizes at the same step
    extra_segments: int  # steps where the simulator created a segment and the real allocator did not
    segments_before: int  # segments rebuilt as existing before recording
    peak_allocated: int
    peak_reserved: int
    mismatches: list[dict] = field(default_factory=list)  # the first few, for diagnosis

    @property
    def exact(self) -> bool:
        """Every address and every new-segment decision reproduced."""
        return (
            self.addr_matches == self.allocs
            and self.segment_matches == self.segment_decisions
            and self.extra_segments == 0
        )

    def summary(self) -> dict:
        """The counts as a JSON-ready dict."""
        return {
            "allocs": self.allocs,
            "addr_matches": self.addr_matches,
            "segment_decisions": self.segment_decisions,
            "segment_matches": self.segment_matches,
            "extra_segments": self.extra_segments,
            "segments_before": self.segments_before,
            "peak_allocated": self.peak_allocated,
            "peak_reserved": self.peak_reserved,
            "exact": self.exact,
        }


def _blocks_before_recording(snap: Snapshot, conf: AllocConf) -> dict[int, tuple[int, bool]]:
    """Blocks allocated before recording: address -> (block size, exact?).

    Blocks still allocated at the end carry their exact size; blocks freed during recording
    carry their request, rounded as the allocator would.
    """
    allocated_in_trace: set[int] = set()
    before: dict[int, tuple[int, bool]] = {}
    open_addrs: set[int] = set()
    for e in snap.entries:
        if e.action == "alloc":
            open_addrs.add(e.addr)
            allocated_in_trace.add(e.addr)
        elif e.action in FREE_ACTIONS:
            if e.addr in open_addrs:
                open_addrs.discard(e.addr)
            elif e.addr not in before:
                before[e.addr] = (round_size(e.size, conf), False)
    for seg in snap.segments:
        for b in seg.blocks:
            if is_live_block(b) and b.addr not in open_addrs:
                before[b.addr] = (b.size, True)
    return before


def _initial_layout(
    seg_addr: int, seg_size: int, small: bool, inside: list[tuple[int, int, bool]], used: list[int], conf: AllocConf
) -> list[tuple[int, bool]]:
    """Blocks [(size, allocated)] of a segment holding the given allocated blocks (addr, size, exact).

    A block known only by its request is rounded, then keeps the leftover up to the next known
    block start (the next such block, or an address the trace allocates later; `used` is sorted)
    when that leftover is too small to be a block of its own (< 512 B small, <= 1 MiB large).
    """
    out, cursor = [], seg_addr
    end = seg_addr + seg_size
    mss = conf.max_split_size if conf.max_split_size is not None else 1 << 62
    for k, (addr, size, exact) in enumerate(inside):
        if addr > cursor:
            out.append((addr - cursor, False))
        nxt = inside[k + 1][0] if k + 1 < len(inside) else end
        size = min(size, nxt - addr)  # a rounding that differs from the real one must not overlap
        j = bisect_left(used, addr + size)
        if j < len(used) and used[j] < nxt:
            nxt = used[j]
        gap = nxt - (addr + size)
        if not exact and gap > 0:
            split = gap >= MIN_BLOCK if small else (size < mss and gap > SMALL_SIZE)
            if not split:
                size += gap
        out.append((size, True))
        cursor = addr + size
    if cursor < end:
        out.append((end - cursor, False))
    return out


class SnapshotCheckError(MemplanError):
    """A snapshot the address-by-address replay cannot rebuild."""


def replay_snapshot(snap: Snapshot, conf: AllocConf | None = None, keep_mismatches: int = 10) -> SnapshotCheck:
    """Replay a snapshot's own trace through the simulator and count the matching decisions."""
    conf = conf or conf_from_snapshot_settings(snap.settings)
    if conf.expandable_segments or any(s.expandable for s in snap.segments):
        raise SnapshotCheckError("replaying a snapshot recorded with expandable segments is not supported")
    new_bases = {e.addr for e in snap.entries if e.action == "segment_alloc"}
    freed_first: dict[int, tuple[int, int]] = {}  # segments freed in the trace before any segment_alloc there
    seen_alloc: set[int] = set()
    for e in snap.entries:
        if e.action == "segment_alloc":
            seen_alloc.add(e.addr)
        elif e.action == "segment_free" and e.addr not in seen_alloc and e.addr not in freed_first:
            freed_first[e.addr] = (e.size, e.stream)

    pending: deque[tuple[int, int]] = deque()  # segment_alloc entries not yet claimed
    made: list[int] = []  # segment sizes the simulator created during the current malloc

    def segment_address(size: int, stream: int, small: bool) -> int:
        made.append(size)
        if pending:
            return pending.popleft()[0]
        return fake.pop()

    fake = [(1 << 49) + k * (1 << 36) for k in range(4096)]
    a = CachingAllocator(conf, None, segment_address)

    before = _blocks_before_recording(snap, conf)
    initial = [(s.addr, s.size, s.stream, s.small) for s in snap.segments if s.addr not in new_bases]
    initial += [(addr, size, stream, size == SMALL_BUFFER) for addr, (size, stream) in freed_first.items()]
    starts = sorted(before)
    used = sorted({e.addr for e in snap.entries if e.action == "alloc"})
    for addr, size, stream, small in sorted(initial):
        lo, hi = bisect_left(starts, addr), bisect_left(starts, addr + size)
        inside = [(x, before[x][0], before[x][1]) for x in starts[lo:hi]]
        a.add_segment(addr, size, stream, small, _initial_layout(addr, size, small, inside, used, conf))

    sim_of: dict[int, int] = {}  # real address of a live buffer -> its simulated address
    allocs = addr_ok = seg_dec = seg_ok = extra = 0
    mismatches: list[dict] = []
    peak_alloc, peak_res = a.allocated, a.reserved
    for k, e in enumerate(snap.entries):
        if e.action == "segment_alloc":
            pending.append((e.addr, e.size))
        elif e.action == "alloc":
            real_segments = [s for _, s in pending]
            made.clear()
            got = a.malloc(e.size, e.stream)
            pending.clear()
            allocs += 1
            addr_ok += got == e.addr
            if real_segments:
                seg_dec += 1
                seg_ok += made == real_segments
            elif made:
                extra += 1
            if (got != e.addr or made != real_segments) and len(mismatches) < keep_mismatches:
                mismatches.append(
                    {
                        "entry": k,
                        "size": e.size,
                        "real_addr": e.addr,
                        "sim_addr": got,
                        "real_segments": real_segments,
                        "sim_segments": list(made),
                    }
                )
            sim_of[e.addr] = got
            peak_alloc, peak_res = max(peak_alloc, a.allocated), max(peak_res, a.reserved)
        elif e.action in FREE_ACTIONS:
            a.free(sim_of.pop(e.addr, e.addr))
        elif e.action == "segment_free":
            if any(s.addr == e.addr for s in a.segments.values()):
                a.empty_cache()  # the real allocator released cached segments here
    return SnapshotCheck(
        allocs=allocs,
        addr_matches=addr_ok,
        segment_decisions=seg_dec,
        segment_matches=seg_ok,
        extra_segments=extra,
        segments_before=len(initial),
        peak_allocated=peak_alloc,
        peak_reserved=peak_res,
        mismatches=mismatches,
    )


def reserved_by_entry(snap: Snapshot) -> tuple[int, list[int]]:
    """The allocator's reserved bytes before the first trace entry and after each one, from the snapshot's own
    segment entries (cudaMalloc/cudaFree, expandable segments' map/unmap), ending at its final segments' sum:
    a snapshot recorded mid-program starts from what the allocator held when recording began (0 for a whole
    program's)."""
    changes = [SEGMENT_CHANGE.get(e.action, 0) * e.size for e in snap.entries]
    start = sum(seg.size for seg in snap.segments) - sum(changes)
    return start, list(accumulate(changes, initial=start))[1:]


def oom_entries(snap: Snapshot) -> list[int]:
    """The indices of the snapshot's `oom` entries (its out-of-memory errors), in order."""
    return [k for k, e in enumerate(snap.entries) if e.action == OOM]


def capacity_at_oom(snap: Snapshot) -> int | None:
    """What the allocator could have reserved at the snapshot's first out-of-memory error: what it held then (its
    retries done) plus the free bytes the device reported (`device_free`); None without an error. The GPU's total
    less this is what it held outside the allocator then, other processes included."""
    ooms = oom_entries(snap)
    if not ooms:
        return None
    _, reserved = reserved_by_entry(snap)
    return reserved[ooms[0]] + snap.entries[ooms[0]].device_free


@dataclass(frozen=True)
class ProgramCheck:
    """A snapshot's own figures against the simulator's run of its imported trace (up to its first out-of-memory
    error, when it has one): peak reserved, and the request that failed with the memory reserved then."""

    capacity: int | None  # the allocator's capacity simulated (None: unlimited)
    from_start: bool  # recorded from the program's first allocation: no block from before recording
    real_max_reserved: int  # the most the snapshot's own segment entries reserved (up to its first error)
    real_oom_size: int | None  # the first error's request, rounded as the allocator rounds it
    real_oom_reserved: int | None  # reserved when it failed (its retries done)
    real_oom_free: int | None  # the bytes the device reported free then
    simulated: SimResult  # the trace with its failed requests (with_failed_requests), at the capacity
    requests: tuple[int, ...]  # the failed requests' buffers in the simulated trace

    @property
    def fails_at_the_same_request(self) -> bool:
        """The simulation failed at the snapshot's first failed request (and nowhere before), with the same reserved
        memory; True when neither failed."""
        oom = self.simulated.oom
        if self.real_oom_size is None or oom is None:
            return self.real_oom_size is None and oom is None
        return oom.buffer == self.requests[0] and oom.reserved == self.real_oom_reserved

    @property
    def exact(self) -> bool:
        """The simulation's peak reserved is the snapshot's, and it fails where the snapshot did (or neither)."""
        return self.simulated.peak_reserved == self.real_max_reserved and self.fails_at_the_same_request

    def summary(self) -> dict:
        """The figures as a JSON-ready dict."""
        oom = self.simulated.oom
        return {
            "capacity": self.capacity,
            "from_start": self.from_start,
            "real_max_reserved": self.real_max_reserved,
            "simulated_max_reserved": self.simulated.peak_reserved,
            "simulated_max_allocated": self.simulated.peak_allocated,
            "real_oom_size": self.real_oom_size,
            "real_oom_reserved": self.real_oom_reserved,
            "real_oom_free": self.real_oom_free,
            "simulated_oom_size": oom.size if oom else None,
            "simulated_oom_allocated": oom.allocated if oom else None,
            "simulated_oom_reserved": oom.reserved if oom else None,
            "fails_at_the_same_request": self.fails_at_the_same_request,
            "exact": self.exact,
        }


def check_program(snap: Snapshot, capacity: int | None, conf: AllocConf | None = None,
                  trace: Trace | None = None) -> ProgramCheck:  # fmt: skip
    """Simulate a snapshot's imported trace (`trace`, imported here when not given) with its failed requests at
    `capacity` (the GPU's memory less what it holds outside the allocator) under `conf` (default: the snapshot's
    allocator settings), against the snapshot's own reserved memory and out-of-memory error."""
    conf = conf or conf_from_snapshot_settings(snap.settings)
    trace = trace if trace is not None else snapshot_to_trace(snap)
    program, requests = with_failed_requests(trace)
    start, reserved = reserved_by_entry(snap)
    ooms = oom_entries(snap)
    upto = reserved[: ooms[0]] if ooms else reserved
    first = snap.entries[ooms[0]] if ooms else None
    return ProgramCheck(
        capacity=capacity,
        from_start=not bool((trace.alloc == 0).any()) and start == 0,
        real_max_reserved=max([start, *upto]),
        real_oom_size=first.size if first else None,
        real_oom_reserved=reserved[ooms[0]] if ooms else None,
        real_oom_free=first.device_free if first else None,
        simulated=simulate_caching(program, conf, capacity),
        requests=tuple(requests),
    )
