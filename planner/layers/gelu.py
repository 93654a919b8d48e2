"""Tempo's in-place GELU: keeps the output and a 1-byte branch mask instead of the input.

Backward recovers the input from the output on the branch the mask names (left or right of
GELU's minimum x*) and evaluates the exact derivative there with torch's own GELU backward.
Recovery reads tables of the inverse built once in float64 by bisection: near the minimum the
inverse is smooth in the signed s = ±sqrt(y - y*), in the far left tail it is smooth in log(-y),
so linear interpolation recovers x to about 1e-6. Tempo's published kernel used piecewise
polynomials instead, with a sign error and fp32 cancellation (REFERENCE §2). Both the erf form
(BERT) and the tanh form (GPT-2) are handled; fp32, bf16 and fp16 recover in fp32.
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass

import torch
from torch import nn
from torch._guards import detect_fake_mode
from torch.nn import functional as F

from memplan.traces.errors import MemplanError

FORMS = ("none", "tanh")
Y_LINEAR = 10.0  # beyond this output GELU(x) = x in fp32: the main table ends there
Y_TAIL = -0.05  # left-branch outputs closer to zero use the log(-y) table (x below about -2)
LOG_Y_MIN = math.log(1e-38)  # smaller |y| underflow; their input is taken as far left (derivative 0)
MAIN_POINTS = 8192
TAIL_POINTS = 8192


def gelu64(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """GELU in float64 (the tables' ground truth)."""
    return F.gelu(x.double(), approximate=approximate)


def derivative64(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """GELU'(x) in float64, from torch's own backward formula."""
    x = x.double()
    return torch.ops.aten.gelu_backward(torch.ones_like(x), x, approximate=approximate)


def invert(y: torch.Tensor, lo: float, hi: float, approximate: str, increasing: bool) -> torch.Tensor:
    """x in [lo, hi] with GELU(x) = y for a monotonic piece of GELU, by 80 float64 bisection steps."""
    lo_t, hi_t = torch.full_like(y, lo), torch.full_like(y, hi)
    for _ in range(80):
        mid = 0.5 * (lo_t + hi_t)
        above = (gelu64(mid, approximate) > y) == increasing
        hi_t, lo_t = torch.where(above, mid, hi_t), torch.where(above, lo_t, mid)
    return 0.5 * (lo_t + hi_t)


@dataclass(frozen=True)
class InverseTables:
    """GELU's minimum (x*, y*) and the two uniform interpolation tables of its inverse, as fp32."""

    x_min: float
    y_min: float
    main_start: float  # signed s of the main table's first entry (left branch at Y_TAIL)
    main_step: float
    main: torch.Tensor  # x - y at s = main_start + i·main_step, s = ±sqrt(y - y*); 0 past the end, where x = y
    tail_step: float
    tail: torch.Tensor  # x at log(-y) = LOG_Y_MIN + i·tail_step, up to log(-Y_TAIL)


def build_tables(approximate: str) -> InverseTables:
    """Locate the minimum (zero of GELU') and tabulate the inverse on both branches, in float64."""
    lo, hi = torch.tensor(-2.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if derivative64(mid, approximate) < 0 else (lo, mid)
    x_min = float(0.5 * (lo + hi))
    y_min = float(gelu64(torch.tensor(x_min), approximate))
    s_start, s_end = -math.sqrt(Y_TAIL - y_min), math.sqrt(Y_LINEAR - y_min)
    s = torch.linspace(s_start, s_end, MAIN_POINTS, dtype=torch.float64)
    y = y_min + s * s
    right = invert(y, x_min, Y_LINEAR + 1.0, approximate, increasing=True)
    left = invert(y, -40.0, x_min, approximate, increasing=False)
    main = torch.where(s >= 0, right, left) - y
    log_y = torch.linspace(LOG_Y_MIN, math.log(-Y_TAIL), TAIL_POINTS, dtype=torch.float64)
    tail = invert(-torch.exp(log_y), -40.0, x_min, approximate, increasing=False)
    return InverseTables(
        x_min,
        y_min,
        s_start,
        (s_end - s_start) / (MAIN_POINTS - 1),
        main.float(),
        (math.log(-Y_TAIL) - LOG_Y_MIN) / (TAIL_POINTS - 1),
        tail.float(),
    )


TABLES = {form: build_tables(form) for form in FORMS}


FAKE_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # fake mode -> its copies of the tables


@functools.cache
def _copied(approximate: str, which: str, device: torch.device) -> torch.Tensor:
    return getattr(TABLES[approximate], which).to(device)


def table_on(approximate: str, which: str, device: torch.device) -> torch.Tensor:
    """One of the inverse tables ("main" or "tail") on `device`, copied there once; under fake tensors
    once per fake mode, so a fake copy never outlives its mode or reaches a real step."""
    mode = detect_fake_mode()
    if mode is None:
        return _copied(approximate, which, device)
    copies = FAKE_COPIES.setdefault(mode, {})
    if (approximate, which, device) not in copies:
        copies[approximate, which, device] = getattr(TABLES[approximate], which).to(device)
    return copies[approximate, which, device]


def interpolate(table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Linear interpolation in a uniform table at fractional positions `pos` (consumed: clamped and reused in place)."""
    pos = pos.clamp_(0.0, table.numel() - 1.001)
    index = pos.long()
    frac = pos.frac_()
    low = table.index_select(0, index)
    return low.addcmul_(frac, table.index_select(0, index.add_(1)).sub_(low))


def recover_input(y: torch.Tensor, right: torch.Tensor, approximate: str) -> torch.Tensor:
    """The input x (fp32, flattened) with GELU(x) = y, on the right branch (x ≥ x*) where `right` is set, else the left.

    Written with in-place ops and index_select (no torch.where): on the CPU it costs a dozen
    elementwise passes.
    """
    t = TABLES[approximate]
    y = y.reshape(-1).float()
    sign = right.reshape(-1).to(torch.float32).mul_(2.0).sub_(1.0)
    s = torch.sub(y, t.y_min).clamp_(min=0.0).sqrt_().mul_(sign)  # signed ±sqrt(y - y*)
    pos = s.sub_(t.main_start).div_(t.main_step)
    tail = (pos < 0).nonzero().squeeze(1)  # left branch with y > Y_TAIL: before the main table starts
    x = interpolate(table_on(approximate, "main", y.device), pos).add_(y)
    if tail.numel():
        magnitude = y.index_select(0, tail).neg_()
        far = interpolate(
            table_on(approximate, "tail", y.device), magnitude.clamp(min=1e-38).log_().sub_(LOG_Y_MIN).div_(t.tail_step)
        )
        x.index_copy_(0, tail, far.masked_fill_(magnitude == 0, -40.0))
    return x


class GELUFormError(MemplanError):
    """A GELU form other than "none" (erf) or "tanh" was asked for."""


class InplaceGELUFunction(torch.autograd.Function):
    """GELU whose backward needs only its output and a bool mask (x ≥ x*), not its input."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, approximate: str) -> torch.Tensor:
        y = F.gelu(x, approximate=approximate)
        right = x >= TABLES[approximate].x_min
        ctx.approximate = approximate
        ctx.save_for_backward(y, right)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y, right = ctx.saved_tensors
        x = recover_input(y, right, ctx.approximate).view(y.shape)
        grad_in = torch.ops.aten.gelu_backward(grad.float(), x, approximate=ctx.approximate)
        return grad_in.to(grad.dtype), None


class InplaceGELU(nn.Module):
    """Drop-in for nn.GELU (approximate 'none' or 'tanh') that holds output + 1-byte mask for backward."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        if approximate not in FORMS:
            raise GELUFormError(f"unknown GELU form {approximate!r}; expected 'none' or 'tanh'")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return InplaceGELUFunction.apply(x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
