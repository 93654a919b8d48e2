"""Reversible residual layers (RevNet, Reformer): y1 = x1 + F(x2), y2 = x2 + G(y1), so backward rebuilds each
block's inputs from its outputs and a stack holds only its last two outputs (and two generator states a block)
for backward, however many layers it has.

Backward goes from the last block: G(y1) is run again with grad (and the random state it saw in forward), which
gives x2 = y2 - G(y1) and G's gradients; then F(x2) likewise gives x1 = y1 - F(x2). Only one branch's graph is
alive at a time. The branches are called as modules, so forward hooks (the tracer's labels) fire in the rebuild
too, and memplan's layer modes (tempo's in-place layers, selective recomputation) work inside them.

The rebuilt inputs are not bitwise those of forward: (x + g) - g rounds, and the error grows from the last block
to the first. Measured in fp32 on the reversible GPT-2 (dropout 0.1, weights at init), the largest error of a
rebuilt block input, against the largest element of the streams: 5e-7 (1.5e-7 absolute) at hidden 64 with 8 layers,
3e-6 (1.7e-5 absolute, streams up to 5.7) at GPT-2 small's shape with 12 layers, s 512; the embeddings' output, the
smallest stream, is then rebuilt within 1.2e-4 of its own largest element. `tests/test_reversible.py` allows 1e-5
of the streams' largest element; the gradients agree with ordinary backward's within 1e-6 of each one's largest.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from memplan.errors import MemplanError
from memplan.planner.layers.attention import autocast_state, rng_state, set_rng_state


class ReversibleError(MemplanError):
    """A reversible stack cannot rebuild its inputs (its outputs were changed in place, or backward ran twice)."""


class ReversibleBlock(nn.Module):
    """One reversible block of two branches: y1 = x1 + f(x2, *extra), y2 = x2 + g(y1)."""

    def __init__(self, f: nn.Module, g: nn.Module):
        super().__init__()
        self.f = f
        self.g = g

    def forward(self, x1: torch.Tensor, x2: torch.Tensor, *extra) -> tuple[torch.Tensor, torch.Tensor]:
        y1 = x1 + self.f(x2, *extra)
        return y1, x2 + self.g(y1)


class ReversibleStack(nn.Module):
    """Reversible blocks in sequence, (x1, x2, *extra) -> (y1, y2); `extra` (tensors or None, such as an attention
    mask) goes to every f.

    While training with grad enabled it runs as one ReversibleFunction (nothing but its outputs kept); in eval or
    under no_grad, and with `reversible` False (ordinary autograd keeping every activation, the reference), it
    runs its blocks plainly."""

    def __init__(self, blocks: Iterable[ReversibleBlock], reversible: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(blocks)
        self.reversible = reversible

    def forward(self, x1: torch.Tensor, x2: torch.Tensor, *extra) -> tuple[torch.Tensor, torch.Tensor]:
        if self.reversible and self.training and torch.is_grad_enabled():
            parameters = [p for p in self.parameters() if p.requires_grad]
            return ReversibleFunction.apply(x1, x2, self.layers, len(extra), *extra, *parameters)
        for block in self.layers:
            x1, x2 = block(x1, x2, *extra)
        return x1, x2

    def extra_repr(self) -> str:
        return f"reversible={self.reversible}"


@dataclass(frozen=True)
class GeneratorStates:
    """The generator states dropout draws from next: the CPU's, and the device's when it is CUDA (the ones
    torch.utils.checkpoint keeps)."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None

    @classmethod
    def now(cls, device: torch.device) -> GeneratorStates:
        return cls(torch.get_rng_state(), rng_state(device) if device.type == "cuda" else None)

    def restore(self, device: torch.device) -> None:
        """Set the generators back to these states (inside a torch.random.fork_rng block)."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            set_rng_state(device, self.cuda)


@dataclass(frozen=True)
class BlockStates:
    """The generator states one block's branches started from in forward, replayed when they are rebuilt."""

    before_f: GeneratorStates
    before_g: GeneratorStates


@dataclass
class Rebuild:
    """What backward needs besides the saved tensors: where and how forward ran, and what gets gradients."""

    device: torch.device
    autocast: dict  # attention.autocast_state of forward
    slots: dict[int, int]  # id of a parameter that requires grad -> its position among `apply`'s last inputs
    inputs: int  # how many those last inputs are (the extra arguments, then the parameters)
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> gradient so far

    def branch(
        self, module: nn.Module, x: torch.Tensor, extra: tuple, states: GeneratorStates, grad: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`module(x, *extra)` run again with grad from `states`, and the gradient `grad` of its output taken back
        to x and to its parameters and the extra tensors (added to `grads`); returns (output, dx), the graph freed."""
        x = x.detach().requires_grad_()
        targets = [(i, t) for i, t in enumerate(extra) if isinstance(t, torch.Tensor) and t.requires_grad]
        targets += [(self.slots[id(p)], p) for p in module.parameters() if id(p) in self.slots]
        devices = [self.device] if self.device.type == "cuda" else []
        with (
            torch.random.fork_rng(devices=devices, device_type=self.device.type),
            torch.enable_grad(),
            torch.autocast(**self.autocast),
        ):
            states.restore(self.device)
            out = module(x, *extra)
        dx, *grads = torch.autograd.grad(out, [x, *(t for _, t in targets)], grad, allow_unused=True)
        for (slot, _), g in zip(targets, grads):
            if g is not None:
                self.grads[slot] = g if slot not in self.grads else self.grads[slot] + g
        return out.detach(), dx

    def gradients(self) -> list[torch.Tensor | None]:
        """The gradients of the extra arguments and the parameters, in `apply`'s order (None where none)."""
        return [self.grads.pop(slot, None) for slot in range(self.inputs)]


class ReversibleFunction(torch.autograd.Function):
    """A stack of reversible blocks keeping only its outputs and each block's generator states for backward;
    the extra arguments and the parameters are inputs, so their gradients come back the ordinary way."""

    @staticmethod
    def forward(ctx, x1, x2, blocks: nn.ModuleList, extra_count: int, *rest):
        extra, device = rest[:extra_count], x1.device
        states = []
        for block in blocks:  # autograd runs a Function's forward without grad: nothing is kept
            before_f = GeneratorStates.now(device)
            x1 = x1 + block.f(x2, *extra)
            before_g = GeneratorStates.now(device)
            x2 = x2 + block.g(x1)
            states.append(BlockStates(before_f, before_g))
        ctx.blocks, ctx.states = blocks, states
        # Detached aliases, not save_for_backward: backward drops them block by block (they share the outputs'
        # version counter, which backward checks).
        ctx.outputs = [x1.detach(), x2.detach()]
        ctx.versions = (x1._version, x2._version)
        slots = {id(p): extra_count + j for j, p in enumerate(rest[extra_count:])}
        ctx.rebuild = Rebuild(device, autocast_state(device.type), slots, len(rest))
        ctx.save_for_backward(*extra)
        return x1, x2

    @staticmethod
    @once_differentiable
    def backward(ctx, dy1, dy2):
        if not hasattr(ctx, "outputs"):
            raise ReversibleError("backward ran twice through a reversible stack: its outputs were consumed")
        y1, y2 = ctx.outputs
        del ctx.outputs
        if (y1._version, y2._version) != ctx.versions:
            raise ReversibleError("an output of a reversible stack was changed in place: its inputs cannot be rebuilt")
        extra, rebuild = ctx.saved_tensors, ctx.rebuild
        for block in reversed(ctx.blocks):
            states = ctx.states.pop()
            g, dy1_from_g = rebuild.branch(block.g, y1, (), states.before_g, dy2)
            x2, dx1 = y2 - g, dy1 + dy1_from_g
            g = y2 = dy1 = dy1_from_g = None  # freed before F is rebuilt
            f, dx2_from_f = rebuild.branch(block.f, x2, extra, states.before_f, dx1)
            y1, y2, dy1, dy2 = y1 - f, x2, dx1, dy2 + dx2_from_f  # the block's inputs and their gradients
            f = x2 = dx1 = dx2_from_f = None
        return dy1, dy2, None, None, *rebuild.gradients()
