"""Tempo's in-place SiLU: keeps the output and a 1-byte branch mask instead of the input.

SiLU(x) = x·sigmoid(x) has one minimum (x* ≈ -1.2785) and a left branch tending to 0⁻, like GELU:
backward reads the derivative at the kept output from the tables of `inverse.py` (torch's own SiLU
backward at the inverse, in float64, once). fp32, bf16 and fp16 recover in fp32.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from memplan.planner.layers import inverse


def silu_activation() -> inverse.Activation:
    """SiLU with torch's forward and backward ops.

    torch computes it as x / (1 + exp(-x)): in fp32 that is x once 1 + exp(-x) rounds to 1, i.e. once
    exp(-x) is at most half an ulp of 1, 2^-24: from x = 24·ln 2 ≈ 16.636 on. On the left |SiLU(x)| ≈
    |x|·exp(x) passes below the smallest fp32 number near x = -98.7.
    """
    return inverse.Activation(
        name="silu",
        function=F.silu,
        function_inplace=torch.ops.aten.silu_,
        backward=torch.ops.aten.silu_backward,
        y_linear=24 * math.log(2),
        y_tail=-0.05,  # x below about -4.4
        x_far=-120.0,
    )


SILU = silu_activation()


class InplaceSiLUFunction(inverse.InplaceActivationFunction):
    """SiLU whose backward needs only its output and a bool mask (x ≥ x*), not its input (unless kept anyway)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, keep_input: bool = False) -> torch.Tensor:
        return inverse.InplaceActivationFunction.forward(ctx, x, SILU, keep_input)


class InplaceSiLU(nn.Module):
    """Drop-in for nn.SiLU and HuggingFace's SiLUActivation that holds output + 1-byte mask for backward, or its
    input where the op before keeps that anyway (after the in-place RMSNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return InplaceSiLUFunction.apply(x, inverse.keeps_input(self, x))
