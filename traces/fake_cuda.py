"""A CUDA device for fake steps on a torch built without CUDA: `--fake --device cuda` on any machine.

Fake tensors allocate nothing, so a fake CUDA step needs no GPU; on a CPU-only torch it still needs what any
CUDA tensor asks of the runtime, which such a build lacks. `fake_cuda_runtime` supplies it for the capture:
- the autograd engine's device guard, streams, events and accelerator (traces/csrc/fake_cuda.cpp): streams and
  events that do nothing, and CUDA hooks that say a device is there while the step runs;
- `torch.cuda`'s Python functions a training program calls (`is_available`, `current_device`,
  `get_device_capability`, `synchronize`, streams and events, RNG state, memory statistics ...), answered for
  the GPU the step is planned for, so `torch.autocast("cuda", ...)`, `torch.amp.GradScaler`, checkpointing's RNG
  preservation and a program's own `torch.cuda.*` calls run unchanged (autocast then applies CUDA's op policy,
  kernels compiled into every torch build).
What a GPU would measure (memory statistics, event timings) reads 0: a fake step has none of it.
On a CUDA build nothing is replaced: fake CUDA tensors run on torch's own CUDA runtime there.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.cxx import torch_extension
from memplan.errors import MemplanError
from memplan.gpus import GPU
from memplan.traces.sdpa_dispatch import cuda_attention

SOURCE = Path(__file__).resolve().parent / "csrc" / "fake_cuda.cpp"


def needs_runtime() -> bool:
    """Whether a fake CUDA step needs memplan's runtime: this torch is built without CUDA."""
    return not torch.backends.cuda.is_built()


def extension():
    """The compiled fake CUDA module (built once, then loaded from the cache)."""
    return torch_extension("memplan_fake_cuda", [SOURCE], "the fake CUDA runtime")


class _Stream:
    """A CUDA stream of the fake device: work on it is nothing to wait for."""

    def __init__(self, device=None, priority: int = 0, stream_id: int = 0, **_):
        self.device = torch.device("cuda", 0)
        self.priority, self.stream_id, self.cuda_stream = priority, stream_id, 0

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _Event()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def __eq__(self, other) -> bool:
        return isinstance(other, _Stream) and other.stream_id == self.stream_id

    def __hash__(self) -> int:
        return hash(("fake cuda stream", self.stream_id))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class _Event:
    """A CUDA event of the fake device: always complete, no time between two."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event) -> float:
        return 0.0


class _DeviceContext:
    """`torch.cuda.device(i)` on the one fake device."""

    def __init__(self, device=None):
        self.idx = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


def _replacements(gpu: GPU) -> dict[str, object]:
    """torch.cuda's functions as the fake device, a `gpu`, answers them."""
    major, minor = gpu.capability
    fields = {"name": gpu.torch_name, "major": major, "minor": minor, "total_memory": gpu.memory}
    fields["is_integrated"] = False
    properties = type("FakeCudaDeviceProperties", (), fields)()
    default = _Stream()

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
        "synchronize": nothing,
        "get_device_name": lambda device=None: properties.name,
        "get_device_capability": lambda device=None: (properties.major, properties.minor),
        "get_device_properties": lambda device=None: properties,
        "is_bf16_supported": lambda including_emulation=True: properties.major >= 8,
        "is_tf32_supported": lambda: properties.major >= 8,
        "get_arch_list": lambda: [f"sm_{properties.major}{properties.minor}"],
        "Stream": _Stream,
        "Event": _Event,
        "current_stream": lambda device=None: default,
        "default_stream": lambda device=None: default,
        "set_stream": nothing,
        "stream": lambda stream=None: contextlib.nullcontext(stream),
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
                "the autograd engine sizes its device queues once: call memplan.traces.fake_cuda.install() before "
                "the first backward, or trace in a new process"
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
def fake_cuda_runtime(gpu: GPU) -> Iterator[None]:
    """While the block runs, a CPU-only torch has a CUDA device for fake tensors, a `gpu`; nothing changes on a
    CUDA build."""
    if not needs_runtime():
        yield
        return
    import torch._dynamo  # noqa: F401  fake tensor mode needs it: imported before torch.cuda changes, it maps the real one

    module = extension()
    module.install()
    replacements = {name: _own_function(replacement) for name, replacement in _replacements(gpu).items()}
    originals = {name: getattr(torch.cuda, name) for name in replacements if hasattr(torch.cuda, name)}
    module.enable(True)
    try:
        _check_engine()
        for name, replacement in replacements.items():
            setattr(torch.cuda, name, replacement)
        # scaled_dot_product_attention takes the GPU's kernel; rms_norm CUDA's fused one (FakeCapture allocates it)
        with cuda_attention(gpu.capability), fused_rms_norm():
            yield
    finally:
        for name in replacements:
            if name in originals:
                setattr(torch.cuda, name, originals[name])
            elif hasattr(torch.cuda, name):
                delattr(torch.cuda, name)
        module.enable(False)
