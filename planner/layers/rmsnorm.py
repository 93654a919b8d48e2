"""Tempo's in-place RMSNorm: keeps the output and rstd instead of the input; backward recovers x̂ = y / w.

A drop-in for torch's nn.RMSNorm and HuggingFace's RMSNorms, whose forward arithmetic differs in where it rounds
(FLAVOURS): each flavour is reproduced with the original's own operations, a chunk of rows at a time, so the
output has the original's bits while the fp32 temporaries stay within one activation. A module is recognised by
what it computes, whatever its class is called (`flavour_of`: a probe against each flavour). Zero and tiny
weights keep exact x̂ columns, and backward is the LayerNorm's, uncentred.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from memplan.errors import MemplanError
from memplan.planner.layers import fusion, probe
from memplan.planner.layers.layernorm import exact_part, normalized_backward, row_chunks

FORWARD_TEMPORARIES = 4  # fp32 (rows × n) buffers a forward chunk may hold at once (torch's CPU rms_norm: 3.5)


class RMSNormError(MemplanError):
    """An InplaceRMSNorm was asked for a flavour it does not know."""


def torch_rows(x: torch.Tensor, rstd: torch.Tensor, weight, eps, shape: tuple[int, ...]) -> torch.Tensor:
    """nn.RMSNorm: torch's own rms_norm (one rounding, fused or not as torch decides)."""
    return torch.rms_norm(x.reshape(-1, *shape), shape, weight, eps).reshape(x.shape)


def llama_rows(x: torch.Tensor, rstd: torch.Tensor, weight, eps, shape: tuple[int, ...]) -> torch.Tensor:
    """LlamaRMSNorm (Mistral, Qwen2): x·rstd in fp32, rounded to the input's dtype, then times the weight."""
    return weight * (x.to(torch.float32) * rstd).to(x.dtype)


def t5_rows(x: torch.Tensor, rstd: torch.Tensor, weight, eps, shape: tuple[int, ...]) -> torch.Tensor:
    """T5LayerNorm: x·rstd (promoted), rounded to the weight's dtype when that is half precision, times the weight."""
    normed = x * rstd
    if weight.dtype in (torch.float16, torch.bfloat16):
        normed = normed.to(weight.dtype)
    return weight * normed


def fp32_weight_rows(x: torch.Tensor, rstd: torch.Tensor, weight, eps, shape: tuple[int, ...]) -> torch.Tensor:
    """OLMo 2's, GPT-OSS's, Helium's RMSNorm: the weight times x·rstd in fp32, rounded once to the input's dtype."""
    return (weight.to(torch.float32) * (x.to(torch.float32) * rstd)).to(x.dtype)


def offset_rows(x: torch.Tensor, rstd: torch.Tensor, weight, eps, shape: tuple[int, ...]) -> torch.Tensor:
    """Gemma's RMSNorm: x·rstd times (1 + weight) in fp32, rounded once to the input's dtype."""
    return ((x.to(torch.float32) * rstd) * (1.0 + weight.float())).to(x.dtype)


FLAVOURS = {"torch": torch_rows, "llama": llama_rows, "t5": t5_rows, "fp32-weight": fp32_weight_rows}
FLAVOURS["offset"] = offset_rows  # y = x̂·(1 + w): backward divides by 1 + w (`scale_of`)


def rows_forward(x, weight, shape: tuple[int, ...], eps, flavour: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd) of rows of the input: rstd in fp32 as HF computes it (torch's default eps is its computation
    dtype's machine epsilon), y by the flavour's own arithmetic."""
    rstd_eps = torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps if eps is None else eps
    rstd = torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + rstd_eps)
    return FLAVOURS[flavour](x, rstd, weight, eps, shape), rstd


def rows_math(x_rows: torch.Tensor, weight, eps, flavour: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows_forward` over (rows × n) rows of a norm over one dimension of n: pure, for one fused kernel (each row's
    sum of squares, then its output: no fp32 temporaries). The kernel rounds where the flavour rounds (Inductor's
    `emulate_precision_casts`); its sum may be ordered otherwise than torch's mean, rstd then an fp32 ulp apart."""
    return rows_forward(x_rows, weight, (n,), eps, flavour)


FUSED_FORWARD = fusion.fused(rows_math, emulate_precision_casts=True)  # one kernel; rounds where the flavour does


OUTPUT_DTYPES: dict[tuple, torch.dtype] = {}  # (flavour, dtypes, autocast) -> the dtype of the flavour's output


def output_dtype(x_rows: torch.Tensor, weight, shape: tuple[int, ...], eps, flavour: str) -> torch.dtype:
    """The dtype of the flavour's output for rows `x_rows` (promotion, autocast): seen on zero rows once for each
    flavour, input and weight dtype and autocast setting, and remembered (a zero-row forward is host time only)."""
    device_type = x_rows.device.type
    autocast = torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type)
    key = (flavour, x_rows.dtype, None if weight is None else weight.dtype, device_type, autocast)
    if key not in OUTPUT_DTYPES:
        OUTPUT_DTYPES[key] = rows_forward(x_rows[:0], weight, shape, eps, flavour)[0].dtype
    return OUTPUT_DTYPES[key]


def scale_of(weight: torch.Tensor | None, flavour: str) -> torch.Tensor | None:
    """What x̂ is multiplied by: the weight, or for the offset flavour 1 + weight in fp32."""
    return weight.detach().float() + 1.0 if flavour == "offset" and weight is not None else weight


EPSILON_NAMES = ("variance_epsilon", "eps", "epsilon")  # where RMSNorm modules keep their epsilon
PROBE_ROWS = 8
PROBE_DTYPES = ((torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16))


def epsilon_of(module: nn.Module) -> float | None:
    """The module's epsilon, a number under one of EPSILON_NAMES, or None."""
    values = (getattr(module, name, None) for name in EPSILON_NAMES)
    return next((float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)), None)


def flavour_of(module: nn.Module) -> str | None:
    """The flavour (of FLAVOURS but torch's) of RMSNorm `module` computes bit for bit, or None: a leaf whose one
    parameter is a 1-D weight and which keeps an epsilon, run (on stand-in weights) against each flavour on rows
    from tiny to large, fp32 and bf16 inputs, fp32 and bf16 weights."""
    weight = module._parameters.get("weight")
    eps = epsilon_of(module)
    if weight is None or weight.dim() != 1 or set(module._parameters) != {"weight"} or eps is None:
        return None
    if next(module.children(), None) is not None or module._buffers or not probe.takes_one_input(module):
        return None
    shape = (weight.shape[0],)
    with probe.isolated() as generator:
        cases = []
        for x_dtype, w_dtype in PROBE_DTYPES:
            stand_in = probe.stand_in(module, generator, w_dtype)
            cases.append((stand_in, probe.spread_input((PROBE_ROWS, *shape), generator, x_dtype)))
        for flavour in ("llama", "t5", "fp32-weight", "offset"):
            if all(
                probe.agree(
                    lambda m=m, x=x: m.forward(x),
                    lambda m=m, x=x, f=flavour: rows_forward(x, m.weight, shape, eps, f)[0],
                )
                for m, x in cases
            ):
                return flavour
    return None


class InplaceRMSNormFunction(torch.autograd.Function):
    """RMSNorm over the last dimensions whose backward needs its output, rstd and weight (not its input)."""

    @staticmethod
    def forward(ctx, x, weight, normalized_shape, eps, flavour):
        n = math.prod(normalized_shape)
        rows = x.numel() // n
        x_rows = x.reshape(rows, n)
        if len(normalized_shape) == 1 and fusion.runs_fused([x_rows] + ([] if weight is None else [weight])):
            # Steps 1 and 2 as one kernel over all rows, which allocates the output and rstd alone.
            y_rows, rstd = FUSED_FORWARD.run(x_rows, weight, eps, flavour, n)
            y = y_rows.view(x.shape)
        else:
            # Step 1: the output, of the dtype the flavour gives it (`output_dtype`), and rstd.
            dtype = output_dtype(x_rows, weight, normalized_shape, eps, flavour)
            y, rstd = x.new_empty(x.shape, dtype=dtype), x.new_empty((rows, 1), dtype=torch.float32)
            # Step 2: both, a chunk of rows at a time.
            y_rows = y.view(rows, n)
            for chunk in row_chunks(rows, n, x.numel() * x.element_size(), FORWARD_TEMPORARIES):
                y_rows[chunk], rstd[chunk] = rows_forward(x_rows[chunk], weight, normalized_shape, eps, flavour)
        # Step 3: the exact x̂ of the channels whose scale is too small to divide by.
        keep, exact = exact_part(x_rows, scale_of(weight, flavour), None, y.dtype, rstd)
        ctx.n, ctx.dtype, ctx.shape, ctx.flavour = n, x.dtype, x.shape, flavour
        ctx.save_for_backward(y, rstd, weight, keep, exact)
        ctx.keeps_output = True  # an activation right after may keep y too (inverse.keeps_input)
        return y

    @staticmethod
    def backward(ctx, grad):
        y, rstd, weight, keep, exact = ctx.saved_tensors
        scale = scale_of(weight, ctx.flavour)  # the offset flavour's 1 + w: n floats, made again
        dx, dweight, _ = normalized_backward(
            grad,
            y,
            rstd,
            scale,
            None,
            keep,
            exact,
            n=ctx.n,
            dtype=ctx.dtype,
            centered=False,
            weight_grad=scale is not None and ctx.needs_input_grad[1],
            bias_grad=False,
        )
        dweight = None if dweight is None else dweight.to(weight.dtype)
        return dx.reshape(ctx.shape), dweight, None, None, None


class InplaceRMSNorm(nn.Module):
    """Drop-in for nn.RMSNorm ("torch") and the RMSNorms of FLAVOURS (HF Llama's and most decoders', T5's, OLMo 2's,
    Gemma's) holding its output and rstd for backward. eps None (torch flavour only) is torch's default."""

    def __init__(
        self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True, flavour: str = "torch"
    ):
        super().__init__()
        if flavour not in FLAVOURS:
            raise RMSNormError(f"unknown RMSNorm flavour {flavour!r}: one of {', '.join(FLAVOURS)}")
        self.normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.eps, self.flavour = eps, flavour
        self.register_parameter(
            "weight", nn.Parameter(torch.ones(self.normalized_shape)) if elementwise_affine else None
        )

    @classmethod
    def from_module(cls, module: nn.Module) -> InplaceRMSNorm | None:
        """A replacement for nn.RMSNorm, or for any module `flavour_of` proves an RMSNorm of a flavour, sharing its
        weight Parameter (so optimizers and state dicts keep working) and its training flag; None otherwise."""
        if type(module) is nn.RMSNorm:
            flavour, shape, eps = "torch", tuple(module.normalized_shape), module.eps
        elif (flavour := flavour_of(module)) is not None:
            shape, eps = tuple(module.weight.shape), epsilon_of(module)
        else:
            return None
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.normalized_shape, new.eps, new.flavour = shape, eps, flavour
        new.register_parameter("weight", module.weight)
        new.train(module.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return InplaceRMSNormFunction.apply(x, self.weight, self.normalized_shape, self.eps, self.flavour)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, flavour={self.flavour!r}"
