"""Recover an activation's input from its output, so a layer can keep the output instead of the input.

Serves activations with one minimum x* whose left branch tends to 0⁻ (GELU in both forms, SiLU): a
1-byte mask (x ≥ x*) names the branch, and tables of the inverse built once in float64 by bisection
give x back. Near the minimum the inverse is smooth in the signed s = ±sqrt(y - y*), in the far left
tail it is smooth in log(-y), so linear interpolation recovers x to about 1e-6. Backward then
evaluates torch's own derivative at the recovered x, chunk by chunk, so its temporaries stay within
one activation's bytes.
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

TINY = 2.0**-149  # the smallest positive fp32 number (a subnormal): the tail table reaches every fp32 output
LOG_Y_MIN = math.log(TINY)
MAIN_POINTS = 8192
TAIL_POINTS = 8192
BISECTION_STEPS = 80
WORK_BYTES = 32  # bytes per element a chunk's temporaries may hold at once (measured: 20 for fp32, 24 for bf16)


@dataclass(frozen=True)
class InverseTables:
    """An activation's minimum (x*, y*) and the two uniform interpolation tables of its inverse, as fp32,
    stored end to end in `joined` so one lookup serves both."""

    x_min: float
    y_min: float
    main_start: float  # signed s of the main table's first entry (left branch at y_tail)
    main_step: float
    tail_step: float
    joined: torch.Tensor  # the main table, then the tail table

    @property
    def main(self) -> torch.Tensor:
        """x - y at s = main_start + i·main_step, s = ±sqrt(y - y*); 0 past the end, where x = y."""
        return self.joined[:MAIN_POINTS]

    @property
    def tail(self) -> torch.Tensor:
        """x - y at log(-y) = LOG_Y_MIN + i·tail_step, up to log(-y_tail)."""
        return self.joined[MAIN_POINTS:]


@dataclass(frozen=True)
class Activation:
    """An activation with one minimum whose left branch tends to 0⁻, and the tables of its inverse
    (built when the activation is made: make it at import, outside fake tensors)."""

    name: str
    function: Callable[[torch.Tensor], torch.Tensor]  # torch's forward, any dtype (float64 builds the tables)
    function_inplace: Callable[[torch.Tensor], torch.Tensor]  # the same, written over its argument
    backward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # torch's backward op: (grad, x) -> grad·f'(x)
    y_linear: float  # from this output on f(x) = x in fp32: the main table ends there
    y_tail: float  # left-branch outputs in (y_tail, 0) use the log(-y) table
    x_far: float  # far enough left that |f(x)| < TINY in float64: the left end of every bisection
    tables: InverseTables = field(init=False, repr=False, compare=False)
    fused_gradient: fusion.Fused = field(init=False, repr=False, compare=False)  # `gradient_math`, its own kernels

    def __post_init__(self) -> None:
        object.__setattr__(self, "tables", build_tables(self))
        # The table lookups' indices are clamped into the table (`recovered`): no bounds check per element, which
        # costs the CPU kernel a third of its time.
        kernel = fusion.fused(rounded_gradient, assert_indirect_indexing=False)
        object.__setattr__(self, "fused_gradient", kernel)
        TABLES.append(self.tables.joined)


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


def build_tables(activation: Activation) -> InverseTables:
    """Locate the minimum and tabulate the inverse on both branches, in float64.

    1. x* by bisection on the sign of f'; y* = f(x*).
    2. Main table: s uniform from the left branch at y_tail to the right branch at y_linear, y = y* + s².
    3. Tail table: log(-y) uniform from LOG_Y_MIN to log(-y_tail), on the left branch.
    Both hold x - y, so one interpolation and one addition of y give x.
    """
    x_min = locate_minimum(activation)
    y_min = float(activation.function(torch.tensor(x_min, dtype=torch.float64)))
    s_start, s_end = -math.sqrt(activation.y_tail - y_min), math.sqrt(activation.y_linear - y_min)
    s = torch.linspace(s_start, s_end, MAIN_POINTS, dtype=torch.float64)
    y = y_min + s * s
    right = invert(activation, y, x_min, activation.y_linear + 1.0, increasing=True)
    left = invert(activation, y, activation.x_far, x_min, increasing=False)
    main = torch.where(s >= 0, right, left) - y
    log_y = torch.linspace(LOG_Y_MIN, math.log(-activation.y_tail), TAIL_POINTS, dtype=torch.float64)
    y = -torch.exp(log_y)
    tail = invert(activation, y, activation.x_far, x_min, increasing=False) - y
    return InverseTables(
        x_min,
        y_min,
        s_start,
        (s_end - s_start) / (MAIN_POINTS - 1),
        (math.log(-activation.y_tail) - LOG_Y_MIN) / (TAIL_POINTS - 1),
        torch.cat([main, tail]).float(),
    )


FAKE_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # fake mode -> its copies of the tables
TABLES: list[torch.Tensor] = []  # every activation's joined table (CPU, made at import)
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
    """One of `activation`'s tables ("joined", "main" or "tail") on `device`, copied there once; under fake
    tensors once per fake mode, so a fake copy never outlives its mode or reaches a real step."""
    mode = detect_fake_mode()
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


def recover_chunk(y: torch.Tensor, right: torch.Tensor, activation: Activation) -> torch.Tensor:
    """The input x (fp32) with f(x) = y for a flat chunk, on the right branch (x ≥ x*) where `right` is set,
    else the left (see `recovered`)."""
    return recovered(y, right, table_on(activation, "joined", y.device), activation.tables)


def recovered(y: torch.Tensor, right: torch.Tensor, table: torch.Tensor, t: InverseTables) -> torch.Tensor:
    """The input x (fp32) with f(x) = y, from the joined `table` of tables `t`; reads y and right, writes only
    its own tensors (so torch.compile fuses it whole).

    In-place ops throughout and no data-dependent selection, so fake tensors trace it as it runs:
    1. the main table's position from the signed s = ±sqrt(y - y*);
    2. the tail table's position from log(-y) (every element: a select would depend on the data; log|y| where y is
       positive, a right-branch output whose tail position is never used);
    3. left outputs nearer zero than y_tail lie before the main table: they take the tail position;
    4. interpolate x - y in the joined table and add y back.
    """
    y = y.float()
    s = torch.sub(y, t.y_min).clamp_(min=0.0).sqrt_()
    s.neg_().addcmul_(s, right, value=-2.0)  # -s + 2s·right: the sign of the branch
    main = s.sub_(t.main_start).div_(t.main_step)
    # log|y|, not log(max(-y, TINY)): where y > 0 (never before the main table) the logarithm of a normal number
    # instead of the subnormal TINY, which a CPU computes many times slower.
    tail = y.neg().abs_().clamp_(min=TINY).log_().sub_(LOG_Y_MIN).div_(t.tail_step)
    tail.clamp_(0.0, TAIL_POINTS - 1.001).add_(MAIN_POINTS)
    before = main < 0
    pos = torch.where(before, tail, main.clamp_(max=MAIN_POINTS - 1.001), out=main).nan_to_num_(0.0)
    del tail, before  # freed before the lookup's own temporaries
    return interpolate(table, pos).add_(y)


def gradient_math(
    y: torch.Tensor,
    right: torch.Tensor,
    grad: torch.Tensor,
    factor: torch.Tensor | None,
    table: torch.Tensor,
    t: InverseTables,
    backward: Callable,
) -> torch.Tensor:
    """grad·factor·f'(x) in fp32 (factor None: grad alone), x recovered from the flat output y: the backward of an
    in-place activation as one pure function of a chunk (x first, then the product, freed once in fp32)."""
    x = recovered(y, right, table, t)
    return backward((grad if factor is None else grad * factor).float(), x)


def rounded_gradient(y, right, grad, factor, table, t: InverseTables, backward: Callable) -> torch.Tensor:
    """`gradient_math` rounded to grad's dtype: what one fused kernel computes over a whole tensor."""
    return gradient_math(y, right, grad, factor, table, t, backward).to(grad.dtype)


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
    """grad·factor·f'(x) shaped like y, in grad's dtype (factor None: grad alone), x recovered from the output y:
    one fused kernel over the whole tensor where `fusion.runs_fused` allows, else eagerly chunk by chunk, the
    chunks' temporaries within one activation's bytes."""
    shape = y.shape
    y, right, grad = y.reshape(-1), right.reshape(-1), grad.reshape(-1)
    factor = None if factor is None else factor.reshape(-1)
    table = table_on(activation, "joined", y.device)
    operands = [y, right, grad, table] + ([] if factor is None else [factor])
    if fusion.runs_fused(operands):
        kernel = activation.fused_gradient
        return kernel.run(y, right, grad, factor, table, activation.tables, activation.backward).view(shape)
    grad_input = torch.empty(y.shape, dtype=grad.dtype, device=grad.device)
    for span in spans(y.numel(), y.element_size()):
        part = None if factor is None else factor[span]
        grad_input[span] = gradient_math(
            y[span], right[span], grad[span], part, table, activation.tables, activation.backward
        )
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
