"""Tempo's in-place GELU: keeps the output and a 1-byte branch mask instead of the input.

Backward reads the derivative at the input whose output it kept, on the branch the mask names (left or
right of GELU's minimum x*), from the tables of `inverse.py`: the input found by bisection and torch's
own GELU backward there, in float64, once. Tempo's published kernel used piecewise polynomials instead,
with a sign error and fp32 cancellation (REFERENCE §2). Both the erf form (BERT) and the tanh form (GPT-2) are
handled; fp32, bf16 and fp16 recover in fp32.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

from memplan.errors import MemplanError
from memplan.planner.layers import inverse

FORMS = ("none", "tanh")


def gelu_activation(approximate: str) -> inverse.Activation:
    """GELU in one form, with torch's forward and backward ops; beyond output 10 GELU(x) = x in fp32, and
    |GELU(x)| is below every fp32 number well before x = -40."""
    return inverse.Activation(
        name=f"gelu_{approximate}",
        function=functools.partial(F.gelu, approximate=approximate),
        function_inplace=functools.partial(torch.ops.aten.gelu_, approximate=approximate),
        backward=functools.partial(torch.ops.aten.gelu_backward, approximate=approximate),
        y_linear=10.0,
        y_tail=-0.05,  # x below about -2
        x_far=-40.0,
    )


GELU = {form: gelu_activation(form) for form in FORMS}
TABLES = {form: GELU[form].tables for form in FORMS}


def table_on(approximate: str, which: str, device: torch.device) -> torch.Tensor:
    """One of GELU's inverse tables ("main", "tail" or "joined") on `device` (see `inverse.table_on`)."""
    return inverse.table_on(GELU[approximate], which, device)


def recover_input(y: torch.Tensor, right: torch.Tensor, approximate: str) -> torch.Tensor:
    """The input x (fp32, flattened) with GELU(x) = y, on the right branch (x ≥ x*) where `right` is set, else
    the left."""
    return inverse.recover_input(y, right, GELU[approximate])


class GELUFormError(MemplanError):
    """A GELU form other than "none" (erf) or "tanh" was asked for."""


class InplaceGELUFunction(inverse.InplaceActivationFunction):
    """GELU whose backward needs only its output and a bool mask (x ≥ x*), not its input (unless kept anyway)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, approximate: str, keep_input: bool = False) -> torch.Tensor:
        return inverse.InplaceActivationFunction.forward(ctx, x, GELU[approximate], keep_input)


class InplaceGELU(nn.Module):
    """Drop-in for nn.GELU (approximate 'none' or 'tanh') that holds output + 1-byte mask for backward, or its
    input where the op before keeps that anyway (after the in-place LayerNorm)."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in FORMS:
            raise GELUFormError(f"unknown GELU form {approximate!r}; expected 'none' or 'tanh'")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return InplaceGELUFunction.apply(x, self.approximate, inverse.keeps_input(self, x))

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
