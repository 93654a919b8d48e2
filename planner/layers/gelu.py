"""Tempo's in-place GELU: keeps the output and a 1-byte branch mask instead of the input.

Backward recovers the input from the output by Newton's method on the branch the mask names
(left or right of GELU's minimum), in fp32, and evaluates the exact derivative there. Tempo's
published kernel used piecewise polynomials instead, with a sign error and fp32 cancellation
(REFERENCE §2). Both the erf form (BERT) and the tanh form (GPT-2) are handled.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

TANH_K = math.sqrt(2.0 / math.pi)
TANH_A = 0.044715
NEWTON_STEPS = 3


def cdf(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """The gate of GELU(x) = x·cdf(x): Φ(x) for the erf form, sigmoid(2u) for the tanh form."""
    if approximate == "tanh":
        return torch.sigmoid(2.0 * TANH_K * (x + TANH_A * x**3))
    return torch.special.ndtr(x)


def dlog_cdf(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """d/dx log cdf(x), computed without overflow far in the left tail."""
    if approximate == "tanh":
        u2 = 2.0 * TANH_K * (x + TANH_A * x**3)
        return 2.0 * TANH_K * (1.0 + 3.0 * TANH_A * x * x) * torch.sigmoid(-u2)
    return torch.exp(-0.5 * x * x - 0.5 * math.log(2.0 * math.pi) - torch.special.log_ndtr(x))


def log_cdf(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """log cdf(x), accurate where cdf(x) underflows."""
    if approximate == "tanh":
        return F.logsigmoid(2.0 * TANH_K * (x + TANH_A * x**3))
    return torch.special.log_ndtr(x)


def derivative(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """GELU'(x) = cdf(x)·(1 + x·dlog_cdf(x))."""
    c = cdf(x, approximate)
    return c + x * c * dlog_cdf(x, approximate)


@dataclass(frozen=True)
class Minimum:
    """Where GELU turns: input x*, output y*, and the curvature GELU''(x*) used for the first guess."""

    x: float
    y: float
    curvature: float


def find_minimum(approximate: str) -> Minimum:
    """GELU's minimum in float64, by Newton's method on GELU'(x) = 0 with a numerical second derivative."""
    x = torch.tensor(-0.75, dtype=torch.float64)
    h = 1e-5
    for _ in range(50):
        second = (derivative(x + h, approximate) - derivative(x - h, approximate)) / (2 * h)
        x = x - derivative(x, approximate) / second
    second = (derivative(x + h, approximate) - derivative(x - h, approximate)) / (2 * h)
    return Minimum(float(x), float(x * cdf(x, approximate)), float(second))


MINIMA = {form: find_minimum(form) for form in ("none", "tanh")}


def recover_input(y: torch.Tensor, right: torch.Tensor, approximate: str) -> torch.Tensor:
    """The input x (fp32) with GELU(x) = y, on the right branch (x ≥ x*) where `right` is set, else the left."""
    m = MINIMA[approximate]
    y = y.float()
    near_min = torch.sqrt(torch.clamp(y - m.y, min=0.0) * (2.0 / m.curvature))
    # Right branch: solve x·cdf(x) = y, starting from the quadratic model near x* or from y itself.
    xr = torch.minimum(y, m.x + near_min).clamp(min=m.x)
    for _ in range(NEWTON_STEPS):
        slope = derivative(xr, approximate).clamp(min=1e-12)
        xr = (xr - (xr * cdf(xr, approximate) - y) / slope).clamp(min=m.x)
    # Left branch: solve log(-x) + log cdf(x) = log(-y), nearly quadratic in x in the tail.
    target = torch.log(torch.clamp(-y, min=torch.finfo(torch.float32).tiny))
    tail = -torch.sqrt(-2.0 * target.clamp(max=-1.0))
    xl = torch.where(-y < 0.5 * -m.y, torch.minimum(tail, m.x - near_min), m.x - near_min).clamp(max=m.x)
    for _ in range(NEWTON_STEPS + 2):
        slope = (1.0 / xl + dlog_cdf(xl, approximate)).clamp(min=1e-12)
        xl = (xl - (torch.log(-xl) + log_cdf(xl, approximate) - target) / slope).clamp(max=m.x)
    return torch.where(right, xr, xl)


class InplaceGELUFunction(torch.autograd.Function):
    """GELU whose backward needs only its output and a bool mask (x ≥ x*), not its input."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, approximate: str) -> torch.Tensor:
        y = F.gelu(x, approximate=approximate)
        right = x >= MINIMA[approximate].x
        ctx.approximate = approximate
        ctx.save_for_backward(y, right)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y, right = ctx.saved_tensors
        slope = derivative(recover_input(y, right, ctx.approximate), ctx.approximate)
        return (grad.float() * slope).to(grad.dtype), None


class InplaceGELU(nn.Module):
    """Drop-in for nn.GELU (approximate 'none' or 'tanh') that holds output + 1-byte mask for backward."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in MINIMA:
            raise ValueError(f"unknown GELU form {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return InplaceGELUFunction.apply(x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
