"""The step recorder (traces/csrc/recorder.cpp): labelled allocations and frees of one device.

`Recorder` installs it for a whole capture: from before the workload is built, so every storage
alive when the step begins is known with its size and its free is seen wherever it happens. Real
tensors report through c10's memory reporter (every allocator of the thread calls it); fake tensors
through a meta allocator that reports the creation and death of each storage. A real step's ops that read
a storage the recorder never saw allocated are noted (`unseen`), and a capture's counters so far can be read
from another thread (`progress`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from memplan.cxx import torch_extension
from memplan.traces.format import PHASES

SOURCE = Path(__file__).resolve().parent / "csrc" / "recorder.cpp"
# Phases as the recorder numbers them: indices into traces.format.PHASES (and recorder.cpp's Phase).
FORWARD, BACKWARD, OPTIMIZER, OTHER = range(len(PHASES))


def extension():
    """The compiled recorder module (built once, then loaded from the cache)."""
    return torch_extension("memplan_recorder", [SOURCE], "the step recorder")


@dataclass
class Events:
    """Allocations (size > 0) and frees (size < 0) in order, as columns; labels are ids into `names`."""

    key: np.ndarray  # storage key: data address, or the fake storage's number
    size: np.ndarray
    op: np.ndarray
    module: np.ndarray
    phase: np.ndarray  # FORWARD, BACKWARD, OPTIMIZER or OTHER
    output: np.ndarray  # bool: the storage was returned by an op fake tensors see (else a kernel's own)

    @classmethod
    def from_columns(cls, columns: tuple) -> Events:
        key, size, op, module, phase, output = columns
        return cls(
            np.asarray(key, dtype=np.int64),
            np.asarray(size, dtype=np.int64),
            np.asarray(op, dtype=np.int32),
            np.asarray(module, dtype=np.int32),
            np.asarray(phase, dtype=np.int8),
            np.asarray(output, dtype=bool),
        )

    def __len__(self) -> int:
        return int(self.key.shape[0])


@dataclass(frozen=True)
class Unseen:
    """Storages the recorded step's ops read that the capture lacks, largest first, as columns; labels are ids into
    `Recorder.names()` (the op and module that read each first)."""

    key: list[int]
    size: list[int]
    op: list[int]
    module: list[int]


@dataclass(frozen=True)
class Progress:
    """A capture's counters so far (read from another thread while it runs)."""

    ops: int  # ops fake tensors see, run by the program since recording began
    events: int  # allocations and frees of the step recorded so far (0 before the step)
    live_bytes: int  # bytes live in the capture now
    phase: str  # traces.format.PHASES: forward, backward, optimizer or other
    stepping: bool  # whether the recorded step is running
    module: str  # the module of the latest allocation or free ("" when none)


class Recorder:
    """One capture's recorder; use `recording(...)` to install it."""

    def __init__(self, native):
        self._native = native

    def intern(self, name: str) -> int:
        return self._native.intern(name)

    def names(self) -> list[str]:
        return self._native.names()

    def storage_key(self, tensor: torch.Tensor) -> int:
        return self._native.storage_key(tensor)

    def storage_nbytes(self, tensor: torch.Tensor) -> int:
        """The bytes of the tensor's storage, read without making the storage a Python object (`untyped_storage()`
        would, and that object then holds a reference to it for good)."""
        return self._native.storage_nbytes(tensor)

    def share_storage(self, tensor: torch.Tensor, source: torch.Tensor, offset: int, sizes, strides) -> None:
        """`tensor.set_(source's storage, offset, sizes, strides)`, the storage never made a Python object."""
        self._native.share_storage(tensor, source, offset, list(sizes), list(strides))

    def adopt(self, tensor: torch.Tensor) -> None:
        """Count the storage of a tensor made before recording began as alive from now on (its free is seen)."""
        self._native.adopt(tensor)

    def accumulating(self) -> bool:
        """Whether the op running is the autograd engine summing two gradients of one input (`aten::add` outside
        every node's formula)."""
        return self._native.accumulating()

    def caller(self) -> str:
        """What called the op running now: the op (a composite op runs as others), or the autograd node whose
        backward formula calls it directly (IndexBackward0), or ""."""
        return self._native.caller()

    def references(self, tensor: torch.Tensor) -> tuple[int, int, bool]:
        """References to the tensor and to its storage as C++ counts them (the call's own included), and whether
        the tensor is non-overlapping and dense."""
        return tuple(self._native.references(tensor))

    def in_order(self, keys: list[int]) -> None:
        """Reorder the allocations of these storages (made during the step) among themselves to the order given."""
        self._native.in_order(keys)

    def claim(self, tensor: torch.Tensor, view: bool = False) -> None:
        """Keep a fake tensor's storage in the capture (only claimed storages count when fake); a `view` of an op's
        input never makes it internal, and made outside every other op it is an op's output."""
        self._native.claim(tensor, view)

    def resized(self, tensor: torch.Tensor, old_nbytes: int) -> None:
        """A fake storage (`tensor`'s, now at its new size) was resized in place from `old_nbytes`: a free, then an
        allocation (a real storage's resize goes through the allocator, which reports both itself)."""
        self._native.resized(tensor, old_nbytes)

    def phase_now(self) -> int:
        """The phase the program is in now (FORWARD, BACKWARD, OPTIMIZER or OTHER)."""
        return self._native.phase()

    def set_phase(self, phase: int) -> int:
        """Enter `phase`; returns the number of step events recorded before it (its start time)."""
        return self._native.set_phase(phase)

    def step_events(self) -> int:
        """The step's events so far that the trace keeps: the logical time now (between ops)."""
        return self._native.step_events()

    def enter_module(self, label: int) -> None:
        self._native.enter_module(label)

    def leave_module(self) -> None:
        self._native.leave_module()

    def begin_step(self) -> Events:
        """The storages alive now, in allocation order; the events after this call are the step's."""
        return Events.from_columns(self._native.begin_step())

    def end_step(self) -> Events:
        return Events.from_columns(self._native.end_step())

    def mark(self) -> None:
        """Mark the program's time now (a step's start or end): `program()` gives each mark's logical time."""
        self._native.mark()

    def program(self) -> tuple[Events, list[int], list[int]]:
        """Every event the capture keeps since recording began, in order (a recorded step's as `end_step` gave
        them), each mark as the number of those events before it, and the storages adopted before recording."""
        columns, marks, adopted = self._native.program()
        return Events.from_columns(columns), list(marks), list(adopted)

    def program_tail(self, since: int) -> tuple[Events, int]:
        """The program's kept events logged outside a step from raw position `since` on, and the position to ask
        from next: a live consumer's feed (memplan check's simulated allocator)."""
        columns, size = self._native.program_tail(since)
        return Events.from_columns(columns), size

    def unseen(self) -> Unseen:
        """Storages the step's ops read that were never seen allocated (made before recording began, not adopted):
        what the trace lacks. Real captures only; a fake one is empty."""
        return Unseen(*self._native.unseen())

    def progress(self) -> Progress:
        """The capture's counters now; safe to call from another thread."""
        ops, events, live, phase, stepping, module = self._native.progress()
        return Progress(ops, events, live, PHASES[phase], stepping, module)

    def outputs_marked(self) -> bool:
        """Whether the step's `Events.output` marks hold: no torch.compile code ran (it allocates outside ops)."""
        return self._native.outputs_marked()


@contextlib.contextmanager
def recording(device: torch.device, fake: bool = False) -> Iterator[Recorder]:
    """Record `device`'s allocator (or, with `fake`, fake tensors' storages) until the block ends."""
    native = extension()
    index = -1 if device.index is None else device.index
    native.start(device.type, index, fake)
    try:
        yield Recorder(native)
    finally:
        native.stop()
