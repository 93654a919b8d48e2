"""FLOPs of one training step of a model file (forward, loss, backward, optimizer step), counted op by op at
the aten level: the compute side of a memory/compute trade-off.

Two counts, neither of them time:
- `matmul`: PyTorch's standard count, with FlopCounterMode's own formulas (torch.utils.flop_counter: mm,
  addmm, bmm, baddbmm, convolutions, SDPA) from each op's shapes, so it equals FlopCounterMode's count of
  the same step; the CPU's fused SDPA kernels, which FlopCounterMode does not know, get the formulas of
  the other SDPA kernels.
- `elementwise`: one FLOP per floating-point element that any other computing op writes (its new outputs,
  or the tensor it updates in place). Matmul FLOPs miss memory-bound recomputation: Tempo's in-place
  GELU and LayerNorm rebuild their inputs elementwise in backward. Element counts show it. Ops that
  compute nothing are skipped: views and aliases (detach included); copies and dtype conversions;
  concatenation, gathers and padding; factories and fills that write constants or random numbers.

`by_module` gives each module path of the model (as `named_modules()` names it) the FLOPs of the module and
its submodules. A forward op belongs to the innermost module whose forward runs it. A backward op belongs to
the module whose forward made the autograd node being run. Recomputation in backward (checkpointed layers,
selective attention) therefore counts for the layer it recomputes. The loss and the optimizer belong to no
module: they are in the totals only.

A compiled step is counted on the graphs that AOTAutograd partitions for Inductor (same joint-graph passes,
partitioner and decompositions), run op by op, because Inductor's kernels are not aten ops. Its forward
runs as graphs, not modules, so `by_module` is empty. Dynamo traces memplan's fake tensors, so a compiled
step can be counted with `fake` too.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn
from torch._C._autograd import _get_sequence_nr
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from memplan.errors import MemplanError
from memplan.step import StepSpec
from memplan.traces.capture import recording_session, run_user_code
from memplan.traces.compile import Compile, compile_model
from memplan.traces.fake.mode import RANDOM_FILLS
from memplan.traces.inputs.model_file import build_workload, import_model_file, require_device
from memplan.traces.inputs.workload import Workload

aten = torch.ops.aten
MATMUL_FORMULAS = {
    **flop_registry,
    aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[aten._scaled_dot_product_flash_attention],
    aten._scaled_dot_product_flash_attention_for_cpu_backward: flop_registry[
        aten._scaled_dot_product_flash_attention_backward
    ],
}  # op packet -> formula(*args, out_val=output, **kwargs): FlopCounterMode's, and the CPU's fused SDPA
MOVES = frozenset(
    {
        "aten::_to_copy",
        "aten::_unsafe_index",
        "aten::_unsafe_view",
        "aten::as_strided_scatter",
        "aten::cat",
        "aten::clone",
        "aten::constant_pad_nd",
        "aten::copy_",
        "aten::diagonal_scatter",
        "aten::embedding",
        "aten::flip",
        "aten::gather",
        "aten::index",
        "aten::index_select",
        "aten::lift_fresh_copy",
        "aten::repeat",
        "aten::roll",
        "aten::select_scatter",
        "aten::slice_scatter",
        "aten::stack",
        "prims::convert_element_type",
    }
)  # ops that only move or convert elements (view-copy ops are found by their tag)
FILLS = frozenset(
    {
        "aten::arange",
        "aten::empty",
        "aten::empty_like",
        "aten::empty_strided",
        "aten::fill",
        "aten::fill_",
        "aten::full",
        "aten::full_like",
        "aten::new_empty",
        "aten::new_empty_strided",
        "aten::new_full",
        "aten::new_ones",
        "aten::new_zeros",
        "aten::ones",
        "aten::ones_like",
        "aten::rand",
        "aten::rand_like",
        "aten::randn",
        "aten::randn_like",
        "aten::scalar_tensor",
        "aten::zero",
        "aten::zero_",
        "aten::zeros",
        "aten::zeros_like",
        "prims::iota",
        *(packet._qualified_op_name for packet in RANDOM_FILLS),
    }
)  # factories and fills: constants or random numbers, no arithmetic on the step's values


class CostError(MemplanError):
    """A step cannot be costed as asked (a bad dtype or repeat count, a step that raises)."""


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one training step: matmul (PyTorch's count), elementwise (elements written), and per module."""

    matmul: int
    elementwise: int
    by_module: dict[str, int]  # module path -> matmul + elementwise of it and its submodules; {} when compiled

    @property
    def total(self) -> int:
        return self.matmul + self.elementwise


def checked_step(workload: Workload, what: str) -> None:
    """Run one training step of `workload`; an exception from its user code becomes one CostError line."""
    run_user_code(what, workload.name, workload.step, CostError)


def _elements_written(func, args: tuple, kwargs: dict, out) -> int:
    """Floating-point elements `func` computed: its new outputs and the tensors it updates in place (an op
    that returns nothing, like `_foreach_add_`, through its mutated arguments); 0 for an op that computes
    nothing (a view, a copy, a fill)."""
    schema = func._schema
    if schema.name in MOVES or schema.name in FILLS or torch.Tag.view_copy in func.tags:
        return 0
    if schema.returns:
        outputs = (out,) if len(schema.returns) == 1 else out
        written = [o for r, o in zip(schema.returns, outputs) if r.alias_info is None or r.alias_info.is_write]
    else:
        values = [*args, *(kwargs.get(a.name) for a in schema.arguments[len(args) :])]
        written = [v for a, v in zip(schema.arguments, values) if a.alias_info is not None and a.alias_info.is_write]
    return sum(
        t.numel()
        for t in tree_leaves(written)
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
    )


class _ModulePaths:
    """The model's module running the current op: the innermost module whose forward is running (in forward,
    or again in backward to recompute); else, in backward, the innermost module whose forward made the autograd
    node being run, found by the node's sequence number. In a backward nested inside backward (a recomputation
    differentiated there), a node made by a module's forward recomputed in backward belongs to that module, and
    any other node to the module of the node that started the nested backward."""

    def __init__(self, model: nn.Module):
        self._names = {module: name for name, module in model.named_modules()}
        self._running: list[tuple[str, int]] = []  # (path, the sequence number its forward started at)
        self._made_in: dict[int, str] = {}  # autograd node sequence number -> innermost module that made it
        self._remade_in: dict[int, str] = {}  # the same for nodes made in backward (recomputed modules)
        self._backward: int | None = None  # graph task id of the step's backward
        self._nested: dict[int, str | None] = {}  # graph task id of a nested backward -> the module that started it
        self._last: str | None = None  # the module of the step's backward node run last
        self._hooks: list = []

    def __enter__(self) -> _ModulePaths:
        self._hooks = [
            register_module_forward_pre_hook(self._enter),
            register_module_forward_hook(self._leave, always_call=True),  # also when recomputation stops early
        ]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()

    def _enter(self, module: nn.Module, args) -> None:
        if module in self._names:
            self._running.append((self._names[module], _get_sequence_nr()))

    def _leave(self, module: nn.Module, args, output) -> None:
        if module not in self._names:
            return
        path, start = self._running.pop()
        made_in = self._made_in if torch._C._current_graph_task_id() == -1 else self._remade_in
        for number in range(start, _get_sequence_nr()):  # the nodes made since it began (its submodules' first)
            made_in.setdefault(number, path)

    def current(self) -> str | None:
        """The module path of the op running now; None outside the model (the loss, the optimizer)."""
        node = torch._C._current_autograd_node()
        task = torch._C._current_graph_task_id()
        # 1. Backward: the module whose forward made the node being run; in a backward nested in the step's (a
        #    recomputation differentiated in backward), the module that made it there, or that started it.
        if node is None:
            made_in = None
        elif self._backward in (None, task):
            self._backward = task
            made_in = self._last = self._made_in.get(node._sequence_nr())
        else:
            made_in = self._remade_in.get(node._sequence_nr()) or self._nested.setdefault(task, self._last)
        # 2. A module's forward running (in forward, or again in backward to recompute) comes first.
        return self._running[-1][0] if self._running else made_in


class _FlopCounting(TorchDispatchMode):
    """Counts the matmul FLOPs and elementwise elements of every aten op run under it, by module path."""

    def __init__(self, paths: _ModulePaths | None):
        super().__init__()
        self.matmul = 0
        self.elementwise = 0
        self.by_path: Counter[str] = Counter()  # innermost module path -> its ops' FLOPs
        self._paths = paths

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """True: torch.compile runs its compiled graphs under the mode (by default an active mode makes it run
        the forward eagerly), and only their ops reach it, not the compiler's own."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # 1. A composite op is split into its parts as FlopCounterMode splits it; the parts are counted.
        if func is not torch.ops.prim.device.default:
            with self:
                parts = func.decompose(*args, **kwargs)
            if parts is not NotImplemented:
                return parts
        # 2. The op runs, then counts: by formula if it is a matmul, else the elements it wrote.
        out = func(*args, **kwargs)
        formula = MATMUL_FORMULAS.get(func.overloadpacket)
        if formula is not None:
            flops = formula(*args, **kwargs, out_val=out)
            self.matmul += flops
        else:
            flops = _elements_written(func, args, kwargs, out)
            self.elementwise += flops
        # 3. The module running it gets them too (asked for every op: it follows backward's nodes).
        path = self._paths.current() if self._paths is not None else None
        if path is not None:
            self.by_path[path] += flops
        return out

    def by_module(self, model: nn.Module) -> dict[str, int]:
        """Every module path of `model` (the root excluded) -> FLOPs of the module and its submodules."""
        totals = {name: 0 for name, _ in model.named_modules() if name}
        for path, flops in self.by_path.items():
            parts = path.split(".")
            for depth in range(1, len(parts) + 1):
                prefix = ".".join(parts[:depth])
                if prefix in totals:
                    totals[prefix] += flops
        return totals


def counting_backend(graph: torch.fx.GraphModule, example_inputs) -> object:
    """torch.compile backend giving Inductor's forward/backward partition (its joint-graph passes, min-cut
    partitioner at the activation memory budget, decompositions) with the graphs run op by op, eagerly."""
    # Imported here: Inductor's modules take seconds to import, and only a compiled step needs them.
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._guards import detect_fake_mode
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.virtualized import V

    def run_graph(partitioned: torch.fx.GraphModule, inputs) -> object:
        return make_boxed_func(partitioned.forward)  # AOTAutograd calls its compilers' results boxed

    with V.set_fake_mode(detect_fake_mode(example_inputs)):  # Inductor's joint-graph passes work in it
        return aot_module_simplified(
            graph,
            example_inputs,
            fw_compiler=run_graph,
            bw_compiler=run_graph,
            partition_fn=partition_fn,
            decompositions=select_decomp_table(),
        )


def count_step_flops(step: StepSpec) -> StepFlops:
    """FLOPs of one training step (after a warm-up step), eager or compiled as the step says. On fake tensors the
    step is built and run under fake tensors, so any size fits and nothing is computed."""
    # 1. The device checked and the model file imported (outside fake tensors: import-time tensors are real).
    require_device(step.device, step.fake)
    build = import_model_file(step.model_file)
    fake = (
        recording_session(step.device, fake=True, gpu=step.gpu, routing=step.routing, torch_version=step.torch)
        if step.fake
        else None
    )
    with fake or contextlib.nullcontext():
        # 2. The workload, with its layer mode, compiled with the counting backend if asked.
        workload = build_workload(step, build)
        if step.compile is not None:
            compile_model(workload.model, Compile(step.compile, backend=counting_backend))
        # 3. A warm-up step: it creates the optimizer state and compiles.
        checked_step(workload, "warm-up step")
        # 4. The counted step, with its modules tracked when they run as modules.
        paths = _ModulePaths(workload.model) if step.compile is None else None
        with paths or contextlib.nullcontext(), _FlopCounting(paths) as counting:
            checked_step(workload, "counted step")
    by_module = counting.by_module(workload.model) if paths is not None else {}
    return StepFlops(counting.matmul, counting.elementwise, by_module)
