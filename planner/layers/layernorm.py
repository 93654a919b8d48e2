"""Tempo's in-place LayerNorm: keeps the output and rstd instead of the input; backward recovers x̂ = (y - β)/γ.

Where γ is zero, tiny, or small next to β, (y - β)/γ loses x̂ (Tempo divides by zero there,
REFERENCE §2). Those channels, and only those, keep their exact x̂ in fp32 from the forward pass,
so the gradients stay exact for any weights at a cost proportional to the number of such channels.
The backward (shared with the in-place RMSNorm) works in row chunks whose fp32 temporaries total at
most one activation, so the layer never raises the peak it is meant to lower.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from memplan.planner.layers import fusion
from memplan.planner.layers.channels import exact_channels

# Elements of one fp32 temporary at most (64 MiB), whatever the activation: large enough that a chunk's
# kernels stay bandwidth-bound on a GPU.
CHUNK_ELEMENTS = 1 << 24
BACKWARD_TEMPORARIES = 3  # fp32 (rows × n) buffers a backward chunk holds at once: dy (then dx), x̂, a product


def exact_part(
    rows: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    rstd: torch.Tensor,
    mean: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The channels exact_channels names for an output of `dtype` (none without a weight) and their fp32
    x̂ = (x - mean)·rstd, from the input's (rows × n) view (mean None: no centring, as in RMSNorm)."""
    keep = rows.new_empty(0, dtype=torch.long) if weight is None else exact_channels(weight, bias, dtype)
    if not keep.numel():  # no channel: no ops on an empty selection (each one host time, nothing computed)
        return keep, rows.new_empty((rows.shape[0], 0), dtype=torch.float32)
    xhat = rows[:, keep].float()
    if mean is not None:
        xhat.sub_(mean.reshape(-1, 1))
    return keep, xhat.mul_(rstd.reshape(-1, 1))


def row_chunks(rows: int, n: int, budget: int, temporaries: int) -> list[slice]:
    """Slices of about equal numbers of whole rows (one at least) such that `temporaries` fp32 buffers of a
    slice's rows × n total at most `budget` bytes and none exceeds CHUNK_ELEMENTS; sizes depend on shapes only."""
    most = max(1, min(budget // (4 * temporaries * n), CHUNK_ELEMENTS // n))
    step = max(1, math.ceil(rows / max(1, math.ceil(rows / most))))  # balanced: no sliver of rows at the end
    return [slice(start, start + step) for start in range(0, max(rows, 1), step)]


def fp32_copy(t: torch.Tensor) -> torch.Tensor:
    """A new fp32 tensor holding `t` (a copy even when `t` is fp32 already)."""
    return t.new_empty(t.shape, dtype=torch.float32).copy_(t)


def recover_xhat(y: torch.Tensor, shift, divisor, keep: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """fp32 x̂ = (y - β)/γ of rows of the output, its columns `keep` taken from `exact` (their x̂ from forward)."""
    xhat = fp32_copy(y)
    if shift is not None:
        xhat.sub_(shift)
    if divisor is not None:
        xhat.div_(divisor)
    if keep.numel():
        xhat[:, keep] = exact
    return xhat


def normalized_backward(grad, y, rstd, weight, bias, keep, exact, *, n, dtype, centered, weight_grad, bias_grad):
    """dx (in `dtype`), dγ and dβ (None unless asked) of y = γ·x̂ + β over rows of n, from y and rstd (one a row).

    x̂ = (x - mean)·rstd when `centered` (LayerNorm), x·rstd when not (RMSNorm); it is recovered from y, its
    columns `keep` taken from `exact`. dx is allocated once; the rest runs in fp32 (autocast off) in row chunks
    whose temporaries total at most one activation (the input's bytes), the sums over rows accumulated.
    """
    rows = y.numel() // n
    dy_rows, y_rows, rstd_rows = grad.reshape(rows, n), y.reshape(rows, n), rstd.reshape(rows, 1)
    operands = [t for t in (dy_rows, y_rows, rstd_rows, weight, bias) if t is not None]
    if not keep.numel() and fusion.runs_fused(operands):  # one kernel, no temporaries (no exact channels)
        return fused_normalized_backward(
            dy_rows, y_rows, rstd_rows, weight, bias, dtype, centered, weight_grad, bias_grad
        )
    dx = torch.empty((rows, n), dtype=dtype, device=y.device)
    # Step 1: γ and β per channel in fp32 (a zero γ divides as one: its x̂ column comes from `exact`).
    w, divisor, shift = affine_fp32(weight, bias, n)
    dweight = y.new_zeros(n, dtype=torch.float32) if weight_grad else None
    dbias = y.new_zeros(n, dtype=torch.float32) if bias_grad else None
    with torch.autocast(y.device.type, enabled=False):
        for chunk in row_chunks(rows, n, rows * n * dtype.itemsize, BACKWARD_TEMPORARIES):
            # Step 2: the chunk's dy and x̂ as fp32 copies.
            dy = fp32_copy(dy_rows[chunk])
            xhat = recover_xhat(y_rows[chunk], shift, divisor, keep, exact[chunk])
            # Step 3: dγ += Σ dy·x̂, dβ += Σ dy over the chunk's rows, as products with ones (CUDA's sum over
            # rows stages twice its input).
            ones = dy.new_ones(dy.shape[0])
            if dweight is not None:
                dweight += ones @ (dy * xhat)
            if dbias is not None:
                dbias += ones @ dy
            # Step 4: dx = rstd·(g - mean(g) - x̂·mean(g·x̂)), g = dy·γ, computed in dy's buffer.
            if w is not None:
                dy.mul_(w)
            projection = (dy * xhat).mean(-1, keepdim=True)
            if centered:
                dy.sub_(dy.mean(-1, keepdim=True))
            dx[chunk] = dy.sub_(xhat.mul_(projection)).mul_(rstd_rows[chunk])
    return _shaped(dx, dweight, dbias, weight, bias)


def _shaped(dx, dweight, dbias, weight, bias):
    dweight = None if dweight is None else dweight.reshape(weight.shape).to(weight.dtype)
    dbias = None if dbias is None else dbias.reshape(bias.shape).to(bias.dtype)
    return dx, dweight, dbias


def affine_fp32(weight, bias, n: int):
    """γ, the divisor x̂ is recovered by (γ, a zero as one) and β, each per channel (n of them, -1: all) in fp32
    (None without them)."""
    w = None if weight is None else weight.reshape(n).float()
    divisor = None if w is None else torch.where(w == 0, torch.ones_like(w), w)
    shift = None if bias is None else bias.reshape(n).float()
    return w, divisor, shift


def fused_normalized_backward(dy_rows, y_rows, rstd_rows, weight, bias, dtype, centered, weight_grad, bias_grad):
    """`normalized_backward` as one compiled kernel over all rows (no exact channels): dx, dγ, dβ."""
    with torch.autocast(y_rows.device.type, enabled=False):
        return FUSED_BACKWARD[centered].run(
            dy_rows, y_rows, rstd_rows, weight, bias, centered, dtype, weight_grad, bias_grad
        )


def normalized_math(dy, y, rstd, weight, bias, centered: bool, dtype, weight_grad: bool, bias_grad: bool):
    """`normalized_backward`'s arithmetic over all rows at once, as one pure function for a fused kernel: dx (in
    `dtype`), dγ and dβ shaped and typed as γ and β (None unless asked), every column's x̂ recovered from y (no
    exact channels). γ and β are made fp32 inside, so the kernel's call is the only op on the host."""
    w, divisor, shift = affine_fp32(weight, bias, -1)
    dy, xhat = dy.float(), y.float()
    if shift is not None:
        xhat = xhat - shift
    if divisor is not None:
        xhat = xhat / divisor
    dweight = (dy * xhat).sum(0) if weight_grad else None
    dbias = dy.sum(0) if bias_grad else None
    if w is not None:
        dy = dy * w
    projection = (dy * xhat).mean(-1, keepdim=True)
    if centered:
        dy = dy - dy.mean(-1, keepdim=True)
    return _shaped(((dy - xhat * projection) * rstd).to(dtype), dweight, dbias, weight, bias)


# by `centered`; on CUDA a kernel over rows (dx) and one over columns (dγ, dβ): Inductor's C++ makes one
FUSED_BACKWARD = {True: fusion.fused(normalized_math, launches=2), False: fusion.fused(normalized_math, launches=2)}


class InplaceLayerNormFunction(torch.autograd.Function):
    """LayerNorm over the last dimensions whose backward needs its output, rstd, γ and β (not its input)."""

    @staticmethod
    def forward(ctx, x, weight, bias, normalized_shape, eps):
        y, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        n = math.prod(normalized_shape)
        keep, exact = exact_part(x.reshape(-1, n), weight, bias, x.dtype, rstd, mean)
        ctx.n, ctx.dtype = n, x.dtype
        ctx.save_for_backward(y, rstd, weight, bias, keep, exact)
        ctx.keeps_output = True  # an activation right after may keep y too (inverse.keeps_input)
        return y

    @staticmethod
    def backward(ctx, grad):
        y, rstd, weight, bias, keep, exact = ctx.saved_tensors
        dx, dweight, dbias = normalized_backward(
            grad,
            y,
            rstd,
            weight,
            bias,
            keep,
            exact,
            n=ctx.n,
            dtype=ctx.dtype,
            centered=True,
            weight_grad=weight is not None and ctx.needs_input_grad[1],
            bias_grad=bias is not None and ctx.needs_input_grad[2],
        )
        return dx.reshape(grad.shape), dweight, dbias, None, None


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
