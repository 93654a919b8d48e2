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

A call through torch.compile costs tens of microseconds of Python (Dynamo's frame hook and guards) on top of the
kernel's own call, and a tempo step makes hundreds of them: so a call whose arguments' exact metadata (shapes,
strides, dtypes, devices, other arguments) was seen before calls the compiled graph Dynamo ran for it directly
(`Direct`); the first call of each goes through torch.compile, whose guards chose that graph.
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
# A launch count's model (launches.py): a global, not a context variable, as CUDA's backward runs on the autograd
# engine's device thread, which sees the dispatch modes of the thread that called backward but not its contexts.
_MODELLED: list = [None]
PLAIN = (torch.Tensor, torch.nn.Parameter)  # what a kernel takes: no fake tensors, no other subclass
DIRECT_CALLS = 256  # distinct call metadata a function keeps direct calls for (a model meets a few shapes a layer)


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


def watched() -> bool:
    """Whether what runs now is being traced: a dispatch mode active (fake tensors, the FLOP counter) or a model
    compiling. Such a run sees every op each time: no fused kernel, nothing remembered from an earlier call."""
    return _get_current_dispatch_mode() is not None or torch.compiler.is_compiling()


@contextlib.contextmanager
def modelled(model) -> Iterator[None]:
    """Inside the block, fused calls are modelled, not run: `runs_fused` says whether the call would run fused on
    real tensors of its device (`model.fused`: whether fusion is taken to be on), and each fused call is
    `model.call(kernel, args)` (a launch count: planner/layers/launches.py)."""
    outer, _MODELLED[0] = _MODELLED[0], model
    try:
        yield
    finally:
        _MODELLED[0] = outer


def model():
    """The launch count's model inside `modelled`, else None."""
    return _MODELLED[0]


def runs_fused(tensors: list[torch.Tensor]) -> bool:
    """Whether a call on `tensors` runs the compiled kernel: all plain real tensors (or Parameters) on one device
    that can compile, none that autograd would record, no dispatch mode active, no model compiling, fusion on.
    Inside `modelled`, whether it would on real tensors of their device (CUDA: with Triton)."""
    model = _MODELLED[0]
    if model is not None:
        return model.fused and _one_device(tensors, plain=False) and _compiles_for(tensors[0].device.type)
    if not tensors or not enabled() or watched():
        return False
    return _one_device(tensors, plain=True) and supported(tensors[0].device.type)


def _one_device(tensors: list[torch.Tensor], plain: bool) -> bool:
    """Whether `tensors` (one at least) are on one device, none that autograd would record, and (`plain`) none a
    subclass."""
    if not tensors:
        return False
    device = tensors[0].device
    grad_mode = torch.is_grad_enabled()
    for t in tensors:
        if (plain and type(t) not in PLAIN) or t.device != device or (grad_mode and t.requires_grad):
            return False
    return True


def _compiles_for(device_type: str) -> bool:
    """Whether a modelled call on `device_type` runs fused: CUDA as a GPU machine has it (Triton), else as here."""
    return device_type == "cuda" or supported(device_type)


class Fused:
    """A pure function of tensors, run as one compiled kernel where `runs_fused` says so, else eagerly.

    Dynamo keeps at most 8 compiled versions of a code object and fails past them (a graph broken in two is no
    fusion): so each signature of a call (its tensors' dtypes and device, its other arguments) compiles a copy of
    the function with a code object of its own, whose versions only differ in shapes."""

    def __init__(self, function: Callable, options: dict | None = None, launches: int = 1):
        self.function = function
        self.options = options  # Inductor's options for its kernels
        self.launches = launches  # the kernels a call launches, as designed (what a launch count counts)
        self._compiled: dict[tuple, Callable] = {}
        self._direct: dict[tuple, Direct | None] = {}  # exact metadata -> its graph called directly (None: never)
        self._graph_calls: list[tuple] = []  # (graph, its arguments, its outputs) of the calls `Recorded` saw
        self.runs = 0  # calls that ran a compiled kernel (what a test checks ran)
        self.direct_runs = 0  # of them, calls that ran the compiled graph directly
        self.__doc__ = function.__doc__

    def run(self, *args):
        """Run the compiled kernel on `args` (compiled on first use, counted in `runs`): for callers that chunk
        their eager math, and so ask `runs_fused` themselves first."""
        model = _MODELLED[0]
        if model is not None:
            return model.call(self, args)
        self.runs += 1
        key = _metadata(args)
        direct = self._direct.get(key)
        if direct is not None:
            self.direct_runs += 1
            return direct(args)
        signature = tuple(_signature(a) for a in args)
        if signature not in self._compiled:
            self._compiled[signature] = _compiled(self.function, self.options, self._graph_calls)
        self._graph_calls.clear()
        result = self._compiled[signature](*args)
        if key not in self._direct and len(self._direct) < DIRECT_CALLS:
            self._direct[key] = Direct.of(args, self._graph_calls, result)
        self._graph_calls.clear()
        return result

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


def _metadata(args: tuple) -> tuple:
    """What a compiled graph called directly must share with the call it was recorded on: each tensor's shape,
    strides, offset and dtype, each other argument's `_signature`, the tensors' device (`runs_fused`: one), and
    the grad and autocast modes."""
    key = [torch.is_grad_enabled()]
    device = None
    for a in args:
        if isinstance(a, torch.Tensor):
            device = a.device
            key.append((a.shape, a.stride(), a.storage_offset(), a.dtype))
        else:
            key.append(_signature(a))
    key += (device, device is not None and torch.is_autocast_enabled(device.type))
    return tuple(key)


class Recorded:
    """A graph Inductor compiled, as Dynamo calls it: each call noted in `calls` (graph, arguments, outputs)."""

    def __init__(self, graph: Callable, calls: list):
        self.graph, self.calls = graph, calls
        # Called as the graph asks (a boxed graph takes one list: `Direct.of` then finds no tensor it can place).
        self._boxed_call = getattr(graph, "_boxed_call", False)

    def __call__(self, *graph_args):
        outputs = self.graph(*graph_args)
        self.calls.append((self.graph, graph_args, outputs))
        return outputs


class Direct:
    """A compiled graph called without Dynamo, for calls whose metadata equals the recorded call's (so Dynamo's
    guards would pick the same graph): its arguments taken from the call's by position, or the recorded numbers
    (sizes: fixed by the shapes), its outputs arranged as the function returned them."""

    def __init__(self, graph: Callable, inputs: list, outputs: object):
        self.graph = graph
        self.inputs = inputs  # per graph argument: (True, index of the call's argument) or (False, a number)
        self.outputs = outputs  # index of the graph's output, or a tuple of such indices and Nones

    @classmethod
    def of(cls, args: tuple, graph_calls: list, result: object) -> Direct | None:
        """The direct call of the one graph a call through torch.compile ran (`graph_calls`), or None where the
        call cannot be replayed so: not one graph, a tensor passed twice, a graph argument or an output that is
        neither a call's tensor argument nor a number."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if len(graph_calls) != 1 or len({id(t) for t in tensors}) != len(tensors):
            return None
        graph, graph_args, graph_outputs = graph_calls[0]
        positions = {id(a): i for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
        inputs = []
        for value in graph_args:
            if isinstance(value, torch.Tensor):
                if id(value) not in positions:
                    return None
                inputs.append((True, positions[id(value)]))
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                inputs.append((False, value))
            else:
                return None
        indices = {id(t): i for i, t in enumerate(graph_outputs)}
        if isinstance(result, torch.Tensor):
            outputs = indices.get(id(result))
            return None if outputs is None else cls(graph, inputs, outputs)
        if not isinstance(result, tuple) or any(r is not None and id(r) not in indices for r in result):
            return None
        return cls(graph, inputs, tuple(None if r is None else indices[id(r)] for r in result))

    def __call__(self, args: tuple):
        outputs = self.graph(*[args[value] if is_argument else value for is_argument, value in self.inputs])
        if isinstance(self.outputs, int):
            return outputs[self.outputs]
        return tuple(None if i is None else outputs[i] for i in self.outputs)


def _compiled(function: Callable, options: dict | None, graph_calls: list) -> Callable:
    """`function` compiled with dynamic shapes as one graph, from a copy with a code object of its own, each call
    of its compiled graphs noted in `graph_calls`. Python numbers (a dropout's scale, an activation's table
    constants) are constants of the kernel, as shapes are not: a number passed as a graph input would be wrapped in
    a tensor at every call."""
    import torch._dynamo  # what torch.compile loads anyway (seconds): only once a kernel is wanted
    from torch._inductor.compile_fx import compile_fx

    def backend(graph: torch.fx.GraphModule, example_inputs: list) -> Recorded:
        return Recorded(compile_fx(graph, example_inputs, config_patches=options or {}), graph_calls)

    code, name = function.__code__.replace(), function.__name__
    copy = types.FunctionType(code, function.__globals__, name, function.__defaults__, function.__closure__)
    compiled = torch.compile(copy, backend=backend, dynamic=True, fullgraph=True)
    return torch._dynamo.config.patch(specialize_float=True)(compiled)


def fused(function: Callable, launches: int = 1, **options) -> Fused:
    """`function` (a pure function of tensors: no in-place writes to its arguments) fused where it can be, its
    kernels compiled with Inductor's `options`; a call launches `launches` kernels (as designed)."""
    return Fused(function, options or None, launches)
