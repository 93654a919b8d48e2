"""`memplan tradeoff`: memory against extra compute for every way memplan knows to trade one for the other.

Every layer mode (memplan.modes: as built, Megatron's baseline accounting, Tempo, selective and
full recomputation), torch.compile at each memory budget and each variant (another model file of the same model
built another way, such as examples/gpt2_reversible.py, as built) is traced, planned (the solver's verified
arena), simulated through PyTorch's caching allocator (its peak reserved), counted (planner.cost: the
step's FLOPs) and, on real tensors, timed (median CPU step). Extra compute is counted against the model
as built, eager. A point is on the Pareto frontier when no other point needs no more memory (plan
arena) and no more compute with one of the two strictly less; FLOPs and time each have their frontier.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from memplan.modes import AS_BUILT, MODES
from memplan.planner.cost import count_step_flops, time_step
from memplan.planner.report.plots import figure_format
from memplan.planner.report.tradeoff_plot import plot_tradeoff
from memplan.planner.simulate.measure import measure
from memplan.step import StepSpec, check_budget
from memplan.traces.model_file import import_model_file
from memplan.traces.trace_model import CaptureChoice, sized_capture, trace_step

DEFAULT_BUDGETS = (1.0, 0.5, 0.2, 0.0)


@dataclass(frozen=True)
class TradeoffOptions:
    """What to measure: the step (its model file and shape; every mode and budget is measured, so its own mode and
    compilation are not used), the compile budgets, the solver's time, the timing runs."""

    step: StepSpec
    budgets: tuple[float, ...] = DEFAULT_BUDGETS  # torch.compile activation memory budgets (empty: no compile)
    time_limit: float = 5.0  # the plan solver's, per point
    repeats: int = 5  # timed steps per point (the median is kept)
    capture: str = "auto"  # real or fake traces: auto, real, fake
    output: str | None = None  # the figure (.png or .svg); None draws none
    variants: tuple[str, ...] = ()  # other model files of the same model (reversible, ...), measured as built


@dataclass
class TradeoffPoint:
    """One configuration's memory and compute; bytes, FLOPs and seconds."""

    name: str  # the layer mode, compile@BUDGET, or a variant's file name without .py
    layers: str  # the layer mode traced
    compile_budget: float | None  # torch.compile's activation memory budget; None when eager
    changed: bool  # whether the configuration differs from the model as built, eager
    buffers: int  # the figures of its Measurement (planner.simulate.measure.FIGURES)
    peak_live: int
    caching_peak_reserved: int
    caching_peak_allocated: int
    plan_arena: int
    bound: int
    status: str
    gap: float
    solver: str
    matmul_flops: int
    elementwise_flops: int
    flops: int  # matmul + elementwise
    extra_flops: int  # over the model as built, eager (< 0: less)
    step_seconds: float | None  # median CPU step time on real tensors; None on fake traces
    time_ratio: float | None  # step_seconds / the model as built's
    pareto_flops: bool = False  # on the frontier of plan arena against extra FLOPs
    pareto_time: bool = False  # ... against step time (real traces only)
    variant: str | None = None  # the variant's model file; None for the model file's own points


@dataclass
class TradeoffResult:
    """Every point, how the traces were made, the figure written and the wall time."""

    options: TradeoffOptions
    capture: CaptureChoice
    points: list[TradeoffPoint]
    notes: list[str] = field(default_factory=list)  # what was not measured, and why
    figure: str | None = None
    seconds: float = 0.0

    def summary(self) -> dict:
        return {
            "model_file": self.options.step.model_file,
            "batch": self.options.step.batch,
            "seq": self.options.step.seq,
            "dtype": self.options.step.dtype,
            "budgets": list(self.options.budgets),
            "variants": list(self.options.variants),
            "capture": self.capture.name,
            "capture_reason": self.capture.reason,
            "points": [asdict(p) for p in self.points],
            "notes": self.notes,
            "figure": self.figure,
            "seconds": round(self.seconds, 1),
        }


def dominated(point: tuple[float, float], others: list[tuple[float, float]]) -> bool:
    """Whether another (memory, compute) pair is no worse in both and better in one."""
    return any(o[0] <= point[0] and o[1] <= point[1] and o != point for o in others)


def mark_frontiers(points: list[TradeoffPoint]) -> None:
    """Set pareto_flops and pareto_time on the points no other point dominates."""
    by_flops = [(p.plan_arena, p.extra_flops) for p in points]
    for p, pair in zip(points, by_flops):
        p.pareto_flops = not dominated(pair, by_flops)
    timed = [(p.plan_arena, p.step_seconds) for p in points if p.step_seconds is not None]
    for p in points:
        p.pareto_time = p.step_seconds is not None and not dominated((p.plan_arena, p.step_seconds), timed)


def measure_point(
    opts: TradeoffOptions, mode: str, budget: float | None, fake: bool, progress, variant: str | None = None
) -> TradeoffPoint:
    """Trace, measure, count and time one configuration: the step's model file in `mode` compiled at `budget`
    (None: eager), or the model file `variant` as built."""
    name = Path(variant).stem if variant else mode if budget is None else f"compile@{budget:g}"
    step = opts.step.replace(model_file=variant or opts.step.model_file, mode=mode, compile=budget, fake=fake)
    progress(f"[{name}] tracing one training step ({'fake' if fake else 'real'} tensors)")
    trace = trace_step(step)
    measured = measure(trace, name, time_limit=opts.time_limit)
    progress(f"[{name}] counting FLOPs{'' if fake else ' and timing the step'}")
    flops = count_step_flops(step)
    seconds = None if fake else time_step(step, repeats=opts.repeats).median
    return TradeoffPoint(
        name=name,
        layers=mode,
        compile_budget=budget,
        changed=bool(trace.meta["patch"]["changed"]) or budget is not None or variant is not None,
        **measured.figures(),
        matmul_flops=flops.matmul,
        elementwise_flops=flops.elementwise,
        flops=flops.total,
        extra_flops=0,
        step_seconds=seconds,
        time_ratio=None,
        variant=variant,
    )


def tradeoff(opts: TradeoffOptions, progress: Callable[[str], None] = lambda m: None) -> TradeoffResult:
    """Measure every layer mode, compile budget and variant, mark the frontiers and draw the figure."""
    start = time.monotonic()
    for variant in opts.variants:
        import_model_file(variant)  # a variant that is not a model file fails before the work
    for budget in opts.budgets:
        check_budget(budget)  # a budget outside [0, 1] fails before the work
    if opts.output:
        figure_format(opts.output)  # a figure it cannot write fails before the work
    # 1. Real or fake traces; compiled steps need real ones.
    capture = sized_capture(opts.capture, opts.step)
    budgets, notes = opts.budgets, []
    if capture.fake and budgets:
        budgets = ()
        notes.append("torch.compile not measured: it runs on real tensors, and these traces are fake")
    if capture.fake:
        notes.append("no step times: fake tensors compute nothing")
    # 2. Every layer mode eager, the model as built compiled at each budget, then each variant as built.
    points = [measure_point(opts, mode, None, capture.fake, progress) for mode in MODES]
    points += [measure_point(opts, AS_BUILT, budget, capture.fake, progress) for budget in budgets]
    points += [measure_point(opts, AS_BUILT, None, capture.fake, progress, variant) for variant in opts.variants]
    # 3. Compute against the model as built, eager; the frontiers; the figure.
    reference = points[0]
    for p in points:
        p.extra_flops = p.flops - reference.flops
        if p.step_seconds is not None:
            p.time_ratio = p.step_seconds / reference.step_seconds
    mark_frontiers(points)
    result = TradeoffResult(opts, capture, points, notes)
    if opts.output:
        progress(f"drawing {opts.output}")
        plot_tradeoff(result.summary(), opts.output)
        result.figure = opts.output
    result.seconds = time.monotonic() - start
    return result
