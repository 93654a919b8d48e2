"""torch.compile for a traced step: the model's forward compiled (Inductor by default) with AOTAutograd's
min-cut partitioner at an activation memory budget (`torch._functorch.config.activation_memory_budget`:
1 keeps what min-cut chooses, 0 recomputes in backward everything it can)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch._functorch.config as functorch_config
from torch import nn
from torch._dynamo.utils import counters

from memplan.errors import CompileError
from memplan.step import StepSpec, check_budget

# Inductor's generated code runs inside a RecordFunction named graph_N_inductor_wrapper_call, forward and
# backward alike: the step recorder labels the allocations in it outside any aten op (its buffers) `inductor`.
INDUCTOR_OPTIONS = {"profiler_mark_wrapper_call": True}


@dataclass(frozen=True)
class Compile:
    """How a step's model is compiled."""

    budget: float = 1.0  # activation_memory_budget while the forward (and so the partition) is compiled
    backend: str | Callable = "inductor"  # torch.compile's backend; FLOP counting passes its own

    def __post_init__(self) -> None:
        check_budget(self.budget)

    def meta(self) -> dict:
        """What a trace's meta "compile" says: the backend's name and the activation memory budget."""
        backend = self.backend if isinstance(self.backend, str) else getattr(self.backend, "__name__", "custom")
        return {"backend": backend, "memory_budget": self.budget}


@dataclass
class Compilations:
    """How many frames Dynamo compiled during each call of a compiled forward: only the first (the warm-up
    step's) should compile, or a recorded step would hold the compiler's work rather than the step's."""

    per_call: list[int] = field(default_factory=list)

    def require_steady(self, name: str, steps: int) -> None:
        """CompileError unless the recorded step, the last of `steps` steps that each call the forward equally
        often, compiled nothing."""
        recorded = self.per_call[len(self.per_call) - len(self.per_call) // steps :]
        if sum(recorded) > 0:
            raise CompileError(
                f"{name}: the recorded step compiled {sum(recorded)} frame(s) (no warm-up step, or a recompilation "
                "after it): its trace would hold the compiler's work, not the step's"
            )


def describe_compile(meta: dict) -> str:
    """A trace's meta "compile" (`Compile.meta()`) in words, for progress lines and summaries."""
    return f"torch.compile ({meta['backend']}), activation memory budget {meta['memory_budget']:g}"


def require_real_tensors(step: StepSpec) -> None:
    """Refuse to trace a compiled step on fake tensors: Inductor's kernels read and write the tensors' data, which
    fake tensors do not have (tried: the first compiled kernel crashes the process). Counting a compiled step's
    FLOPs needs no data, so only tracing asks this."""
    if step.compile is not None and step.fake:
        raise CompileError(
            "--compile needs real tensors: Inductor's compiled kernels run on the tensors' data, "
            "which fake tensors (--fake, --capture fake) do not have"
        )


def compile_model(model: nn.Module, options: Compile) -> Compilations:
    """Compile `model.forward` in place under `options`; Dynamo's caches are reset first, so a model built
    again (another budget, another layer mode) is compiled afresh rather than served an old graph. Shapes are
    static (a trace is of one shape), and Inductor's code is marked (INDUCTOR_OPTIONS), which changes nothing
    it allocates, so its buffers get their own label. Returns the frames compiled by each call, as they happen."""
    torch._dynamo.reset()
    inductor = options.backend == "inductor"
    compiled = torch.compile(
        model.forward, backend=options.backend, dynamic=False, options=INDUCTOR_OPTIONS if inductor else None
    )

    compilations = Compilations()

    def forward(*args, **kwargs):
        before = counters["frames"]["total"]
        try:
            with functorch_config.patch(activation_memory_budget=options.budget):
                return compiled(*args, **kwargs)
        finally:
            compilations.per_call.append(counters["frames"]["total"] - before)

    model.forward = forward
    return compilations
