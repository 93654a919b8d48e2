"""Tempo's in-place LayerNorm: keeps the output and rstd instead of the input; backward recovers x̂ = (y - β)/γ.

Where γ is zero, tiny, or small next to β, (y - β)/γ loses x̂ (Tempo divides by zero there,
REFERENCE §2). Those channels, and only those, keep their exact x̂ in fp32 from the forward pass,
so the gradients stay exact for any weights at a cost proportional to the number of such channels.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# A channel keeps its exact x̂ when |β| > RATIO·|γ|: recovering x̂ from y there would cost about RATIO ulps.
RECOVERY_RATIO = {torch.float64: 64.0, torch.float32: 64.0, torch.bfloat16: 4.0, torch.float16: 4.0}


def exact_channels(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Indices (flattened) of the channels whose x̂ cannot be recovered accurately from the output."""
    w = weight.detach().flatten().float().abs()
    hard = w < torch.finfo(weight.dtype).tiny
    if bias is not None:
        hard |= bias.detach().flatten().float().abs() > RECOVERY_RATIO.get(weight.dtype, 4.0) * w
    return hard.nonzero().flatten()


class InplaceLayerNormFunction(torch.autograd.Function):
    """LayerNorm over the last dimensions whose backward needs its output, rstd, γ and β (not its input)."""

    @staticmethod
    def forward(ctx, x, weight, bias, normalized_shape, eps):
        y, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        n = math.prod(normalized_shape)
        keep = torch.empty(0, dtype=torch.long, device=x.device) if weight is None else exact_channels(weight, bias)
        exact = torch.empty(0, device=x.device)
        if keep.numel():
            rows = x.reshape(-1, n)[:, keep].float()
            exact = (rows - mean.reshape(-1, 1).float()) * rstd.reshape(-1, 1).float()
        ctx.n = n
        ctx.save_for_backward(y, rstd, weight, bias, keep, exact)
        return y

    @staticmethod
    def backward(ctx, grad):
        y, rstd, weight, bias, keep, exact = ctx.saved_tensors
        n = ctx.n
        dy = grad.reshape(-1, n).float()
        xhat = y.reshape(-1, n).float()
        if bias is not None:
            xhat = xhat - bias.reshape(1, n).float()
        g = dy
        if weight is not None:
            w = weight.reshape(1, n).float()
            xhat = xhat / torch.where(w == 0, torch.ones_like(w), w)
            if keep.numel():
                xhat[:, keep] = exact
            g = dy * w
        r = rstd.reshape(-1, 1).float()
        dx = r * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
        dweight = (
            (dy * xhat).sum(0).reshape(weight.shape).to(weight.dtype)
            if weight is not None and ctx.needs_input_grad[1]
            else None
        )
        dbias = dy.sum(0).reshape(bias.shape).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        return dx.reshape(grad.shape).to(grad.dtype), dweight, dbias, None, None


class InplaceLayerNorm(nn.Module):
    """Drop-in for nn.LayerNorm (with or without affine parameters) holding its output and rstd for backward."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True):
        super().__init__()
        self.normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.weight = nn.Parameter(torch.ones(self.normalized_shape)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(self.normalized_shape)) if elementwise_affine and bias else None

    @classmethod
    def from_layernorm(cls, ln: nn.LayerNorm) -> InplaceLayerNorm:
        """A replacement sharing `ln`'s parameter objects (so optimizers and state dicts keep working)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.normalized_shape, new.eps, new.elementwise_affine = (
            tuple(ln.normalized_shape),
            ln.eps,
            ln.elementwise_affine,
        )
        new.weight, new.bias = ln.weight, ln.bias
        new.train(ln.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return InplaceLayerNormFunction.apply(x, self.weight, self.bias, self.normalized_shape, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
