"""Kernel launches and host reads of a step, counted without a GPU: how far a layer's work is from being
host-bound on one (each launch costs the host its Python and dispatch; each read of a device value waits for the
device's queue).

Counted by a TorchDispatchMode run under fake CUDA tensors (`memplan.record(fake=True, device="cuda")`, or any
tensors of the counted device): each aten op that touches a tensor of the device and computes something is one
launch (`LAUNCHES` names the ops known to launch two), and ops that only make views, change metadata or allocate
(`NO_KERNEL`) are none. A fused call (planner/layers/fusion.py) is counted as its kernel's designed `launches`,
as it would run on real tensors of the device (CUDA taken to have Triton), its eager math run uncounted for its
outputs. A read (`READS`: nonzero's size, a scalar's value) is counted apart, and nonzero also as a launch.
The counts are aten ops, not CUDA's own: a cuBLAS or flash-attention call that runs several kernels counts one.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memplan.planner.layers import fusion

aten = torch.ops.aten
# Ops that launch nothing: they allocate, alias or change metadata (views are told by their schema).
NO_KERNEL = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten._unsafe_view.default,
    aten.detach.default,
    aten.alias.default,
    aten.lift_fresh.default,
    aten.set_.source_Storage_storage_offset,
    aten.resize_.default,
}
READS = {"nonzero", "_local_scalar_dense", "is_nonzero", "item", "equal"}  # read a device value on the host
# Ops that launch two kernels on CUDA: LayerNorm's backward runs the input's gradient, then γ's and β's.
LAUNCHES = {"native_layer_norm_backward": 2}


def op_name(func) -> str:
    """An op's name without its overload: `aten::mm.default` -> `mm`."""
    return func._schema.name.split("::")[-1]


def launches_kernel(func) -> bool:
    """Whether the op computes on the device: an aten op, not a view, not an allocation, not a metadata change."""
    return func.namespace == "aten" and func not in NO_KERNEL and not func.is_view


class LaunchCount(TorchDispatchMode):
    """The ops of `device_type` run inside, as launches (by op name) and host reads (by op name); fused calls
    modelled as fused (`fused`) or as their eager math."""

    def __init__(self, device_type: str = "cuda", fused: bool = True):
        super().__init__()
        self.device_type, self.fused = device_type, fused
        self.launches: Counter[str] = Counter()
        self.reads: Counter[str] = Counter()
        self._paused = 0

    @property
    def total(self) -> int:
        """Every launch counted."""
        return sum(self.launches.values())

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Nothing run inside the block is counted (what a real step knows without a launch)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def call(self, kernel: fusion.Fused, args: tuple):
        """A fused call: its eager math run uncounted for its outputs, its kernel's launches counted."""
        with self.uncounted():
            result = kernel.function(*args)
        if not self._paused:
            self.launches[f"fused {kernel.function.__name__}"] += kernel.launches
        return result

    def _on_device(self, args, kwargs, out) -> bool:
        leaves = tree_flatten((args, kwargs, out))[0]
        return any(isinstance(t, torch.Tensor) and t.device.type == self.device_type for t in leaves)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self._paused and self._on_device(args, kwargs, out):
            name = op_name(func)
            if name in READS:
                self.reads[name] += 1
            if launches_kernel(func) and name not in READS - {"nonzero"}:
                self.launches[name] += LAUNCHES.get(name, 1)
        return out


@contextlib.contextmanager
def counting(device_type: str = "cuda", fused: bool = True) -> Iterator[LaunchCount]:
    """Count the launches and reads of what runs inside on `device_type` (see the module's docstring); `fused`:
    the tempo layers' fused kernels taken to run (MEMPLAN_FUSED on), else their eager math counted."""
    count = LaunchCount(device_type, fused)
    with fusion.modelled(count), count:
        yield count
