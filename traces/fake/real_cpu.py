"""Real CPU work under a fake capture (`memplan check`): CUDA tensors fake, the script's CPU data real.

The rule (REAL_CPU_RULE): an op runs for real when every tensor it takes is a real CPU tensor and it makes nothing on
another device; a factory (an op that takes no tensor) does so unless it runs inside an `nn.Module`'s `__init__`
(a model's parameters and buffers stay fake wherever they are built: they move to the GPU, and an 8B model built on
the CPU must not take 16 GiB of host memory); a real CPU tensor a module registers later as a parameter or buffer is
made fake as it is registered. Anything that touches a fake tensor is fake (a real input is converted
to a fake one of its layout), so `.to("cuda")` of a real tensor is a fake CUDA tensor, the allocation it is. A real
CPU tensor over the limit is made fake instead (a factory's size is known before it runs; another op's output is
converted as it returns), counted per op.
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only

DEFAULT_LIMIT = 256 << 20  # bytes: a real CPU tensor larger than this is fake (`memplan check --cpu-limit`)
REAL_CPU_RULE = (
    "an op whose tensors are all real CPU tensors runs for real (a factory too, unless inside an nn.Module's "
    "__init__: parameters and buffers stay fake, as does a real tensor registered as one); an op touching a fake "
    "tensor is fake; a real CPU tensor over the limit is fake"
)


def _inside_module_init() -> bool:
    """Whether the Python stack runs an `nn.Module`'s `__init__` (what a model builds there is its own: fake)."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__init__" and code.co_varnames[:1] == ("self",):
            if isinstance(frame.f_locals.get("self"), nn.Module):
                return True
        frame = frame.f_back
    return False


def _device(kwargs: dict) -> torch.device | None:
    """The device an op's `device` argument names (None: not given)."""
    device = kwargs.get("device")
    return None if device is None else torch.device(device)


def _nbytes(out) -> int:
    """The bytes of the largest tensor in an op's output."""
    return max((t.untyped_storage().nbytes() for t in tree_leaves(out) if isinstance(t, torch.Tensor)), default=0)


class RealCpu:
    """Which ops of a fake capture run on real CPU tensors, and running them (REAL_CPU_RULE); counts what ran for
    real and what the limit made fake."""

    def __init__(self, limit: int = DEFAULT_LIMIT):
        self.limit = limit
        self.ran = 0  # ops run for real
        self.over_limit: Counter[str] = Counter()  # op -> real CPU tensors made fake for their size

    def runs_real(self, func, args, kwargs: dict, tensors: list[torch.Tensor]) -> bool:
        """Whether the op runs for real: its tensors all real CPU ones, nothing made on another device, and a factory
        neither inside a module's `__init__` nor over the limit."""
        device = _device(kwargs)
        if device is not None and device.type != "cpu":
            return False
        if any(isinstance(t, FakeTensor) or t.device.type != "cpu" for t in tensors):
            return False
        if tensors:
            return True
        if _inside_module_init():
            return False
        size = self._factory_bytes(func, args, kwargs)
        if size > self.limit:
            self.over_limit[str(func.overloadpacket)] += 1
            return False
        return True

    @staticmethod
    def _factory_bytes(func, args, kwargs: dict) -> int:
        """The bytes a factory's output takes, from its meta version (0 where it has none)."""
        try:
            with unset_fake_temporarily():
                return _nbytes(func(*args, **{**kwargs, "device": torch.device("meta")}))
        except Exception:  # a factory without a meta kernel or a device argument: run it and see
            return 0

    def run(self, mode, func, args, kwargs: dict, tensors: list[torch.Tensor]):
        """The op run on real CPU tensors (a factory's pinned memory as plain host memory, as on a machine without
        a GPU; `mode` makes pinning a copy); an output over the limit made fake by `mode`."""
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        with unset_fake_temporarily():
            out = func(*args, **kwargs)
        self.ran += 1
        inputs = {t.untyped_storage().data_ptr() for t in tensors}

        def limited(t):
            if not isinstance(t, torch.Tensor) or isinstance(t, FakeTensor):
                return t
            if t.untyped_storage().nbytes() <= self.limit or t.untyped_storage().data_ptr() in inputs:
                return t
            self.over_limit[str(func.overloadpacket)] += 1
            return mode.from_tensor(t)

        return tree_map(limited, out)

    @staticmethod
    def as_fake(mode, args, kwargs: dict) -> tuple[tuple, dict]:
        """An op's arguments with each real CPU tensor a fake one of its layout (`mode`'s; its values unknown), for an
        op that touches a fake tensor or another device."""

        def fake(t: torch.Tensor) -> torch.Tensor:
            return t if isinstance(t, FakeTensor) or t.device.type != "cpu" else mode.from_tensor(t)

        return tree_map_only(torch.Tensor, fake, (tuple(args), kwargs))

    def module_tensors_fake(self, mode) -> list:
        """Hooks that make a real CPU tensor a module registers as a parameter or buffer (one built outside its
        `__init__`) a fake one of its layout, as the rule keeps them; their handles, to remove."""

        def fake_parameter(_module, _name, param):
            if param is None or isinstance(param, FakeTensor) or param.device.type != "cpu":
                return None
            return nn.Parameter(mode.from_tensor(param.detach()), requires_grad=param.requires_grad)

        def fake_buffer(_module, _name, buffer):
            if buffer is None or isinstance(buffer, FakeTensor) or buffer.device.type != "cpu":
                return None
            return mode.from_tensor(buffer)

        return [
            register_module_parameter_registration_hook(fake_parameter),
            register_module_buffer_registration_hook(fake_buffer),
        ]

    def summary(self) -> dict:
        """What the rule did: the limit, ops run for real, tensors made fake for their size (per op)."""
        return {"limit": self.limit, "real_ops": self.ran, "over_limit": dict(self.over_limit)}
