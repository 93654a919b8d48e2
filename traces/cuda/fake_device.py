"""A CUDA device for fake steps on a torch built without CUDA: `--fake --device cuda` on any machine.

Fake tensors allocate nothing, so a fake CUDA step needs no GPU; on a CPU-only torch it still needs what any
CUDA tensor asks of the runtime, which such a build lacks. `fake_cuda_runtime` supplies it for the capture:
- the autograd engine's device guard, streams, events and accelerator (traces/csrc/fake_cuda.cpp): streams and
  events that do nothing, and CUDA hooks that say a device is there while the step runs;
- torch.cuda's streams and events: they run nothing, but which stream is current, waits between streams, events
  recorded and waited on, and `Tensor.record_stream` are told to a StreamLedger (traces/cuda/streams.py), so a fake
  trace holds each buffer's stream and the orderings between streams (FSDP2's all-gather and reduce-scatter);
- `torch.cuda`'s Python functions a training program calls (`is_available`, `current_device`,
  `get_device_capability`, `synchronize`, streams and events, RNG state, memory statistics ...), answered for
  the GPU the step is planned for, so `torch.autocast("cuda", ...)`, `torch.amp.GradScaler`, checkpointing's RNG
  preservation and a program's own `torch.cuda.*` calls run unchanged (autocast then applies CUDA's op policy,
  kernels compiled into every torch build).
What a GPU would measure (memory statistics, event timings) reads 0: a fake step has none of it, unless the runtime is
given a DeviceMemory (`memplan check`: the caching allocator simulated as the program runs), which answers the memory
statistics, `mem_get_info` and `empty_cache`, on any build.
On a CUDA build nothing else is replaced: fake CUDA tensors run on torch's own CUDA runtime there.
"""

from __future__ import annotations

import contextlib
import functools
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.cuda import memory as cuda_memory

from memplan.cxx import torch_extension
from memplan.errors import MemplanError
from memplan.gpus import GPU
from memplan.torch_versions import INSTALLED, TorchRules
from memplan.traces.cuda.sdpa_dispatch import cuda_attention
from memplan.traces.cuda.streams import StreamLedger
from memplan.traces.patches import patched

SOURCE = Path(__file__).resolve().parent / "csrc" / "fake_cuda.cpp"


def needs_runtime() -> bool:
    """Whether a fake CUDA step needs memplan's runtime: this torch is built without CUDA."""
    return not torch.backends.cuda.is_built()


def extension():
    """The compiled fake CUDA module (built once, then loaded from the cache)."""
    return torch_extension("memplan_fake_cuda", [SOURCE], "the fake CUDA runtime")


def _stream_types(ledger: StreamLedger):
    """torch.cuda's Stream and Event for the fake device, and the current stream's state, reporting what the program
    does with them to `ledger` (traces/cuda/streams.py): the kernels never run, but the orderings between streams
    are the step's own."""

    class _Stream:
        """A CUDA stream of the fake device: work on it is nothing to wait for; its key (`cuda_stream`) names it to
        the ledger (0: the default stream)."""

        created = 0

        def __init__(self, device=None, priority: int = 0, stream_id: int | None = None, **_):
            self.device = torch.device("cuda", 0)
            if stream_id is None:
                _Stream.created += 1
                stream_id = _Stream.created
            self.priority, self.stream_id, self.cuda_stream = priority, stream_id, stream_id

        def wait_event(self, event) -> None:
            ledger.wait_event(self.cuda_stream, getattr(event, "mark", None))

        def wait_stream(self, stream) -> None:
            ledger.wait_stream(self.cuda_stream, stream.cuda_stream)

        def record_event(self, event=None):
            event = event if event is not None else _Event()
            event.record(self)
            return event

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            ledger.host_wait(self.cuda_stream)

        def __eq__(self, other) -> bool:
            return isinstance(other, _Stream) and other.stream_id == self.stream_id

        def __hash__(self) -> int:
            return hash(("fake cuda stream", self.stream_id))

        def __enter__(self):
            self._before = state.current
            set_stream(self)
            return self

        def __exit__(self, *exc) -> None:
            set_stream(self._before)

    class _Event:
        """A CUDA event of the fake device: always complete, no time between two; it carries the stream and time
        it was recorded at (`mark`)."""

        def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
            self.mark = None

        def record(self, stream=None) -> None:
            self.mark = ledger.recorded((stream or state.current).cuda_stream)

        def wait(self, stream=None) -> None:
            (stream or state.current).wait_event(self)

        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            if self.mark is not None:
                ledger.host_wait(self.mark[0])

        def elapsed_time(self, end_event) -> float:
            return 0.0

    class _State:
        current = _Stream(stream_id=0)

    state = _State()
    default = state.current

    def set_stream(stream) -> None:
        state.current = stream if stream is not None else default
        ledger.set_current(state.current.cuda_stream)

    @contextlib.contextmanager
    def stream(stream=None):
        if stream is None:
            yield None
            return
        before = state.current
        set_stream(stream)
        try:
            yield stream
        finally:
            set_stream(before)

    return _Stream, _Event, state, set_stream, stream


class _DeviceContext:
    """`torch.cuda.device(i)` on the one fake device."""

    def __init__(self, device=None):
        self.idx = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


class DeviceMemory(Protocol):
    """A fake GPU's memory as a program's `torch.cuda` calls read it (planner/simulate/live.py's LiveDevice)."""

    def feed(self, events) -> None: ...  # the capture's new allocations and frees (traces.recorder.Events), in order
    def allocated(self) -> int: ...
    def reserved(self) -> int: ...
    def peak(self, kind: str) -> int: ...  # "allocated" or "reserved", since the last reset
    def reset_peaks(self) -> None: ...
    def empty_cache(self) -> None: ...
    def free_bytes(self) -> int: ...
    def stats(self) -> dict[str, int]: ...
    def snapshot(self) -> dict: ...  # torch.cuda.memory._snapshot() of the program so far
    def attach(self, program) -> None: ...  # where the program so far comes from: a () -> traces.format.Program


def memory_replacements(gpu: GPU, memory: DeviceMemory) -> dict[str, object]:
    """torch.cuda's memory statistics, `mem_get_info` and `empty_cache`, answered by `memory`."""
    return {
        "empty_cache": lambda: memory.empty_cache(),
        "memory_allocated": lambda device=None: memory.allocated(),
        "max_memory_allocated": lambda device=None: memory.peak("allocated"),
        "memory_reserved": lambda device=None: memory.reserved(),
        "max_memory_reserved": lambda device=None: memory.peak("reserved"),
        "reset_peak_memory_stats": lambda device=None: memory.reset_peaks(),
        "reset_max_memory_allocated": lambda device=None: memory.reset_peaks(),
        "memory_stats": lambda device=None: memory.stats(),
        "mem_get_info": lambda device=None: (memory.free_bytes(), gpu.memory),
    }


def history_replacements(memory: DeviceMemory) -> dict[str, object]:
    """torch.cuda.memory's history functions answered by `memory`: the whole program is recorded anyway, so recording
    history is a no-op, and a snapshot is the program's so far."""

    def dump(filename="dump_snapshot.pickle"):
        with open(filename, "wb") as f:
            pickle.dump(memory.snapshot(), f)

    return {
        "_record_memory_history": lambda *args, **kwargs: None,
        "_snapshot": lambda device=None: memory.snapshot(),
        "_dump_snapshot": dump,
    }


def _replacements(gpu: GPU, ledger: StreamLedger) -> dict[str, object]:
    """torch.cuda's functions as the fake device, a `gpu`, answers them (streams and events reported to `ledger`)."""
    major, minor = gpu.capability
    fields = {"name": gpu.torch_name, "major": major, "minor": minor, "total_memory": gpu.memory}
    fields["is_integrated"] = False
    properties = type("FakeCudaDeviceProperties", (), fields)()
    stream_type, event_type, state, set_stream, stream = _stream_types(ledger)

    def zero(*args, **kwargs) -> int:  # memory statistics: a fake step allocates nothing
        return 0

    def nothing(*args, **kwargs) -> None:
        return None

    return {
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "_lazy_init": nothing,
        "init": nothing,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": nothing,
        "device": _DeviceContext,
        "device_of": _DeviceContext,
        "synchronize": lambda device=None: ledger.host_wait(None),
        "get_device_name": lambda device=None: properties.name,
        "get_device_capability": lambda device=None: (properties.major, properties.minor),
        "get_device_properties": lambda device=None: properties,
        "is_bf16_supported": lambda including_emulation=True: properties.major >= 8,
        "is_tf32_supported": lambda: properties.major >= 8,
        "get_arch_list": lambda: [f"sm_{properties.major}{properties.minor}"],
        "Stream": stream_type,
        "Event": event_type,
        "current_stream": lambda device=None: state.current,
        "default_stream": lambda device=None: stream_type(stream_id=0),
        "set_stream": set_stream,
        "stream": stream,
        "get_rng_state": lambda device="cuda": torch.zeros(16, dtype=torch.uint8),
        "get_rng_state_all": lambda: [torch.zeros(16, dtype=torch.uint8)],
        "set_rng_state": nothing,
        "set_rng_state_all": nothing,
        "manual_seed": nothing,
        "manual_seed_all": nothing,
        "seed": nothing,
        "seed_all": nothing,
        "initial_seed": zero,
        "empty_cache": nothing,
        "memory_allocated": zero,
        "max_memory_allocated": zero,
        "memory_reserved": zero,
        "max_memory_reserved": zero,
        "reset_peak_memory_stats": nothing,
        "reset_max_memory_allocated": nothing,
        "reset_accumulated_memory_stats": nothing,
        "memory_stats": lambda device=None: {},
        "mem_get_info": lambda device=None: (properties.total_memory, properties.total_memory),
    }


def _own_function(replacement):
    """A function object of its own for each name (torch._dynamo maps torch.cuda's functions by identity)."""
    if isinstance(replacement, type) or not callable(replacement):
        return replacement
    return functools.wraps(replacement)(lambda *args, **kwargs: replacement(*args, **kwargs))


class FakeCudaError(MemplanError):
    """This process cannot run a fake CUDA step (its autograd engine started without a CUDA device)."""


def install() -> None:
    """Register the fake CUDA device guard now, on a CPU-only torch: the autograd engine sizes its device queues at
    the process's first backward, so a fake CUDA step needs the guard there before then."""
    if needs_runtime():
        extension().install()


def _check_engine() -> None:
    """A one-op fake CUDA backward; FakeCudaError if the engine started without the guard (no queue for CUDA)."""
    with FakeTensorMode():
        x = torch.empty(1, device="cuda", requires_grad=True)
        try:
            x.sum().backward()
        except RuntimeError as e:
            if "device_ready_queues_" not in str(e):
                raise
            raise FakeCudaError(
                "--fake --device cuda: this process ran a backward before memplan's fake CUDA device existed, and "
                "the autograd engine sizes its device queues once: call "
                "memplan.traces.cuda.fake_device.install() before the first backward, or trace in a new process"
            ) from None


@contextlib.contextmanager
def fused_rms_norm() -> Iterator[None]:
    """While the block runs, aten::_fused_rms_norm has a CUDA kernel, as on a CUDA build, where rms_norm calls it:
    autograd then records its own backward node (FusedRmsNormBackward0: input, weight and the reciprocal standard
    deviation saved, _fused_rms_norm_backward in backward) instead of the composite's pow, mean, rsqrt and
    products, which a CPU build runs for every device. The kernel never runs: fake tensors stop at FakeCapture."""
    library = torch.library.Library("aten", "IMPL")
    try:
        library.impl("_fused_rms_norm", _never_runs, "CUDA")
        yield
    finally:
        library._destroy()


def _never_runs(*args, **kwargs):
    raise FakeCudaError("a CUDA kernel ran outside a fake capture: a fake CUDA step allocates through FakeCapture")


@contextlib.contextmanager
def _replaced(replacements: dict[str, object], module=torch.cuda) -> Iterator[None]:
    """`module`'s functions of these names (torch.cuda's by default) replaced while the block runs."""
    with patched(*((module, name, _own_function(replacement)) for name, replacement in replacements.items())):
        yield


@contextlib.contextmanager
def fake_cuda_runtime(
    gpu: GPU, ledger: StreamLedger | None = None, rules: TorchRules = INSTALLED, memory: DeviceMemory | None = None
) -> Iterator[None]:
    """While the block runs, a CPU-only torch has a CUDA device for fake tensors, a `gpu`, whose streams, events and
    `Tensor.record_stream` report to `ledger`, whose attention kernels follow torch `rules`'s release, and whose memory
    statistics `memory` answers when given (on a CUDA build only those change)."""
    history = _replaced(history_replacements(memory), cuda_memory) if memory is not None else None
    if not needs_runtime():
        with _replaced(memory_replacements(gpu, memory)) if memory is not None else contextlib.nullcontext():
            with history or contextlib.nullcontext():
                yield
        return
    import torch._dynamo  # noqa: F401  fake tensor mode needs it: imported before torch.cuda changes, it maps the real one

    module = extension()
    module.install()
    ledger = ledger if ledger is not None else StreamLedger()
    replacements = _replacements(gpu, ledger) | (memory_replacements(gpu, memory) if memory is not None else {})
    record_stream = torch.Tensor.record_stream
    module.enable(True)
    try:
        _check_engine()
        torch.Tensor.record_stream = lambda tensor, stream: (
            ledger.record_stream(ledger.storage_key(tensor), stream.cuda_stream) if ledger.storage_key else None
        )
        # scaled_dot_product_attention takes the GPU's kernel; rms_norm CUDA's fused one (FakeCapture allocates it)
        with _replaced(replacements), history or contextlib.nullcontext():
            with cuda_attention(gpu.capability, rules), fused_rms_norm():
                yield
    finally:
        torch.Tensor.record_stream = record_stream
        module.enable(False)
