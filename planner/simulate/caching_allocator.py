"""A simulator of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp) and its replay of a trace.

Rules kept from the source: 512 B rounding (or power-of-two divisions), a small pool (<= 1 MiB,
2 MiB segments) and a large pool (< 10 MiB -> 20 MiB segment, else rounded to 2 MiB), best fit
within one pool and one stream, splitting (small: >= 512 B left; large: request below
max_split_size and > 1 MiB left), merging on free, oversize blocks, expandable segments, the
garbage-collection threshold, and on a failed device allocation the retries (release oversize
cached blocks, then every unsplit cached block). Free blocks are kept per (pool, stream) in a
sorted list of integer keys (size, [segment id,] address) searched with bisect.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from memplan.errors import MemplanError
from memplan.planner.simulate.alloc_conf import LARGE_BUFFER, AllocConf
from memplan.traces.format import Trace
from memplan.units import cuda_oom_message

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20  # largest small-pool request
SMALL_BUFFER = 2 << 20  # small-pool segment
MIN_LARGE_ALLOC = 10 << 20  # requests below this get a LARGE_BUFFER segment
ROUND_LARGE = 2 << 20
ADDR_BITS = 50  # addresses below 2**50 (1 PiB); keys pack them under the size
ADDR_MASK = (1 << ADDR_BITS) - 1
SEG_BITS = 30
FAKE_BASE = 1 << 40  # where invented segment addresses start


class SimulatedOOM(MemplanError):
    """The simulated device ran out of memory even after releasing cached segments."""


def round_size(size: int, conf: AllocConf) -> int:
    """The block size PyTorch uses for a request of `size` bytes."""
    if size < MIN_BLOCK:
        return MIN_BLOCK
    div = conf.divisions_for(size)
    if div > 1 and size > MIN_BLOCK * div:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (div.bit_length() - 1)
        if step == 0:
            return floor << 1
        low = size & ~(step - 1)
        return size if low == size else low + step
    return (size + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK


def allocation_size(size: int) -> int:
    """Size of the segment a rounded request would get from cudaMalloc."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return (size + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE


@dataclass(frozen=True)
class GPUOutOfMemory:
    """PyTorch's out-of-memory error for a request a GPU's caching allocator could not serve, with its figures."""

    tried: int  # the segment PyTorch's error says it tried to allocate
    free: int  # the GPU's free bytes then: its memory less reserved and what lies outside the allocator
    message: str  # the error's text


def gpu_out_of_memory(size: int, conf: AllocConf, memory: int, outside: int, allocated: int,
                      reserved: int) -> GPUOutOfMemory:  # fmt: skip
    """The error PyTorch raises for a request of `size` bytes on a GPU of `memory` bytes holding `outside` outside the
    allocator, with `allocated` and `reserved` bytes in it (units.cuda_oom_message's words)."""
    tried = allocation_size(round_size(size, conf))
    free = memory - outside - reserved
    return GPUOutOfMemory(
        tried, free, cuda_oom_message(tried, memory, free, allocated, reserved, process=memory - free)
    )


class Segment:
    """One cudaMalloc'd segment (or one expandable segment's reserved address range)."""

    __slots__ = ("id", "addr", "size", "stream", "small", "expandable", "page")

    def __init__(self, id, addr, size, stream, small, expandable=False, page=0):
        self.id, self.addr, self.size, self.stream = id, addr, size, stream
        self.small, self.expandable, self.page = small, expandable, page


class Block:
    """A piece of a segment: allocated, free (in its pool's free list) or unmapped (expandable only)."""

    __slots__ = ("addr", "size", "seg", "prev", "next", "allocated", "mapped", "gc_base", "requested")

    def __init__(self, addr, size, seg, prev=None, next=None):
        self.addr, self.size, self.seg, self.prev, self.next = addr, size, seg, prev, next
        self.allocated, self.mapped, self.gc_base, self.requested = False, True, 0, 0


@dataclass
class SegmentEvent:
    """A change of reserved memory: cudaMalloc/cudaFree of a segment, or map/unmap of expandable pages."""

    action: str  # segment_alloc | segment_free | segment_map | segment_unmap
    addr: int
    size: int
    stream: int


def bump_addresses(start: int = FAKE_BASE) -> Callable[[int, int, bool], int]:
    """A segment-address source for simulations: fresh 2 MiB-aligned addresses, never reused."""
    nxt = [start]

    def take(size: int, stream: int, small: bool) -> int:
        addr = nxt[0]
        nxt[0] += (size + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE
        return addr

    return take


class CachingAllocator:
    """PyTorch's device caching allocator for one device: malloc, free and empty_cache on byte counts.

    `capacity` (bytes, None = unlimited) bounds reserved memory like a full device or a memory
    fraction; `segment_address(size, stream, small)` supplies the base address of each new segment.
    """

    def __init__(
        self,
        conf: AllocConf = AllocConf(),
        capacity: int | None = None,
        segment_address: Callable[[int, int, bool], int] | None = None,
    ):
        self.conf = conf
        self.capacity = capacity
        self.segment_address = segment_address or bump_addresses()
        self.free_lists: dict[tuple[bool, int], list[int]] = {}  # (small, stream) -> sorted keys
        self.free_at: dict[int, Block] = {}  # address -> free mapped block
        self.unmapped: dict[tuple[bool, int], list[int]] = {}  # (small, stream) -> sorted addresses
        self.unmapped_at: dict[int, Block] = {}
        self.active: dict[int, Block] = {}  # address -> allocated block
        self.segments: dict[int, Segment] = {}  # segment id -> segment
        self.next_segment_id = 0
        self.allocated = 0  # bytes in allocated blocks (PyTorch's allocated_bytes)
        self.reserved = 0  # bytes in segments / mapped pages (PyTorch's reserved_bytes)
        self.events: list[SegmentEvent] = []
        self.gc_calls = {True: 0, False: 0}
        self.mss = conf.max_split_size if conf.max_split_size is not None else 1 << 62
        self.oldest_first = conf.tie_break == "oldest_segment"
        self.size_shift = ADDR_BITS + SEG_BITS if self.oldest_first else ADDR_BITS
        self.plain_rounding = all(d <= 1 for d in conf.roundup_power2_divisions)
        self.gc_on = conf.garbage_collection_threshold > 0.0 and capacity is not None

    # -- free lists ---------------------------------------------------------------------------
    def _key(self, b: Block) -> int:
        if self.oldest_first:
            return (((b.size << SEG_BITS) | b.seg.id) << ADDR_BITS) | b.addr
        return (b.size << ADDR_BITS) | b.addr

    def _size_key(self, size: int) -> int:
        return size << self.size_shift

    def _insert_free(self, b: Block) -> None:
        seg = b.seg
        keys = self.free_lists.get((seg.small, seg.stream))
        if keys is None:
            keys = self.free_lists[(seg.small, seg.stream)] = []
        insort(keys, self._key(b) if self.oldest_first else (b.size << ADDR_BITS) | b.addr)
        self.free_at[b.addr] = b
        b.gc_base = self.gc_calls[seg.small]

    def _remove_free(self, b: Block) -> None:
        keys = self.free_lists[(b.seg.small, b.seg.stream)]
        del keys[bisect_left(keys, self._key(b))]
        del self.free_at[b.addr]

    def _insert_unmapped(self, b: Block) -> None:
        insort(self.unmapped.setdefault((b.seg.small, b.seg.stream), []), b.addr)
        self.unmapped_at[b.addr] = b

    def _remove_unmapped(self, b: Block) -> None:
        addrs = self.unmapped[(b.seg.small, b.seg.stream)]
        del addrs[bisect_left(addrs, b.addr)]
        del self.unmapped_at[b.addr]

    # -- segments -----------------------------------------------------------------------------
    def _new_segment(self, addr, size, stream, small, expandable=False, page=0) -> Segment:
        seg = Segment(self.next_segment_id, addr, size, stream, small, expandable, page)
        self.next_segment_id += 1
        self.segments[seg.id] = seg
        return seg

    def add_segment(self, addr: int, size: int, stream: int, small: bool, blocks: list[tuple[int, bool]]) -> None:
        """Install an existing (non-expandable) segment: `blocks` = [(size, allocated)] in address order.

        Adjacent free blocks are merged, as the allocator would have done.
        """
        if sum(s for s, _ in blocks) != size:
            raise ValueError("block sizes do not add up to the segment size")
        seg = self._new_segment(addr, size, stream, small)
        self.reserved += size
        merged: list[list] = []
        for s, used in blocks:
            if merged and not used and not merged[-1][1]:
                merged[-1][0] += s
            else:
                merged.append([s, used])
        prev, a = None, addr
        for s, used in merged:
            b = Block(a, s, seg, prev)
            if prev is not None:
                prev.next = b
            if used:
                b.allocated, b.requested = True, s
                self.active[a] = b
                self.allocated += s
            prev, a = b, a + s
        b = prev
        while b is not None:
            if not b.allocated:
                self._insert_free(b)
            b = b.prev

    # -- malloc -------------------------------------------------------------------------------
    def malloc(self, size: int, stream: int = 0) -> int:
        """Serve a request of `size` bytes on `stream`; returns the block address or raises SimulatedOOM."""
        if self.plain_rounding:
            rsize = MIN_BLOCK if size < MIN_BLOCK else (size + MIN_BLOCK - 1) & -MIN_BLOCK
        else:
            rsize = round_size(size, self.conf)
        small = rsize <= SMALL_SIZE
        b = self._get_free_block(rsize, small, stream)
        if b is None:
            alloc = allocation_size(rsize)
            if self.gc_on:
                self._garbage_collect()
            b = self._alloc_block(rsize, alloc, small, stream)
            if b is None and self._release_available_cached_blocks(rsize, small, stream):
                b = self._alloc_block(rsize, alloc, small, stream)
            if b is None:
                self.empty_cache()
                b = self._alloc_block(rsize, alloc, small, stream)
            if b is None:
                raise SimulatedOOM(
                    f"out of memory: tried to allocate {alloc} bytes ({size} requested) with "
                    f"{self.allocated} allocated and {self.reserved} reserved of {self.capacity}"
                )
        # split the front off, if the rules allow
        remaining = b.size - rsize
        if (remaining >= MIN_BLOCK) if (small or b.seg.expandable) else (rsize < self.mss and remaining > SMALL_SIZE):
            rest = Block(b.addr + rsize, remaining, b.seg, b, b.next)
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            b.size = rsize
            self._insert_free(rest)
        b.allocated = True
        b.requested = size
        self.active[b.addr] = b
        self.allocated += b.size
        return b.addr

    def _get_free_block(self, size: int, small: bool, stream: int) -> Block | None:
        if self.gc_on:
            self.gc_calls[small] += 1
        keys = self.free_lists.get((small, stream))
        if not keys:
            return None
        i = bisect_left(keys, size << self.size_shift)
        if i == len(keys):
            return None
        b = self.free_at[keys[i] & ADDR_MASK]
        if b.seg.expandable:  # best fit counts the unmapped space a block can grow into

            def grow(x):
                return x.size + (x.next.size if x.next is not None and not x.next.mapped else 0)

            j = i + 1
            while j < len(keys):
                nb = self.free_at[keys[j] & ADDR_MASK]
                if not b.seg.expandable or grow(nb) >= grow(b):
                    break
                b, i, j = nb, j, j + 1
        if size < self.mss and b.size >= self.mss:
            return None  # do not hand an oversize block to a small request
        if size >= self.mss and b.size >= size + self.conf.max_non_split_rounding:
            return None  # oversize blocks serve only requests close to their size
        del keys[i]
        del self.free_at[b.addr]
        return b

    def _alloc_block(self, size: int, alloc: int, small: bool, stream: int) -> Block | None:
        if self.conf.expandable_segments:  # maps only the pages it lacks: a free block it grows counts as its own
            return self._alloc_expandable(size, small, stream)
        if self.capacity is not None and self.reserved + alloc > self.capacity:
            return None
        addr = self.segment_address(alloc, stream, small)
        if addr > ADDR_MASK:
            raise ValueError(f"segment address {addr:#x} beyond 2**{ADDR_BITS}")
        seg = self._new_segment(addr, alloc, stream, small)
        self.reserved += alloc
        self.events.append(SegmentEvent("segment_alloc", addr, alloc, stream))
        return Block(addr, alloc, seg)

    # -- free ---------------------------------------------------------------------------------
    def free(self, addr: int) -> None:
        """Return the block at `addr` to its pool, merging it with free neighbours."""
        b = self.active.pop(addr)
        b.allocated = False
        self.allocated -= b.size
        self._absorb_free_neighbours(b)
        self._insert_free(b)

    def _absorb_free_neighbours(self, b) -> None:
        """Merge the free mapped blocks just before and after `b` into `b` (taking them out of the pools)."""
        p = b.prev
        if p is not None and not p.allocated and p.mapped:
            self._remove_free(p)
            b.addr, b.size, b.prev = p.addr, p.size + b.size, p.prev
            if p.prev is not None:
                p.prev.next = b
        n = b.next
        if n is not None and not n.allocated and n.mapped:
            self._remove_free(n)
            b.size += n.size
            b.next = n.next
            if n.next is not None:
                n.next.prev = b

    # -- releasing cached memory --------------------------------------------------------------
    def _release_block(self, b: Block) -> None:
        """cudaFree a whole free (unsplit, non-expandable) segment."""
        self._remove_free(b)
        self.reserved -= b.size
        del self.segments[b.seg.id]
        self.events.append(SegmentEvent("segment_free", b.addr, b.size, b.seg.stream))

    def _release_available_cached_blocks(self, size: int, small: bool, stream: int) -> bool:
        """Free one oversize cached block big enough, or else (none, or the candidate is expandable) the
        largest oversize blocks below it until enough is freed, as PyTorch's release_available_cached_blocks."""
        if self.conf.max_split_size is None:
            return False
        keys = self.free_lists.get((small, stream)) or []
        want = max(size, self.mss)
        i = bisect_left(keys, self._size_key(want))
        if i < len(keys) and not self.free_at[keys[i] & ADDR_MASK].seg.expandable:
            b = self.free_at[keys[i] & ADDR_MASK]  # oversize blocks are never split: a whole segment
            self._release_block(b)
            return True
        released = 0
        for key in reversed(keys[:i]):
            if released >= want:
                break
            b = self.free_at[key & ADDR_MASK]
            if b.size < self.mss:
                break
            if not b.seg.expandable and b.prev is None and b.next is None:
                released += b.size
                self._release_block(b)
        return released >= want

    def empty_cache(self) -> None:
        """Release every cached segment that is entirely free (and unmap free expandable pages)."""
        for pool in sorted(self.free_lists):  # large pool first, then small, as release_cached_blocks
            to_unmap = []
            for key in list(self.free_lists[pool]):
                b = self.free_at[key & ADDR_MASK]
                if b.seg.expandable:
                    to_unmap.append(b)
                elif b.prev is None and b.next is None:
                    self._release_block(b)
            for b in to_unmap:
                self._unmap_block(b)

    def _garbage_collect(self) -> None:
        """Release unsplit large cached blocks older than the average until below the threshold."""
        threshold = int(self.conf.garbage_collection_threshold * self.capacity)
        if self.reserved <= threshold:
            return
        target = self.reserved - threshold
        calls = self.gc_calls[False]

        def large_free():
            out = []
            for small, stream in sorted(k for k in self.free_lists if not k[0]):
                out.extend(self.free_at[k & ADDR_MASK] for k in self.free_lists[(small, stream)])
            return out

        freeable = [b for b in large_free() if b.prev is None and b.next is None]
        if not freeable:
            return
        total_age, count = sum(calls - b.gc_base for b in freeable), len(freeable)
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for b in large_free():
                age = calls - b.gc_base
                if b.prev is None and b.next is None and not b.seg.expandable and age >= age_threshold:
                    freed = True
                    reclaimed += b.size
                    total_age -= age
                    count -= 1
                    self._release_block(b)

    # -- expandable segments ------------------------------------------------------------------
    def _alloc_expandable(self, size: int, small: bool, stream: int) -> Block | None:
        c = self._find_expandable_block(size, small, stream)
        if not c.mapped:
            c = self._map_block(c, min(c.size, size))
            if c is None:
                return None
        while c.size < size:
            c = self._map_block(c.next, min(size - c.size, c.next.size))
            if c is None:
                return None
        self._remove_free(c)
        return c

    def _find_expandable_block(self, size: int, small: bool, stream: int) -> Block:
        def room(b):
            total = 0
            while total < size and b is not None and not b.allocated:
                total += b.size
                b = b.next
            return total >= size

        for addr in self.unmapped.get((small, stream), []):
            c = self.unmapped_at[addr]
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            if room(c):
                return c
        page = SMALL_BUFFER if small else LARGE_BUFFER
        total = self.capacity if self.capacity is not None else 1 << 40
        va = (total + total // 8 + page - 1) // page * page
        seg = self._new_segment(self.segment_address(va, stream, small), va, stream, small, True, page)
        c = Block(seg.addr, va, seg)
        c.mapped = False
        self._insert_unmapped(c)
        return c

    def _map_block(self, b: Block, size: int) -> Block | None:
        """Map pages for the front `size` bytes of unmapped block `b`; returns the merged free block."""
        seg = b.seg
        start = b.addr - seg.addr
        mapped = -(-(start + size) // seg.page) * seg.page - start
        if self.capacity is not None and self.reserved + mapped > self.capacity:
            return None
        self._remove_unmapped(b)
        b.mapped = True
        if mapped < b.size:
            rest = Block(b.addr + mapped, b.size - mapped, seg, b, b.next)
            rest.mapped = False
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            b.size = mapped
            self._insert_unmapped(rest)
        self._absorb_free_neighbours(b)
        self.reserved += mapped
        self.events.append(SegmentEvent("segment_map", b.addr + b.size - mapped, mapped, seg.stream))
        self._insert_free(b)
        return b

    def _unmap_block(self, b: Block) -> None:
        """Unmap the whole free pages inside free block `b`; release the segment if nothing is left."""
        seg = b.seg
        first = -(-(b.addr - seg.addr) // seg.page)
        last = (b.addr + b.size - seg.addr) // seg.page
        if first >= last:
            return
        self._remove_free(b)
        lo, hi = seg.addr + first * seg.page, seg.addr + last * seg.page
        if lo > b.addr:
            before = Block(b.addr, lo - b.addr, seg, b.prev, b)
            if b.prev is not None:
                b.prev.next = before
            b.prev = before
            self._insert_free(before)
        if b.addr + b.size > hi:
            after = Block(hi, b.addr + b.size - hi, seg, b, b.next)
            if b.next is not None:
                b.next.prev = after
            b.next = after
            self._insert_free(after)
        b.addr, b.size, b.mapped = lo, hi - lo, False
        for nb in (b.prev, b.next):
            if nb is not None and not nb.mapped:
                self._remove_unmapped(nb)
                if nb is b.prev:
                    b.addr, b.prev = nb.addr, nb.prev
                    if nb.prev is not None:
                        nb.prev.next = b
                else:
                    b.next = nb.next
                    if nb.next is not None:
                        nb.next.prev = b
                b.size += nb.size
        self.reserved -= hi - lo
        self.events.append(SegmentEvent("segment_unmap", lo, hi - lo, seg.stream))
        if b.prev is None and b.next is None:
            del self.segments[seg.id]
        else:
            self._insert_unmapped(b)

    # -- inspection ---------------------------------------------------------------------------
    def largest_free_block(self, size: int, stream: int = 0) -> int:
        """The largest cached (free, mapped) block a request of `size` bytes on `stream` could be served from: its
        pool's (small or large), on its stream; 0 when there is none."""
        keys = self.free_lists.get((round_size(size, self.conf) <= SMALL_SIZE, stream))
        return self.free_at[keys[-1] & ADDR_MASK].size if keys else 0

    def segment_blocks(self) -> list[tuple[Segment, list[Block]]]:
        """Every live segment with its blocks in address order (for checks and tests)."""
        heads: dict[int, Block] = {}
        for b in list(self.active.values()) + list(self.free_at.values()) + list(self.unmapped_at.values()):
            while b.prev is not None:
                b = b.prev
            heads[b.seg.id] = b
        out = []
        for sid in sorted(heads):
            blocks, b = [], heads[sid]
            while b is not None:
                blocks.append(b)
                b = b.next
            out.append((self.segments[sid], blocks))
        return out


@dataclass(frozen=True)
class OutOfMemory:
    """The first request a simulated device could not serve, even after releasing cached segments."""

    time: int  # logical time of the failed allocation
    size: int  # bytes the buffer requested
    buffer: int  # index of the buffer in the trace
    details: str  # the allocator's message: bytes it tried to reserve, allocated, reserved and the capacity
    allocated: int = 0  # the allocator's allocated bytes after its retries (PyTorch's "allocated by PyTorch")
    reserved: int = 0  # its reserved bytes then (less allocated: "reserved by PyTorch but unallocated")
    largest_free: int = 0  # the largest cached block of the request's pool and stream then (fragmentation)


@dataclass
class SimResult:
    """Per-event and total figures of a caching-allocator simulation of one trace.

    `allocated[t]` and `reserved[t]` are the bytes after every event at logical time t
    (allocated counts rounded block sizes, as torch.cuda.memory_allocated does).
    """

    allocated: np.ndarray
    reserved: np.ndarray
    peak_allocated: int
    peak_reserved: int
    segment_allocs: int  # cudaMalloc calls (or expandable-segment mappings)
    fragmentation_at_peak: float  # 1 - allocated/reserved when reserved peaks
    oom: OutOfMemory | None  # the first failed request, None when every request was served
    addr: np.ndarray  # simulated address of every buffer (-1 if never placed)
    conf: AllocConf = field(default_factory=AllocConf)


def event_order(trace: Trace) -> tuple[list[int], list[int], list[bool]]:
    """The trace's allocations and frees in the order the allocator sees them: (time, buffer, is_alloc) lists
    sorted by time, frees before allocations at equal times, then buffer index; a buffer freed at its own
    allocation time is freed right after it is allocated, and frees at the end of the window never happen."""
    n, end = len(trace), trace.end
    times = np.concatenate([trace.free, trace.alloc])
    kinds = np.concatenate([np.where(trace.free == trace.alloc, 2, 0), np.ones(n, np.int64)])
    order = np.lexsort((np.concatenate([np.arange(n), np.arange(n)]), kinds, times))
    order = order[~((kinds[order] == 0) & (times[order] >= end))]
    return times[order].tolist(), ((order % n).tolist() if n else []), (order >= n).tolist()


def simulate_caching(trace: Trace, conf: AllocConf = AllocConf(), capacity: int | None = None) -> SimResult:
    """Replay a trace's allocations and frees (frees first at equal times) through the caching allocator.

    Buffers alive before recording (alloc 0) are allocated first, in index order. The
    simulation stops at the first request that fails even after the out-of-memory retries.
    """
    n, end = len(trace), trace.end
    a = CachingAllocator(conf, capacity)
    ev_time, ev_buf, ev_alloc = event_order(trace)
    sizes, streams = trace.size.tolist(), trace.stream.tolist()
    addr = [-1] * n
    after_alloc, after_res = [-1] * end, [-1] * end  # value after the last event at each time, -1: none
    oom = None
    malloc, free = a.malloc, a.free
    for t, i, is_alloc in zip(ev_time, ev_buf, ev_alloc):
        size = sizes[i]
        if size:  # PyTorch serves empty tensors without the allocator
            if is_alloc:
                try:
                    addr[i] = malloc(size, streams[i])
                except SimulatedOOM as e:
                    oom = OutOfMemory(
                        time=t,
                        size=size,
                        buffer=i,
                        details=str(e),
                        allocated=a.allocated,
                        reserved=a.reserved,
                        largest_free=a.largest_free_block(size, streams[i]),
                    )
                    after_alloc[t], after_res[t] = a.allocated, a.reserved
                    break
            else:
                free(addr[i])
        after_alloc[t] = a.allocated
        after_res[t] = a.reserved
    # times without an event (and every time after an OOM) keep the last value
    alloc_at, res_at = np.asarray(after_alloc, np.int64), np.asarray(after_res, np.int64)
    valid = np.flatnonzero(alloc_at >= 0)
    pos = np.searchsorted(valid, np.arange(end), side="right") - 1
    have = pos >= 0
    alloc_at = np.where(have, alloc_at[valid[np.maximum(pos, 0)]] if len(valid) else 0, 0)
    res_at = np.where(have, res_at[valid[np.maximum(pos, 0)]] if len(valid) else 0, 0)
    peak_t = int(np.argmax(res_at)) if end else 0
    peak_res = int(res_at[peak_t]) if end else 0
    frag = 1.0 - alloc_at[peak_t] / peak_res if peak_res else 0.0
    n_seg = sum(1 for e in a.events if e.action in ("segment_alloc", "segment_map"))
    return SimResult(
        allocated=alloc_at,
        reserved=res_at,
        peak_allocated=int(alloc_at.max()) if end else 0,
        peak_reserved=peak_res,
        segment_allocs=n_seg,
        fragmentation_at_peak=float(frag),
        oom=oom,
        addr=np.asarray(addr, np.int64),
        conf=conf,
    )
