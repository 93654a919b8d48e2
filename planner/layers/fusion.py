"""The tempo layers' elementwise math fused into single kernels by torch.compile (Inductor: C++ on the CPU, Triton on
CUDA), and run eagerly wherever a compiled kernel cannot or should not run.

A layer's pure math (tensors in, new tensors out, nothing written in place) is wrapped once with `fused`; a call
runs the compiled kernel on real tensors of a device that can compile (the CPU with a C++ compiler, CUDA with
Triton) and the same function eagerly otherwise: fake tensors and any other tensor subclass, under a
TorchDispatchMode (memplan's fake tracing, FLOP counting), inside a model torch.compile is tracing (it fuses the
math itself), where autograd would record the call, with MEMPLAN_FUSED=0, and inside `eager()`. A fused kernel
allocates its outputs and nothing the eager math does not: its intermediates live in registers. Each function
compiles once per process for each dtype and device it meets (shapes are dynamic); Inductor caches the generated
code on disk, so a later process reuses it.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import types
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from memplan.cxx import BuildError, compiler

ENV = "MEMPLAN_FUSED"  # "0": the eager math everywhere (the figures of record before fusion), anything else: fused
_EAGER = contextvars.ContextVar("memplan_eager_math", default=False)
_SUPPORTED: dict[str, bool] = {}
PLAIN = (torch.Tensor, torch.nn.Parameter)  # what a kernel takes: no fake tensors, no other subclass


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Run the tempo layers' math eagerly inside the block (a benchmark's eager side; a step to compare against)."""
    token = _EAGER.set(True)
    try:
        yield
    finally:
        _EAGER.reset(token)


def enabled() -> bool:
    """Whether fused kernels may run at all: MEMPLAN_FUSED is not "0" and no `eager()` block is open."""
    return os.environ.get(ENV, "1").strip() != "0" and not _EAGER.get()


def supported(device_type: str) -> bool:
    """Whether Inductor can compile for `device_type` here: the CPU needs a C++ compiler, CUDA needs Triton."""
    if device_type not in _SUPPORTED:
        _SUPPORTED[device_type] = _can_compile(device_type)
    return _SUPPORTED[device_type]


def _can_compile(device_type: str) -> bool:
    if device_type == "cpu":
        try:
            compiler()
        except BuildError:
            return False
        return True
    if device_type == "cuda":
        from torch.utils._triton import has_triton  # loads triton's probe only when a CUDA tensor asks

        return has_triton()
    return False


def runs_fused(tensors: list[torch.Tensor]) -> bool:
    """Whether a call on `tensors` runs the compiled kernel: all plain real tensors (or Parameters) on one device
    that can compile, none that autograd would record, no dispatch mode active, no model compiling, fusion on."""
    if not tensors or not enabled() or torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    device = tensors[0].device
    grad_mode = torch.is_grad_enabled()
    for t in tensors:
        if type(t) not in PLAIN or t.device != device or (grad_mode and t.requires_grad):
            return False
    return supported(device.type)


class Fused:
    """A pure function of tensors, run as one compiled kernel where `runs_fused` says so, else eagerly.

    Dynamo keeps at most 8 compiled versions of a code object and fails past them (a graph broken in two is no
    fusion): so each signature of a call (its tensors' dtypes and device, its other arguments) compiles a copy of
    the function with a code object of its own, whose versions only differ in shapes."""

    def __init__(self, function: Callable, options: dict | None = None):
        self.function = function
        self.options = options  # Inductor's options for its kernels
        self._compiled: dict[tuple, Callable] = {}
        self.runs = 0  # calls that ran a compiled kernel (what a test checks ran)
        self.__doc__ = function.__doc__

    def run(self, *args):
        """Run the compiled kernel on `args` (compiled on first use, counted in `runs`): for callers that chunk
        their eager math, and so ask `runs_fused` themselves first."""
        key = tuple(_signature(a) for a in args)
        if key not in self._compiled:
            self._compiled[key] = _compiled(self.function, self.options)
        self.runs += 1
        return self._compiled[key](*args)

    def __call__(self, *args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        return self.run(*args) if runs_fused(tensors) else self.function(*args)


def _signature(arg) -> object:
    """What of one argument a compiled version is specialised on, shapes apart: a tensor's dtype and device, a
    number's or flag's value, another object's identity (an activation's tables, a backward op)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.device
    if arg is None or isinstance(arg, (bool, int, float, str, torch.dtype)):
        return arg
    return id(arg)


def _compiled(function: Callable, options: dict | None) -> Callable:
    """`function` compiled with dynamic shapes as one graph, from a copy with a code object of its own. Python
    numbers (a dropout's scale, an activation's table constants) are constants of the kernel, as shapes are not: a
    number passed as a graph input would be wrapped in a tensor at every call."""
    import torch._dynamo  # what torch.compile loads anyway (seconds): only once a kernel is wanted

    code, name = function.__code__.replace(), function.__name__
    copy = types.FunctionType(code, function.__globals__, name, function.__defaults__, function.__closure__)
    compiled = torch.compile(copy, dynamic=True, fullgraph=True, options=options)
    return torch._dynamo.config.patch(specialize_float=True)(compiled)


def fused(function: Callable, **options) -> Fused:
    """`function` (a pure function of tensors: no in-place writes to its arguments) fused where it can be, its
    kernels compiled with Inductor's `options`."""
    return Fused(function, options or None)
