"""The Workload type: what a model file builds, and the one training step every stage runs."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def default_loss(output: Any, inputs: Any) -> torch.Tensor:
    """Mean of the model's first output tensor (in fp32): a loss for models that bring none."""
    if isinstance(output, torch.Tensor):
        first = output
    elif isinstance(output, dict) or hasattr(output, "values"):
        first = next(v for v in output.values() if isinstance(v, torch.Tensor))
    else:
        first = next(v for v in output if isinstance(v, torch.Tensor))
    return first.float().mean()


def optimizer_state(optimizer: torch.optim.Optimizer) -> Iterator[tuple[Any, dict]]:
    """(parameter, its state) for every parameter the optimizer keeps state for, including an optimizer it wraps
    and steps in its place (ZeroRedundancyOptimizer's `optim`, the AdamW over this rank's partition)."""
    yield from optimizer.state.items()
    inner = getattr(optimizer, "optim", None)
    if isinstance(inner, torch.optim.Optimizer) and inner is not optimizer:
        yield from optimizer_state(inner)


@dataclass
class Workload:
    """A model, one input batch, a loss and an optimizer.

    `inputs` is passed to the model as `model(*inputs)` for a tuple, `model(**inputs)` for a
    dict, and `model(inputs)` otherwise. `loss_fn(output, inputs)` returns a scalar tensor.
    """

    model: nn.Module
    inputs: Any
    optimizer: torch.optim.Optimizer
    loss_fn: Callable[[Any, Any], torch.Tensor] = default_loss
    name: str = "workload"
    patch: dict | None = None  # what the layer mode applied to the model changed (meta "patch"), when one was
    holds_output: bool = True  # the step keeps its output and loss until it ends, as a training loop's variables do
    autocast: torch.dtype | None = None  # forward and loss under torch.autocast in this dtype (mixed precision)
    loss_patch: Any = None  # what the step's loss choice changed (planner.layers.LossPatch, meta "loss_patch" as it
    #                         stands when the step ends: how the fused loss ran), when one was applied
    optimizer_choice: Any = None  # what the step's optimizer choice made of the model file's optimizer
    #                               (planner.layers.OptimizerChoice, meta "optimizer_state"), when not as built

    def roots(self) -> list[nn.Module]:
        """The modules the step calls from outside the model: a call of one of them outside backward is a forward (a
        pipeline's stages; else the model)."""
        return [self.model]

    def warmup_steps(self) -> int:
        """Steps that settle the program before the recorded one: one (the optimizer state made, lazy initialisation
        done), two when the model holds a DistributedDataParallel, whose reducer rebuilds its gradient buckets in
        the second step's forward (in the order the first backward made the gradients ready)."""
        return 2 if any(isinstance(m, DistributedDataParallel) for m in self.model.modules()) else 1

    def held(self) -> Iterator[tuple[torch.Tensor, str, str]]:
        """(tensor, category, module) for what the step's own machinery keeps between steps beyond the model,
        optimizer and inputs (a pipeline's receive buffers): labelled so when a step begins. None here."""
        return iter(())

    def forward(self) -> Any:
        if isinstance(self.inputs, tuple):
            return self.model(*self.inputs)
        if isinstance(self.inputs, dict):
            return self.model(**self.inputs)
        return self.model(self.inputs)

    def autocasting(self) -> contextlib.AbstractContextManager:
        """torch.autocast on the parameters' device type in `autocast`'s dtype, or nothing."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(next(self.model.parameters()).device.type, dtype=self.autocast)

    def step(self) -> torch.Tensor:
        """One full training step: forward, loss, backward, optimizer step, then gradients set to None.

        Gradients are released at the end of the step, so every step after the first (which creates
        the optimizer state) allocates and frees the same buffers in the same order. The output and the loss
        live until the step ends (a loop's `output = model(x)` holds them through backward and the optimizer's
        step) unless `holds_output` is False: then the output is dropped once the loss is computed.
        """
        with self.autocasting():
            output = self.forward()
            loss = self.loss_fn(output, self.inputs)
        if not self.holds_output:
            del output
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()
