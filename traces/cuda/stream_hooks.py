"""What a step does with CUDA streams on a CUDA build of torch, told to a StreamLedger (traces/cuda/streams.py).

While `cuda_stream_hooks` runs, torch.cuda's `set_stream` (which `with torch.cuda.stream(s)` calls),
`Event.record`, `Event.wait` (which `Stream.wait_event` and `Stream.wait_stream` call), the synchronizations and
`Tensor.record_stream` report to the ledger, then do what they do. A CPU-only torch has no such classes; its fake
CUDA device (traces/cuda/fake_device.py) reports to the ledger itself. torch's device-generic `torch.Stream` and
`torch.Event` are C types and are not seen (FSDP2 makes its streams and events through torch.cuda).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from memplan.traces.cuda.streams import StreamLedger


def _key(stream) -> int:
    """A stream's key: its cudaStream_t (0 for the default stream), as the caching allocator's history gives it."""
    return int(stream.cuda_stream)


@contextlib.contextmanager
def cuda_stream_hooks(ledger: StreamLedger, storage_key: Callable[[torch.Tensor], int]) -> Iterator[None]:
    """Report the block's stream switches, event records and waits, synchronizations and `record_stream` calls to
    `ledger` (a tensor's storage named by `storage_key`); nothing changes what they do. A no-op without CUDA."""
    if not torch.backends.cuda.is_built():
        yield
        return
    cuda = torch.cuda
    originals = {
        "set_stream": cuda.set_stream,
        "synchronize": cuda.synchronize,
        "record": cuda.Event.record,
        "wait": cuda.Event.wait,
        "event_sync": cuda.Event.synchronize,
        "stream_sync": cuda.Stream.synchronize,
        "record_stream": torch.Tensor.record_stream,
    }

    def set_stream(stream):
        originals["set_stream"](stream)
        ledger.set_current(_key(cuda.current_stream()))

    def synchronize(device=None):
        originals["synchronize"](device)
        ledger.host_wait(None)

    def record(event, stream=None):
        originals["record"](event, stream)
        event._memplan_mark = ledger.recorded(_key(stream if stream is not None else cuda.current_stream()))

    def wait(event, stream=None):
        originals["wait"](event, stream)
        waiter = _key(stream if stream is not None else cuda.current_stream())
        ledger.wait_event(waiter, getattr(event, "_memplan_mark", None))

    def event_sync(event):
        originals["event_sync"](event)
        mark = getattr(event, "_memplan_mark", None)
        if mark is not None:
            ledger.host_wait(mark[0])

    def stream_sync(stream):
        originals["stream_sync"](stream)
        ledger.host_wait(_key(stream))

    def record_stream(tensor, stream):
        originals["record_stream"](tensor, stream)
        ledger.record_stream(storage_key(tensor), _key(stream))

    ledger.set_current(_key(cuda.current_stream()))
    cuda.set_stream, cuda.synchronize = set_stream, synchronize
    cuda.Event.record, cuda.Event.wait, cuda.Event.synchronize = record, wait, event_sync
    cuda.Stream.synchronize, torch.Tensor.record_stream = stream_sync, record_stream
    try:
        yield
    finally:
        cuda.set_stream, cuda.synchronize = originals["set_stream"], originals["synchronize"]
        cuda.Event.record, cuda.Event.wait = originals["record"], originals["wait"]
        cuda.Event.synchronize, cuda.Stream.synchronize = originals["event_sync"], originals["stream_sync"]
        torch.Tensor.record_stream = originals["record_stream"]
