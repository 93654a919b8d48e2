"""The CUDA streams of a captured step: which stream each buffer is allocated on, and the orderings between them.

A `StreamLedger` is told, while the step runs, what the program does with streams: which stream is current (fake
CUDA; a real capture reads each allocation's stream from the caching allocator's history), `wait_stream`, an event
recorded on one stream and waited on by another, and `Tensor.record_stream`. Times are the step's logical times
(the recorder's event count: an ordering at time t sits after the t-th event). `stream_columns` turns that into
the trace's columns: stream ids in order of first use (0 = the default stream), names where known, and the syncs
(time, from_stream, to_stream) that planner/safety.py reads.

An event recorded on A at time k and waited on by B at time m > k orders A's events at <= k before B's events
at > m; one sync (t, A, B) says that exactly when A has no event (and receives no ordering) in (k, m], as
(m, A, B), or B has none (and sends none) there, as (k, A, B). Otherwise the ordering goes through a stream of its
own that holds no buffer: (k, A, X) and (m, X, B), at most `MAX_RELAYS` of them; beyond that it is left out
(counted in meta), which only forbids reuse, never allows an unsafe one.

`Tensor.record_stream(S)` is modelled as the caching allocator does: the block returns to its pool only once S
has passed the point of the free. The buffer's free moves to the first sync from S to the buffer's own stream
after it (to the end of the step if none), so no buffer on its stream reuses the bytes before S is done with them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

DEFAULT = 0  # the default stream's key (a real CUDA build's legacy default stream is the null pointer)
MAX_RELAYS = 32  # orderings that need a stream of their own, kept per trace; the rest are left out (safe)
RELAY = "ordering"  # the name of such a stream


@dataclass
class Ordering:
    """Stream `waited`'s work up to time `sent` is ordered before stream `waiter`'s work after time `received`."""

    waited: int  # stream key
    sent: int
    waiter: int
    received: int


@dataclass
class StreamLedger:
    """What a step did with streams, keyed by each stream's key (`cuda_stream`: 0 for the default stream)."""

    clock: object = None  # () -> the step's logical time now; None outside the step (nothing is recorded then)
    storage_key: object = None  # (tensor) -> its storage's key in the capture (the recorder's)
    current: int = DEFAULT
    switches: list[tuple[int, int]] = field(default_factory=list)  # (time, stream key made current after it)
    orderings: list[Ordering] = field(default_factory=list)
    kept_alive: list[tuple[int, int, int]] = field(default_factory=list)  # (storage key, stream key, time)
    names: dict[int, str] = field(default_factory=dict)
    known: set[int] = field(default_factory=lambda: {DEFAULT})  # every stream the program used

    def now(self) -> int | None:
        """The step's logical time now, or None outside the step."""
        return None if self.clock is None else int(self.clock())

    def begin(self, clock) -> None:
        """Start recording the step (`clock` gives its logical time)."""
        self.clock = clock
        self.switches = [(0, self.current)]

    def end(self) -> None:
        """Stop recording: the step is over."""
        self.clock = None

    def set_current(self, key: int) -> None:
        """The program made stream `key` current (fake CUDA: torch.cuda.set_stream, `with torch.cuda.stream(s)`)."""
        self.current = key
        self.known.add(key)
        t = self.now()
        if t is not None:
            self.switches.append((t, key))

    def wait_stream(self, waiter: int, waited: int) -> None:
        """`waiter.wait_stream(waited)`: waited's work so far before waiter's from now."""
        self.known.update((waiter, waited))
        t = self.now()
        if t is not None and waiter != waited:
            self.orderings.append(Ordering(waited, t, waiter, t))

    def host_wait(self, stream: int | None) -> None:
        """The host waited for `stream`'s work so far (None: every stream's, torch.cuda.synchronize): all work
        issued after it, on every stream, is ordered after that work."""
        t = self.now()
        if t is None:
            return
        for waited in sorted(self.known) if stream is None else [stream]:
            for waiter in sorted(self.known - {waited}):
                self.orderings.append(Ordering(waited, t, waiter, t))

    def recorded(self, stream: int) -> tuple[int, int | None]:
        """What an event recorded now on `stream` carries: the stream and the time (None outside the step)."""
        self.known.add(stream)
        return stream, self.now()

    def wait_event(self, waiter: int, mark: tuple[int, int | None] | None) -> None:
        """`waiter.wait_event(event)` for an event recorded as `mark` (None: never recorded, nothing to wait for)."""
        self.known.add(waiter)
        t = self.now()
        if t is None or mark is None or mark[1] is None or mark[0] == waiter:
            return
        self.orderings.append(Ordering(mark[0], mark[1], waiter, t))

    def record_stream(self, storage_key: int, stream: int) -> None:
        """`tensor.record_stream(stream)` on a tensor whose storage is `storage_key`."""
        t = self.now()
        if t is not None:
            self.kept_alive.append((storage_key, stream, t))

    def stream_at(self, time: int) -> int:
        """The stream current at an allocation at `time` (fake CUDA: the latest switch before it)."""
        at = bisect.bisect_left(self.switches, (time, -(2**63))) - 1
        return self.switches[at][1] if at >= 0 else DEFAULT


@dataclass
class StreamColumns:
    """A trace's stream column, syncs, frees (moved by record_stream) and meta entries."""

    stream: list[int]
    free: list[int]
    syncs: list[tuple[int, int, int]]
    meta: dict


def stream_columns(
    keys: list[int], alloc: list[int], free: list[int], storage: list[int], ledger: StreamLedger, end: int
) -> StreamColumns:
    """Dense stream ids (0 = default, then in order of first use), syncs and moved frees for buffers allocated on
    stream keys `keys` at `alloc`, freed at `free`, with storage keys `storage`; `end` is the step's last time."""
    firsts: dict[int, int] = {DEFAULT: -1}
    for key, t in zip(keys, alloc):
        firsts[key] = min(firsts.get(key, t), t)
    for o in ledger.orderings:
        for key in (o.waited, o.waiter):
            firsts[key] = min(firsts.get(key, o.sent), o.sent)
    for _, key, t in ledger.kept_alive:
        firsts[key] = min(firsts.get(key, t), t)
    order = sorted(firsts, key=lambda k: (k != DEFAULT, firsts[k]))
    ids = {key: i for i, key in enumerate(order)}
    stream = [ids[k] for k in keys]
    events: dict[int, list[int]] = {}  # stream id -> times of its buffers' events
    for s, a, f in zip(stream, alloc, free):
        events.setdefault(s, []).extend((a, f))
    orderings = [Ordering(ids[o.waited], o.sent, ids[o.waiter], o.received) for o in ledger.orderings]
    syncs, relays, dropped = _syncs(orderings, {s: sorted(ts) for s, ts in events.items()}, len(ids))
    free = _kept_alive(list(free), stream, alloc, storage, ledger.kept_alive, ids, syncs, end)
    names = {str(ids[k]): ledger.names.get(k, "default" if k == DEFAULT else "") for k in order}
    names.update({str(r): RELAY for r in relays})
    meta = {"streams": names} if len(names) > 1 else {}
    if dropped:
        meta["stream_orderings_left_out"] = dropped
    return StreamColumns(stream, free, syncs, meta)


def _busy(times: list[int], lo: int, hi: int) -> bool:
    """Whether a sorted list holds a time in (lo, hi]."""
    at = bisect.bisect_right(times, lo)
    return at < len(times) and times[at] <= hi


def _syncs(orderings: list[Ordering], events: dict[int, list[int]], nstreams: int):
    """Syncs saying exactly the orderings (see the module's docstring); returns (syncs, relay ids, left out)."""
    received: dict[int, list[int]] = {}
    sent: dict[int, list[int]] = {}
    for o in orderings:
        received.setdefault(o.waiter, []).extend((o.sent, o.received))  # either may become the sync's time
        sent.setdefault(o.waited, []).extend((o.sent, o.received))
    received = {s: sorted(ts) for s, ts in received.items()}
    sent = {s: sorted(ts) for s, ts in sent.items()}
    syncs: set[tuple[int, int, int]] = set()
    relays: list[int] = []
    dropped = 0
    for o in orderings:
        a, k, b, m = o.waited, o.sent, o.waiter, o.received
        if a == b:
            continue
        # moved on to m: no event of A after k, and no wait of A from k on (one at k itself may follow the record)
        if k == m or not (_busy(events.get(a, []), k, m) or _busy(received.get(a, []), k - 1, m)):
            syncs.add((m, a, b))
        elif not (_busy(events.get(b, []), k, m) or _busy(sent.get(b, []), k, m)):
            syncs.add((k, a, b))
        elif len(relays) < MAX_RELAYS:
            relay = nstreams + len(relays)
            relays.append(relay)
            syncs.update({(k, a, relay), (m, relay, b)})
        else:
            dropped += 1
    return sorted(syncs), relays, dropped


def _kept_alive(free, stream, alloc, storage, kept_alive, ids, syncs, end) -> list[int]:
    """Frees moved for `record_stream`: to the first sync from the recorded stream to the buffer's stream at or
    after the free (`end` if none)."""
    for key, s_key, t in kept_alive:
        live = [i for i, k in enumerate(storage) if k == key and alloc[i] <= t < free[i]]
        if not live:
            continue
        i, s = live[-1], ids[s_key]
        if s == stream[i]:
            continue
        later = [ts for ts, a, b in syncs if a == s and b == stream[i] and ts >= free[i]]
        free[i] = max(free[i], min(min(later) + 1, end) if later else end)
    return free
