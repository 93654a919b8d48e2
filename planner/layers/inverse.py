"""Recover an activation's input from its output, so a layer can keep the output instead of the input.

Serves activations with one minimum x* whose left branch tends to 0⁻ (GELU in both forms, SiLU): a
1-byte mask (x ≥ x*) names the branch, and tables built once in float64 by bisection give x back, and
the derivative f'(x) there. Near the minimum both are smooth in the signed s = ±sqrt(y - y*); in the
far left tail they are smooth in log(-y), which the bit pattern of |y| follows piecewise linearly
(exponent and mantissa), so the tail tables are uniform in those bits and a lookup needs no logarithm.
Linear interpolation recovers x to about 1e-6. Backward reads the derivative from its table (no
erf or exp per element), in one fused kernel or chunk by chunk, its temporaries within one
activation's bytes.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._guards import detect_fake_mode

from memplan.planner.layers import fusion

TINY = 2.0**-149  # the smallest positive fp32 number (a subnormal, bit pattern 1): the tail reaches every output
MANTISSA = 2**23  # fp32 bit patterns per octave (the mantissa's range)
TAIL_STEP = MANTISSA // 64  # bit patterns between tail entries: 64 an octave, one on each octave's first number
MAIN_POINTS = 8192
TAIL_POINTS = 8192
BISECTION_STEPS = 80
WORK_BYTES = 32  # bytes per element a chunk's temporaries may hold at once (measured: 17 for fp32, 21 for bf16)


@dataclass(frozen=True)
class InverseTables:
    """An activation's minimum (x*, y*) and its uniform interpolation tables as fp32: a main one over the signed
    s = ±sqrt(y - y*) and a tail one over the bit pattern of |y| on the left branch, stored end to end so that one
    lookup serves both; one pair for the inverse, one for the derivative."""

    x_min: float
    y_min: float
    main_start: float  # signed s of the main tables' first entry (left branch at y_tail)
    main_step: float
    joined: torch.Tensor  # x - y: the main table, then the tail table (0 past the main's end, where x = y)
    derivative: torch.Tensor  # f'(x) at the main table's entries, then f'(x)/y at the tail's (smooth there)

    @property
    def main(self) -> torch.Tensor:
        """x - y at s = main_start + i·main_step; 0 past the end, where x = y."""
        return self.joined[:MAIN_POINTS]

    @property
    def tail(self) -> torch.Tensor:
        """x - y at |y| of bit pattern i·TAIL_STEP (TINY for i = 0); read up to the entry after |y_tail|."""
        return self.joined[MAIN_POINTS:]


@dataclass(frozen=True)
class Activation:
    """An activation with one minimum whose left branch tends to 0⁻, and the tables of its inverse and its
    derivative (built when the activation is made: make it at import, outside fake tensors)."""

    name: str
    function: Callable[[torch.Tensor], torch.Tensor]  # torch's forward, any dtype (float64 builds the tables)
    function_inplace: Callable[[torch.Tensor], torch.Tensor]  # the same, written over its argument
    backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # torch's backward op: (grad, x) -> grad·f'(x)
    y_linear: float  # from this output on f(x) = x in fp32: the main table ends there
    y_tail: float  # left-branch outputs in (y_tail, 0) use the tail tables
    x_far: float  # far enough left that |f(x)| < TINY in float64: the left end of every bisection
    tables: InverseTables = field(init=False, repr=False, compare=False)
    fused_gradient: fusion.Fused = field(init=False, repr=False, compare=False)  # `gradient_math`, its own kernels

    def __post_init__(self) -> None:
        object.__setattr__(self, "tables", build_tables(self))
        # The table lookups' indices are clamped into the table (`positions`): no bounds check per element, which
        # costs the CPU kernel a third of its time.
        kernel = fusion.fused(rounded_gradient, assert_indirect_indexing=False)
        object.__setattr__(self, "fused_gradient", kernel)
        TABLES.extend([self.tables.joined, self.tables.derivative])


def invert(activation: Activation, y: torch.Tensor, lo: float, hi: float, increasing: bool) -> torch.Tensor:
    """x in [lo, hi] with f(x) = y on a monotonic piece of f, by float64 bisection."""
    lo_t, hi_t = torch.full_like(y, lo), torch.full_like(y, hi)
    for _ in range(BISECTION_STEPS):
        mid = 0.5 * (lo_t + hi_t)
        above = (activation.function(mid) > y) == increasing
        hi_t, lo_t = torch.where(above, mid, hi_t), torch.where(above, lo_t, mid)
    return 0.5 * (lo_t + hi_t)


def locate_minimum(activation: Activation) -> float:
    """x*, the zero of f' between x_far and 0 (f' ≤ 0 left of it, 0 where it underflows), by float64 bisection."""
    lo, hi = torch.tensor(activation.x_far, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)
    for _ in range(BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if activation.backward(torch.ones_like(mid), mid) <= 0 else (lo, mid)
    return float(0.5 * (lo + hi))


def bits_of(value: float) -> int:
    """The bit pattern of a positive fp32 number, as an integer (monotonic in the number)."""
    return int(torch.tensor(value, dtype=torch.float32).view(torch.int32))


def value_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """The positive number of (fractional) fp32 bit patterns, in float64: linear in the bits within an octave,
    as a kernel's position in the tail table is (subnormals below 2^-126, where the exponent field is 0)."""
    octave, mantissa = torch.div(bits, MANTISSA, rounding_mode="floor"), torch.remainder(bits, MANTISSA) / MANTISSA
    normal = (1.0 + mantissa) * torch.exp2(octave - 127.0)
    return torch.where(octave > 0, normal, mantissa * 2.0**-126)


def build_tables(activation: Activation) -> InverseTables:
    """Locate the minimum and tabulate the inverse and the derivative on both branches, in float64.

    1. x* by bisection on the sign of f'; y* = f(x*).
    2. Main tables: s uniform from the left branch at y_tail to the right branch at y_linear, y = y* + s²;
       x - y (one interpolation and one addition of y give x) and f'(x).
    3. Tail tables: the bit pattern of |y| uniform from 0 in TAIL_STEPs, an entry on each octave's first number
       (the bits follow log|y| piecewise linearly, with a kink there), on the left branch between TINY and y_tail;
       x - y and f'(x)/y, which is smooth where f'(x) itself falls through every octave with y.
    """
    x_min = locate_minimum(activation)
    y_min = float(activation.function(torch.tensor(x_min, dtype=torch.float64)))
    s_start, s_end = -math.sqrt(activation.y_tail - y_min), math.sqrt(activation.y_linear - y_min)
    s = torch.linspace(s_start, s_end, MAIN_POINTS, dtype=torch.float64)
    y_main = y_min + s * s
    right = invert(activation, y_main, x_min, activation.y_linear + 1.0, increasing=True)
    left = invert(activation, y_main, activation.x_far, x_min, increasing=False)
    x_main = torch.where(s >= 0, right, left)
    # a tail output's lookup reads up to the entry after |y_tail|'s: it must be in the table and on the left branch
    if bits_of(-activation.y_tail) + TAIL_STEP >= min((TAIL_POINTS - 1) * TAIL_STEP, bits_of(-y_min)):
        raise ValueError(f"{activation.name}: y_tail {activation.y_tail} leaves the tail table or the left branch")
    bits = torch.arange(TAIL_POINTS, dtype=torch.float64) * TAIL_STEP
    y_tail = -value_of_bits(bits).clamp(TINY, -y_min)  # past y*, the left branch's end: entries never read
    x_tail = invert(activation, y_tail, activation.x_far, x_min, increasing=False)

    def slope(x: torch.Tensor) -> torch.Tensor:
        """f'(x), torch's own backward op."""
        return activation.backward(torch.ones_like(x), x)

    return InverseTables(
        x_min,
        y_min,
        s_start,
        (s_end - s_start) / (MAIN_POINTS - 1),
        torch.cat([x_main - y_main, x_tail - y_tail]).float(),
        torch.cat([slope(x_main), slope(x_tail) / y_tail]).float(),
    )


FAKE_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # fake mode -> its copies of the tables
TABLES: list[torch.Tensor] = []  # every activation's tables (CPU, made at import)
COPIES: dict[tuple[Activation, str, torch.device], torch.Tensor] = {}  # the real tables copied to a device


def _copied(activation: Activation, which: str, device: torch.device) -> torch.Tensor:
    if (activation, which, device) not in COPIES:
        COPIES[activation, which, device] = getattr(activation.tables, which).to(device)
    return COPIES[activation, which, device]


def shared_tables() -> list[torch.Tensor]:
    """The real tables the process keeps (each activation's, and its copies on devices): constants every layer
    shares, made once at import or on first use, so a later capture never sees them allocated. A trace leaves them
    out and does not warn of them (traces/unrecorded.py; docs/limits.md)."""
    return [*TABLES, *COPIES.values()]


def table_on(activation: Activation, which: str, device: torch.device) -> torch.Tensor:
    """One of `activation`'s tables ("joined", "derivative", "main" or "tail") on `device`, copied there once;
    under fake tensors once per fake mode, so a fake copy never outlives its mode or reaches a real step."""
    mode = detect_fake_mode() if fusion.watched() else None  # a fake mode is on the mode stack, or a compile's context
    if mode is None:
        return _copied(activation, which, device)
    copies = FAKE_COPIES.setdefault(mode, {})
    if (activation, which, device) not in copies:
        copies[activation, which, device] = mode.from_tensor(getattr(activation.tables, which)).to(device)
    return copies[activation, which, device]


def interpolate(table: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Linear interpolation in a uniform table at fractional positions `pos` in [0, n - 1) (consumed: reused
    in place)."""
    index = pos.int()
    frac = pos.frac_()
    low = table.index_select(0, index)
    return low.addcmul_(frac, table.index_select(0, index.add_(1)).sub_(low))


def positions(y: torch.Tensor, right: torch.Tensor, t: InverseTables) -> tuple[torch.Tensor, torch.Tensor]:
    """Each output's fractional position in the joined tables of `t`, and whether it lies in the tail (a left
    output nearer zero than y_tail): y as fp32, `right` as 1 byte an element (x ≥ x*). Reads y and right, writes
    only its own tensors (so torch.compile fuses it whole).

    In-place ops throughout and no data-dependent selection, so fake tensors trace it as it runs:
    1. the main tables' position from the signed s = ±sqrt(y - y*);
    2. the tail tables' position from the bit pattern of |y| (every element: a select would depend on the data;
       past the tail's end where y is a right-branch output, whose tail position is never used);
    3. left outputs nearer zero than y_tail lie before the main tables: they take the tail position. Positions are
       clamped into the tables by comparisons, so a NaN output takes the main's last entry, not an index out of
       bounds (a NaN's integer conversion is undefined; `nan_to_num` runs element by element on a CPU).
    """
    s = torch.sub(y, t.y_min).clamp_(min=0.0).sqrt_()
    s.neg_().addcmul_(s, right, value=-2.0)  # -s + 2s·right: the sign of the branch
    main = s.sub_(t.main_start).div_(t.main_step)
    bits = y.abs().view(torch.int32).float()  # |y|'s bit pattern: 0 for zero, 1 for TINY
    tail = bits.div_(TAIL_STEP).clamp_(max=TAIL_POINTS - 1.001).add_(MAIN_POINTS)
    before = main < 0
    last = MAIN_POINTS - 1.001
    beyond = (main < last).logical_not_()  # past the main's end, or NaN
    position = main.masked_fill_(beyond, last)
    del beyond
    return torch.where(before, tail, position, out=main), before


def recovered(y: torch.Tensor, right: torch.Tensor, table: torch.Tensor, t: InverseTables) -> torch.Tensor:
    """The input x (fp32) with f(x) = y, from the joined inverse `table` of tables `t` (see `positions`)."""
    y = y.float()
    position, _ = positions(y, right, t)
    return interpolate(table, position).add_(y)


def recover_chunk(y: torch.Tensor, right: torch.Tensor, activation: Activation) -> torch.Tensor:
    """The input x (fp32) with f(x) = y for a flat chunk, on the right branch (x ≥ x*) where `right` is set,
    else the left."""
    return recovered(y, right.view(torch.uint8), table_on(activation, "joined", y.device), activation.tables)


def gradient_math(
    y: torch.Tensor,
    right: torch.Tensor,
    grad: torch.Tensor,
    factor: torch.Tensor | None,
    table: torch.Tensor,
    t: InverseTables,
) -> torch.Tensor:
    """grad·factor·f'(x) in fp32 (factor None: grad alone) at the x whose output is y, from the derivative
    `table` of tables `t`: the backward of an in-place activation as one pure function of a chunk. `right` is
    1 byte an element (a bool mask viewed as uint8, which a CPU kernel loads as bytes, not lane by lane)."""
    y = y.float()
    position, before = positions(y, right, t)
    slope = interpolate(table, position)
    slope.mul_(torch.where(before, y, 1.0))  # the tail holds f'(x)/y
    del position, before
    product = grad if factor is None else grad * factor
    return slope.mul_(product)


def rounded_gradient(y, right, grad, factor, table, t: InverseTables) -> torch.Tensor:
    """`gradient_math` rounded to grad's dtype: what one fused kernel computes over a whole tensor."""
    return gradient_math(y, right, grad, factor, table, t).to(grad.dtype)


def spans(numel: int, element_size: int) -> Iterator[slice]:
    """Chunks of a flat activation of `numel` elements of `element_size` bytes, as large as lets their
    temporaries (WORK_BYTES per element) stay within the activation's own bytes: the fewest chunks, so the
    fewest kernel launches on a GPU (8 chunks for fp32, 16 for bf16). They depend on shapes only."""
    size = max(1, numel * element_size // WORK_BYTES)
    return (slice(start, min(start + size, numel)) for start in range(0, numel, size))


def recover_input(y: torch.Tensor, right: torch.Tensor, activation: Activation) -> torch.Tensor:
    """The input x (fp32, flattened) with f(x) = y, on the branch `right` names, recovered chunk by chunk."""
    y, right = y.reshape(-1), right.reshape(-1)
    x = torch.empty(y.shape, dtype=torch.float32, device=y.device)
    for span in spans(y.numel(), y.element_size()):
        x[span] = recover_chunk(y[span], right[span], activation)
    return x


def input_gradient(
    y: torch.Tensor,
    right: torch.Tensor,
    activation: Activation,
    grad: torch.Tensor,
    factor: torch.Tensor | None = None,
) -> torch.Tensor:
    """grad·factor·f'(x) shaped like y, in grad's dtype (factor None: grad alone), at the x whose output is y:
    one fused kernel over the whole tensor where `fusion.runs_fused` allows, else eagerly chunk by chunk, the
    chunks' temporaries within one activation's bytes."""
    shape = y.shape
    y, right, grad = y.reshape(-1), right.reshape(-1).view(torch.uint8), grad.reshape(-1)
    factor = None if factor is None else factor.reshape(-1)
    table = table_on(activation, "derivative", y.device)
    operands = [y, right, grad, table] + ([] if factor is None else [factor])
    if fusion.runs_fused(operands):
        return activation.fused_gradient.run(y, right, grad, factor, table, activation.tables).view(shape)
    grad_input = torch.empty(y.shape, dtype=grad.dtype, device=grad.device)
    for span in spans(y.numel(), y.element_size()):
        part = None if factor is None else factor[span]
        grad_input[span] = gradient_math(y[span], right[span], grad[span], part, table, activation.tables)
    return grad_input.view(shape)


def kept_by_producer(x: torch.Tensor) -> bool:
    """Whether the op that made `x` keeps `x` itself for its backward, as the in-place LayerNorm and RMSNorm keep
    their output (their nodes say so with `keeps_output`). Read from the node, never unpacking what it saved
    (under checkpointing that would recompute); while torch.compile traces, no (it has no nodes yet)."""
    return not torch.compiler.is_compiling() and getattr(x.grad_fn, "keeps_output", False)


def part_of_larger(x: torch.Tensor) -> bool:
    """Whether `x` is a view of a larger tensor (a fused gate-and-up projection split in two, a slice), whose
    storage something else (the other half, kept by the product) holds; while torch.compile traces, no."""
    return not torch.compiler.is_compiling() and x._base is not None and x.numel() < x._base.numel()


def keeps_input(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether an in-place activation keeps its input `x` rather than its output and a mask, which would be bytes
    on top: when the op before keeps `x` anyway, or `x` is part of a larger tensor. Counts, on `module`, its calls
    and those that kept a view (`calls`, `kept_views`: the patch report says when it saved nothing)."""
    kept = kept_by_producer(x)
    view = not kept and part_of_larger(x)
    if not torch.compiler.is_compiling():
        module.calls = getattr(module, "calls", 0) + 1
        module.kept_views = getattr(module, "kept_views", 0) + view
    return kept or view


class InplaceActivationFunction(torch.autograd.Function):
    """An activation whose backward needs only its output and a bool mask (x ≥ x*), not its input; or its
    input, when `keep_input` says another op keeps that anyway (see `keeps_input`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, activation: Activation, keep_input: bool = False) -> torch.Tensor:
        y = activation.function(x)
        ctx.activation, ctx.keep_input = activation, keep_input
        ctx.save_for_backward(*((x,) if keep_input else (y, x >= activation.tables.x_min)))
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.keep_input:
            (x,) = ctx.saved_tensors
            return ctx.activation.backward(grad, x), None, None
        y, right = ctx.saved_tensors
        return input_gradient(y, right, ctx.activation, grad), None, None
