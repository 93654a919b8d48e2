"""Activation offload: the tensors a Transformer layer saves for backward moved to host memory as its forward saves
them, and brought back to the device when its backward needs them (torch.autograd.graph.save_on_cpu's mechanism,
scoped by saved-tensor hooks to one layer's forward); the layer's parameters stay.

What moves is each storage a saved tensor lies in, once however many saved tensors share it (Tempo's layers
save views of one another's storages), and backward gets them back as views of one restored storage, as they
were. Where nothing else holds the device storage (the layer's input, its intermediate results) its device
bytes are freed as soon as the op that saved it returns; backward allocates a copy again. A real CUDA step
copies into pinned host memory without blocking, a real CPU step into numpy arrays (memory the trace's
recorder does not count as the device's), and a fake step keeps only the storage's size: there is nothing to
copy. Every host copy is entered in the model's `HostLedger` with the capture's logical times, so a trace
records the host bytes beside the device ones.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

AS_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # numpy holds any dtype as these


@dataclass
class HostBuffer:
    """One host copy: its bytes, when it was made and freed (the capture's logical time) and the layer's path."""

    size: int
    alloc: int
    free: int | None  # None while it lives
    module: str


@dataclass
class HostLedger:
    """The host copies offloaded layers hold now (`live`) and, while a capture records a step (`begin` to `end`),
    every copy live in it, timed by `clock` (the step's device events so far); outside a capture nothing is kept
    of a copy once it is freed."""

    live: dict[int, HostBuffer] = field(default_factory=dict)  # by id
    recorded: list[HostBuffer] | None = None
    clock: Callable[[], int] = lambda: 0

    def opened(self, size: int, module: str) -> HostBuffer:
        """Enter a host copy of `size` bytes made now; live from the next device event on."""
        buffer = HostBuffer(size, self.clock() + 1, None, module)
        self.live[id(buffer)] = buffer
        if self.recorded is not None:
            self.recorded.append(buffer)
        return buffer

    def closed(self, buffer: HostBuffer) -> None:
        """Mark `buffer` freed now (stamped like `opened`: by the next device event)."""
        self.live.pop(id(buffer), None)
        buffer.free = self.clock() + 1

    def begin(self, clock: Callable[[], int]) -> None:
        """Record a step timed by `clock`: the copies live now count from time 0."""
        self.clock = clock
        for buffer in self.live.values():
            buffer.alloc = 0
        self.recorded = list(self.live.values())

    def stop(self) -> None:
        """Stop recording (nothing is kept of a copy once freed); the clock back to 0."""
        self.recorded, self.clock = None, HostLedger.clock

    def end(self, end: int) -> dict[str, list]:
        """Stop recording; the step's copies as a trace's columns (size, alloc, free, module), one still live freed
        at `end`."""
        recorded = self.recorded or []
        self.stop()
        return {
            "size": [b.size for b in recorded],
            "alloc": [b.alloc for b in recorded],
            "free": [end if b.free is None else min(b.free, end) for b in recorded],
            "module": [b.module for b in recorded],
        }


class Stored:
    """One device storage moved to the host: its copy (None under fake tensors) as a flat tensor of the dtype of the
    first tensor saved on it, and its host ledger entry. Saved tensors that share the storage share the copy, as they
    shared the storage, and backward gets them back on one restored storage."""

    def __init__(self, t: torch.Tensor, ledger: HostLedger, module: str):
        self.dtype, self.device = t.dtype, t.device
        self.nbytes = t.untyped_storage().nbytes()
        self.host = self.copy_out(flat(t))
        self.restored: weakref.ref | None = None  # the flat device copy backward is using, while it lives
        self.entry = ledger.opened(self.nbytes, module)
        weakref.finalize(self, ledger.closed, self.entry)

    def copy_out(self, whole: torch.Tensor) -> torch.Tensor | np.ndarray | None:
        """The host copy of the storage (`whole` spans it): pinned memory from CUDA (without blocking), a numpy array
        from the CPU (no device allocator sees it), nothing from a fake tensor."""
        if isinstance(whole, FakeTensor):
            return None
        if whole.device.type == "cuda":
            host = torch.empty(whole.shape, dtype=self.dtype, device="cpu", pin_memory=True)
            return host.copy_(whole, non_blocking=True)
        return whole.view(AS_INTEGERS[whole.element_size()]).numpy().copy()

    def copy_in(self) -> torch.Tensor:
        """The storage back on its device, flat (one copy while backward holds any tensor on it)."""
        restored = self.restored() if self.restored is not None else None
        if restored is not None:
            return restored
        if isinstance(self.host, torch.Tensor):
            restored = self.host.to(self.device, non_blocking=True)
        else:
            restored = torch.empty(self.nbytes // self.dtype.itemsize, dtype=self.dtype, device=self.device)
            if self.host is not None:
                restored.copy_(torch.from_numpy(self.host).view(self.dtype))
        self.restored = weakref.ref(restored)
        return restored


def flat(t: torch.Tensor) -> torch.Tensor:
    """`t`'s whole storage as a flat tensor of `t`'s dtype (no copy)."""
    return t.detach().as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)


@dataclass(frozen=True)
class Packed:
    """A saved tensor offloaded: its storage's host copy and where the tensor lies in that storage."""

    stored: Stored
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def unpack(self) -> torch.Tensor:
        """The tensor again, a view of its storage brought back to the device."""
        whole = self.stored.copy_in()
        whole = whole if whole.dtype == self.dtype else whole.view(self.dtype)
        return whole.as_strided(self.size, self.stride, self.offset)


def offloadable(t: torch.Tensor, kept: set[int]) -> bool:
    """Whether a saved tensor goes to the host: a strided tensor with elements, on an accelerator or the CPU, that is
    no parameter nor a view of one (another module's, tied) and whose storage is not one of `kept` (the layer's
    parameters and buffers)."""
    if t.layout != torch.strided or t.numel() == 0 or t.device.type not in ("cpu", "cuda"):
        return False
    if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
        return False
    return t.untyped_storage()._cdata not in kept


@contextlib.contextmanager
def offloading(layer: nn.Module, ledger: HostLedger, module: str):
    """Within the block, tensors autograd saves (`layer`'s parameters and buffers excepted) are moved to the host
    and brought back when backward unpacks them; each host copy is entered in `ledger` under `module`."""
    kept = {t.untyped_storage()._cdata for t in (*layer.parameters(), *layer.buffers())}
    moved: dict[int, tuple[weakref.ref, Stored]] = {}  # a storage saved -> (the base of a view on it, its copy)

    def pack(t: torch.Tensor) -> torch.Tensor | Packed:
        if not offloadable(t, kept):
            return t
        key = t.untyped_storage()._cdata
        seen = moved.get(key)
        base = seen[0]() if seen is not None else None  # a view's base lives while any view of it does
        if base is None or base.untyped_storage()._cdata != key:  # not moved yet, or that storage gone: a new one
            seen = (weakref.ref(t if t._base is None else t._base), Stored(t, ledger, module))
            moved[key] = seen
        return Packed(seen[1], t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def unpack(saved: torch.Tensor | Packed) -> torch.Tensor:
        return saved.unpack() if isinstance(saved, Packed) else saved

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        moved.clear()


def offloaded_forward(forward, layer: nn.Module, ledger: HostLedger, module: str, *args, **kwargs):
    """`forward` with its saved tensors offloaded while training with gradients, plain otherwise."""
    if not (layer.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    with offloading(layer, ledger, module):
        return forward(*args, **kwargs)


def enable(layers: dict[str, nn.Module], ledger: HostLedger) -> list[tuple[nn.Module, object]]:
    """Offload each of `layers` (path -> layer) into `ledger`; returns what `restore` puts back (each layer's
    instance `forward`, or None)."""
    saved = [(layer, layer.__dict__.get("forward")) for layer in layers.values()]
    for path, layer in layers.items():
        inner = layer.forward  # an instance forward set before (checkpointing's) stays inside
        layer.forward = functools.partial(offloaded_forward, inner, layer, ledger, path)
    return saved


def restore(saved: list[tuple[nn.Module, object]]) -> None:
    """Undo `enable`: every layer's instance `forward` as it was."""
    for layer, forward in saved:
        layer.__dict__.pop("forward", None)
        if forward is not None:
            layer.forward = forward
