"""Probes: a module run on a small input of memplan's own next to a candidate replacement, to prove before a swap
that the replacement computes the same function, whatever the module's class is called.

A probe runs on real CPU tensors outside every dispatch mode (so it works on a model built under fake tensors),
with a generator and an RNG state of its own (so the model's initialisation and dropout draws are untouched), on a
stand-in for the module: a shallow copy whose small parameters and buffers are random real tensors.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes

STAND_IN_LIMIT = 1 << 16  # parameters up to this many elements get random stand-ins; larger ones meta tensors
SEED = 0  # the probes' generator and RNG seed


@contextlib.contextmanager
def isolated() -> Iterator[torch.Generator]:
    """Outside every dispatch mode, without autograd or autocast, the global RNG restored after: yields the
    probe's own generator."""
    with _disable_current_modes(), torch.no_grad(), torch.random.fork_rng(devices=[]):
        with torch.autocast("cpu", enabled=False):
            yield torch.Generator().manual_seed(SEED)


def stand_in(module: nn.Module, generator: torch.Generator, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A shallow copy of `module` (its children shared) whose own small parameters and buffers are random real CPU
    tensors of their shapes in `dtype`, and whose large ones are meta tensors (a probe that reads one fails)."""
    copied = copy.copy(module)
    for store in ("_parameters", "_buffers"):
        tensors = {}
        for name, tensor in getattr(module, store).items():
            if tensor is None:
                tensors[name] = None
            elif tensor.numel() > STAND_IN_LIMIT:
                tensors[name] = torch.empty(tensor.shape, device="meta")
            elif tensor.is_floating_point():
                tensors[name] = torch.randn(tensor.shape, generator=generator).to(dtype)
            else:
                tensors[name] = torch.zeros(tensor.shape, dtype=tensor.dtype)
        object.__setattr__(copied, store, tensors)
    return copied


def takes_one_input(module: nn.Module) -> bool:
    """Whether `module`'s forward takes exactly one argument (a replacement taking one drops nothing it is given)."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return len(parameters) == 1 and parameters[0].kind in positional


def spread_input(shape: tuple[int, ...], generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """A probe input of `shape` whose rows range from tiny to large values (where forms and roundings differ)."""
    x = torch.randn(shape, generator=generator)
    scales = torch.logspace(-3, 1.5, shape[0])
    return (x * scales.reshape(-1, *([1] * (len(shape) - 1)))).to(dtype)


def agree(first: Callable[[], torch.Tensor], second: Callable[[], torch.Tensor], ulps: float = 0.0) -> bool:
    """Whether two computations give outputs of one shape and dtype whose values are equal, or, with `ulps`, within
    that many units in the last place of the dtype (relative, and absolute at the scale of one: where a formula
    cancels near zero); False when either fails."""
    try:
        a, b = first(), second()
    except Exception:  # noqa: BLE001 - a probe that cannot run proves nothing
        return False
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype):
        return False
    if not ulps:
        return torch.equal(a, b)
    tolerance = ulps * torch.finfo(a.dtype).eps
    return torch.allclose(a.double(), b.double(), rtol=tolerance, atol=tolerance)
