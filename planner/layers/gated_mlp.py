"""Tempo's sub-layer recomputation for gated feed-forwards, down(act(gate(x)) · up(x)): two ffn-wide tensors
held for backward instead of four.

As built, backward keeps gate's output (for act), act's output and up's output (for the product) and
the product (for down's weight gradient). GatedMLP keeps act's output, written over gate's, with a
1-byte branch mask and up's output: backward rebuilds the product for down's weight gradient and
recovers gate's output from act's with `inverse.py`. It serves every module a probe proves computes this
(`layout_of`): SwiGLU (memplan's Llama workload, HuggingFace's Llama-style decoders) and T5's gated GELU,
dropout on the product included.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from memplan.planner.layers import activations, inverse, probe
from memplan.planner.layers.attention import autocast_state
from memplan.planner.layers.baseline import SwiGLU


@dataclass(frozen=True)
class Layout:
    """The attribute names of a gated feed-forward's parts (dropout: None when it has none)."""

    gate: str
    up: str
    down: str
    activation: str
    dropout: str | None = None


SWIGLU_LAYOUT = Layout("gate", "up", "down", "act")
PROBE_WIDTHS = (8, 12)  # the stand-in Linears' model and feed-forward widths
PROBE_ULPS = 16.0  # how far the probe's outputs may round apart (the original may order its products otherwise)


def layout_of(module: nn.Module) -> Layout | None:
    """Where `module` keeps its parts, when it is a gated feed-forward: memplan's SwiGLU, or any module made of
    three nn.Linear (two model -> ffn, one ffn -> model), an activation `activations.activation_of` knows and at
    most one nn.Dropout, whose function a probe proves is down(act(gate(x)) · up(x)) with the dropout on the
    product, whatever its class and attribute names."""
    if type(module) is SwiGLU:
        return SWIGLU_LAYOUT
    children = dict(module.named_children())
    linears = {name: child for name, child in children.items() if type(child) is nn.Linear}
    dropouts = [name for name, child in children.items() if type(child) is nn.Dropout]
    if len(linears) != 3 or len(children) != 4 + len(dropouts) or len(dropouts) > 1 or module._parameters:
        return None
    if not probe.takes_one_input(module):
        return None
    acts = [name for name, child in children.items() if name not in linears and activations.activation_of(child)]
    downs = [
        name for name, down in linears.items() if all(is_inverse(down, o) for o in linears.values() if o is not down)
    ]
    if len(acts) != 1 or len(downs) != 1:
        return None
    first, second = (name for name in linears if name != downs[0])
    for gate, up in ((first, second), (second, first)):
        layout = Layout(gate, up, downs[0], acts[0], dropouts[0] if dropouts else None)
        if computes_gated(module, layout):
            return layout
    return None


def is_inverse(down: nn.Linear, other: nn.Linear) -> bool:
    """Whether `down` maps `other`'s outputs back to its inputs' width."""
    return down.in_features == other.out_features and down.out_features == other.in_features


def computes_gated(module: nn.Module, layout: Layout) -> bool:
    """Whether `module`, its Linears and dropout swapped for small random ones of the probe's own, computes what a
    GatedMLP of `layout` computes on a probe input, in training (the dropout drawn from one seed)."""
    with probe.isolated() as generator:
        model_width, ffn_width = PROBE_WIDTHS
        widths = {layout.gate: (model_width, ffn_width), layout.up: (model_width, ffn_width)}
        widths[layout.down] = (ffn_width, model_width)
        modules = dict(module._modules)
        for name, (n_in, n_out) in widths.items():
            modules[name] = nn.Linear(n_in, n_out, bias=module._modules[name].bias is not None)
            for parameter in modules[name].parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
        dropout_p = modules[layout.dropout].p if layout.dropout else 0.0
        if layout.dropout:  # in training, where the dropout shows: a dropout of the probe's own
            modules[layout.dropout] = nn.Dropout(dropout_p)
        small = copy.copy(module)
        object.__setattr__(small, "_modules", modules)
        small.training = True
        activation = activations.activation_of(modules[layout.activation])
        parts = (modules[layout.gate], modules[layout.up], modules[layout.down])
        candidate = GatedMLP(layout, *parts, activation, dropout_p)
        x = torch.randn(4, model_width, generator=generator)

        def seeded(function):
            return lambda: (torch.manual_seed(probe.SEED), function(x))[1]

        return probe.agree(seeded(small.forward), seeded(candidate.forward), PROBE_ULPS)


def overwritable(g: torch.Tensor) -> bool:
    """Whether act(g) may be written over g: g is an intermediate of autograd's graph, not a view (gate's
    Linear keeps its input, not its output, so nothing else reads g in backward)."""
    return g.grad_fn is not None and g._base is None


def dropout_scale(p: float, like: torch.Tensor) -> torch.Tensor | float:
    """1/(1 - p) as dropout multiplies `like` by it: on the CPU rounded to its dtype (a tensor of that dtype,
    as nn.Dropout's noise tensor is), on CUDA in fp32 (a Python float, as the fused kernel's)."""
    scale = 1.0 / (1.0 - p)
    return torch.full((), scale, dtype=like.dtype, device=like.device) if like.device.type == "cpu" else scale


def down_input(product: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The product as the down projection takes it: in its weight's dtype, as T5 casts it for an fp32 `wo`
    (under autocast F.linear casts anyway)."""
    if product.dtype == weight.dtype or torch.is_autocast_enabled(product.device.type):
        return product
    return product.to(weight.dtype)


class GatedMLPFunction(torch.autograd.Function):
    """down(dropout(act(g)·u)) from g = gate(x) and u = up(x), holding act(g) (over g's storage where
    `overwritable`), its 1-byte branch mask, u, down's weight and the dropout's 1-byte mask.

    Backward holds at most one ffn-wide temporary beyond its inputs and outputs, and runs its matrix
    products under the forward's autocast setting."""

    @staticmethod
    def forward(ctx, g, u, weight, bias, activation: inverse.Activation, dropout_p: float):
        # 1. The branch mask, then act(g), over g where nothing else needs g.
        right = g >= activation.tables.x_min
        a = activation.function_inplace(g) if overwritable(g) else activation.function(g)
        # 2. The product and its dropout (the mask nn.Dropout draws from the same generator state).
        product, keep = a * u, None
        if dropout_p > 0.0:
            product, keep = torch.native_dropout(product, dropout_p, True)
        # 3. Keep what backward needs; project.
        ctx.activation = activation
        ctx.scale = dropout_scale(dropout_p, a) if keep is not None else None
        ctx.autocast = autocast_state(g.device.type)
        ctx.save_for_backward(a, right, u, weight, keep)
        return F.linear(down_input(product, weight), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        a, right, u, weight, keep = ctx.saved_tensors
        need_g, need_u, need_weight, need_bias = ctx.needs_input_grad[:4]
        rows = grad.reshape(-1, grad.size(-1))
        grad_g = grad_u = grad_weight = grad_bias = None
        # 1. down's weight gradient from the product rebuilt: the one ffn-wide temporary, freed at once.
        if need_weight:
            product = a * u
            if keep is not None:
                product.mul_(keep).mul_(ctx.scale)
            with torch.autocast(**ctx.autocast):
                grad_weight = rows.t().mm(down_input(product, weight).reshape(rows.size(0), -1))
            del product
        if need_bias:
            grad_bias = rows.sum(0)
        # 2. The product's gradient, back through the dropout: step 4 turns it into up's gradient.
        if need_g or need_u:
            with torch.autocast(**ctx.autocast):
                grad_product = grad.matmul(weight).to(a.dtype)
            if keep is not None:
                grad_product.mul_(keep).mul_(ctx.scale)
        # 3. gate's gradient, chunk by chunk: act' at g recovered from act(g), times grad_product·u.
        if need_g:
            grad_g = inverse.input_gradient(a, right, ctx.activation, grad_product, u)
        # 4. up's gradient over the product's: grad_product·act(g).
        if need_u:
            grad_u = grad_product.mul_(a)
        return grad_g, grad_u, grad_weight, grad_bias, None, None


class GatedMLP(nn.Module):
    """A gated feed-forward computed by GatedMLPFunction: its Linear modules are the original's, registered
    under the original's names (same Parameters, same state-dict keys); `from_module` builds one."""

    def __init__(
        self,
        layout: Layout,
        gate: nn.Linear,
        up: nn.Linear,
        down: nn.Linear,
        activation: inverse.Activation,
        dropout_p: float = 0.0,
    ):
        super().__init__()
        self.layout, self.activation, self.dropout_p = layout, activation, dropout_p
        for name, linear in ((layout.gate, gate), (layout.up, up), (layout.down, down)):
            self.add_module(name, linear)

    @classmethod
    def from_module(cls, module: nn.Module) -> GatedMLP | None:
        """A GatedMLP sharing `module`'s Linear modules and training flag, for any module `layout_of` proves a
        gated feed-forward with a SiLU or GELU activation; None for anything else."""
        layout = layout_of(module)
        if layout is None:
            return None
        linears = [getattr(module, name) for name in (layout.gate, layout.up, layout.down)]
        activation = activations.activation_of(getattr(module, layout.activation))
        dropout_p = getattr(module, layout.dropout).p if layout.dropout else 0.0
        return cls(layout, *linears, activation, dropout_p).train(module.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, name) for name in (self.layout.gate, self.layout.up, self.layout.down))
        dropout_p = self.dropout_p if self.training else 0.0
        return GatedMLPFunction.apply(gate(x), up(x), down.weight, down.bias, self.activation, dropout_p)

    def extra_repr(self) -> str:
        return f"activation={self.activation.name}, dropout_p={self.dropout_p}"
