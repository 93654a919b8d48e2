"""`memplan tradeoff`: memory against extra compute for every way memplan knows to trade one for the other.

Every layer mode (memplan.modes: as built, Megatron's baseline accounting, Tempo, selective and
full recomputation), each action beyond the modes alone on the model as built (the fused loss and each optimizer
choice where the step does not fix them, activation offload where the host link is known: its transfer time
beside the step time), torch.compile at each memory budget and each variant (another model file of the same model
built another way, such as examples/gpt2_reversible.py, as built) is traced, planned (the solver's verified
arena), simulated through PyTorch's caching allocator (its peak reserved), counted (planner.cost: the
step's FLOPs) and, on real tensors, timed: every configuration's workload built, then their steps run
interleaved (one of each in turn, planner.cost.time_workloads), so a drift in the machine's speed falls on
all alike. Each point keeps its runs, their range, and its time ratio to the model as built round by round
(median and range); points whose ratio ranges overlap are named as not distinguishable by time. Extra
compute is counted against the model as built, eager. A point is on the Pareto frontier when no other
point needs no more memory (plan arena) and no more compute with one of the two strictly less; FLOPs and
time each have their frontier.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from memplan.errors import PatchError
from memplan.modes import AS_BUILT, LOSSES, MODES, OFFLOAD, OPTIMIZERS, SWEPT_MODES, mode
from memplan.planner.cost import StepTime, count_step_flops, time_workloads, timed_workload
from memplan.planner.cost.measured import measured_times
from memplan.planner.cost.transfer import host_transfer
from memplan.planner.report.plots import figure_format
from memplan.planner.report.tradeoff_plot import plot_tradeoff
from memplan.planner.simulate.measure import measure
from memplan.step import StepSpec, check_budget
from memplan.traces.format import Trace
from memplan.traces.host import host_bytes
from memplan.traces.inputs.model_file import import_model_file
from memplan.traces.inputs.trace_model import (
    HOST_SHARE,
    CaptureChoice,
    host_memory_available,
    sized_capture,
    trace_step,
)
from memplan.traces.summary import changes_model
from memplan.units import format_size

DEFAULT_BUDGETS = (1.0, 0.5, 0.2, 0.0)
WARMUP_ROUNDS = 2  # untimed rounds before the timed ones: the optimizer state made, a compiled model compiled


@dataclass(frozen=True)
class TradeoffOptions:
    """What to measure: the step (its model file and shape; every mode and budget is measured, so its own mode and
    compilation are not used), the compile budgets, the solver's time, the timing runs."""

    step: StepSpec
    budgets: tuple[float, ...] = DEFAULT_BUDGETS  # torch.compile activation memory budgets (empty: no compile)
    time_limit: float = 5.0  # the plan solver's, per point
    repeats: int = 5  # timed steps per point (rounds of one step of each; the median and the range are kept)
    capture: str = "auto"  # real or fake traces: auto, real, fake
    output: str | None = None  # the figure (.png or .svg); None draws none
    variants: tuple[str, ...] = ()  # other model files of the same model (reversible, ...), measured as built
    actions: bool = True  # measure the actions beyond the layer modes too (action_configurations)
    host_bandwidth: int | None = None  # the host link's bytes/s one way, for offload's transfer time (else the step's
    #                                    GPU's link; with neither, offload is not measured)


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
    time_ratio: float | None  # median over the rounds of its step time / the model as built's in the same round
    pareto_flops: bool = False  # on the frontier of plan arena against extra FLOPs
    pareto_time: bool = False  # ... against step time (real traces only)
    variant: str | None = None  # the variant's model file; None for the model file's own points
    step_runs: list[float] | None = None  # every timed step in seconds, in round order; None on fake traces
    step_seconds_low: float | None = None  # the fastest and the slowest of them
    step_seconds_high: float | None = None
    time_ratio_low: float | None = None  # the range of the ratio to the model as built over the rounds
    time_ratio_high: float | None = None
    time_like: list[str] = field(default_factory=list)  # points whose ratio range overlaps this one's
    action: str | None = None  # the action beyond the layer modes the point measures (loss, optimizer, offload)
    host_moved: int | None = None  # offload: bytes moved to the host and back, each way
    transfer_seconds: float | None = None  # offload: the host link's time for them when nothing overlaps
    model: str | None = None  # the workload's name its trace gives (`gpt2-12x768`)
    measured_seconds: float | None = None  # its mode's step time measured on the step's GPU (planner/cost/measured.py)


@dataclass
class TradeoffResult:
    """Every point, how the traces were made, the figure written and the wall time."""

    options: TradeoffOptions
    capture: CaptureChoice
    points: list[TradeoffPoint]
    notes: list[str] = field(default_factory=list)  # what was not measured, and why
    figure: str | None = None
    seconds: float = 0.0
    timing: str | None = None  # how the steps were timed: "interleaved", "one after another"; None on fake traces
    measured: dict | None = None  # the step times measured on the step's GPU its points show, when any

    def summary(self) -> dict:
        return {
            "model_file": self.options.step.model_file,
            "batch": self.options.step.batch,
            "seq": self.options.step.seq,
            "dtype": self.options.step.dtype,
            "budgets": list(self.options.budgets),
            "variants": list(self.options.variants),
            "actions": self.options.actions,
            "host_bandwidth": self.options.host_bandwidth,
            "capture": self.capture.name,
            "capture_reason": self.capture.reason,
            "points": [asdict(p) for p in self.points],
            "notes": self.notes,
            "figure": self.figure,
            "seconds": round(self.seconds, 1),
            "timing": self.timing,
            "repeats": self.options.repeats,
            "gpu": None if self.options.step.gpu is None else self.options.step.gpu.name,
            "measured": self.measured,
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


@dataclass(frozen=True)
class Configuration:
    """One configuration measured: its point's name and the step that makes it."""

    name: str
    step: StepSpec
    variant: str | None  # the variant's model file, None for the model file's own
    action: str | None = None  # LOSS, OPTIMIZER or OFFLOAD for an action's point, None otherwise


LOSS, OPTIMIZER = "loss", "optimizer"  # the families of actions beyond the swept layer modes, with modes.OFFLOAD


def action_configurations(opts: TradeoffOptions, fake: bool) -> tuple[list[Configuration], list[str]]:
    """Each action alone on the model as built: the losses and optimizer choices the step does not fix, and the
    modes that offload when the host link is known; with notes for those left out."""
    base, configs, notes = opts.step.replace(mode=AS_BUILT, compile=None, fake=fake), [], []
    if opts.step.loss == AS_BUILT:
        configs += [Configuration(f"loss {n}", base.replace(loss=n), None, LOSS) for n in LOSSES if n != AS_BUILT]
    if opts.step.optimizer == AS_BUILT:
        chosen = [n for n in OPTIMIZERS if n != AS_BUILT]
        configs += [Configuration(f"optimizer {n}", base.replace(optimizer=n), None, OPTIMIZER) for n in chosen]
    offloading = [name for name in MODES if mode(name).offloads]
    if opts.host_bandwidth is None and opts.step.gpu is None:
        notes.append(f"{', '.join(offloading)} not measured: their cost is the host link's; give --host-bandwidth")
    else:
        configs += [Configuration(name, base.replace(mode=name), None, OFFLOAD) for name in offloading]
    return configs, notes


def configuration(
    opts: TradeoffOptions, mode: str, budget: float | None, fake: bool, variant: str | None = None
) -> Configuration:
    """The step's model file in `mode` compiled at `budget` (None: eager), or the model file `variant` as built."""
    name = Path(variant).stem if variant else mode if budget is None else f"compile@{budget:g}"
    step = opts.step.replace(model_file=variant or opts.step.model_file, mode=mode, compile=budget, fake=fake)
    return Configuration(name, step, variant)


def held_between_steps(trace: Trace) -> int:
    """Bytes a workload holds between its steps: those alive as its recorded step begins (parameters, optimizer
    state, inputs)."""
    return int(trace.size[trace.alloc == 0].sum())


def measure_point(
    opts: TradeoffOptions, config: Configuration, progress, capture: CaptureChoice | None = None
) -> tuple[TradeoffPoint, int]:
    """Trace (through `capture`, which may hold the step's trace already), measure and count one configuration;
    returns its point (untimed) and the bytes its workload holds between steps."""
    name, step, variant, fake = config.name, config.step, config.variant, config.step.fake
    budget, mode = step.compile, step.mode_name
    progress(f"[{name}] tracing one training step ({'fake' if fake else 'real'} tensors)")
    trace = capture.trace(step, progress) if capture is not None else trace_step(step, progress=progress)
    measured = measure(trace, name, time_limit=opts.time_limit)
    progress(f"[{name}] counting FLOPs")
    flops = count_step_flops(step)
    point = TradeoffPoint(
        name=name,
        layers=mode,
        compile_budget=budget,
        changed=changes_model(trace) or budget is not None or variant is not None,
        **measured.figures(),
        matmul_flops=flops.matmul,
        elementwise_flops=flops.elementwise,
        flops=flops.total,
        extra_flops=0,
        step_seconds=None,
        time_ratio=None,
        variant=variant,
        action=config.action,
        model=trace.meta.get("model"),
    )
    host = host_bytes(trace)
    if host is not None:
        point.host_moved = host.moved
        point.transfer_seconds = host_transfer(host.moved, step.gpu, opts.host_bandwidth).seconds
    return point, held_between_steps(trace)


def measure_action(opts: TradeoffOptions, config: Configuration, progress) -> tuple[TradeoffPoint, int] | str:
    """An action's point as measure_point gives it, or a note saying why there is none: the action cannot apply to
    this model (an optimizer it cannot rebuild), or changes nothing in it (a loss it cannot fuse)."""
    try:
        point, held = measure_point(opts, config, progress)
    except PatchError as e:
        return f"{config.name} not measured: {e}"
    if not point.changed:
        return f"{config.name} not measured: it changes nothing in this model"
    return point, held


def time_configurations(
    opts: TradeoffOptions, configs: list[Configuration], held: list[int], peaks: list[int], progress
) -> tuple[list[StepTime], bool, str | None]:
    """Every configuration's step timed on real tensors: their workloads built, then interleaved rounds (one step
    of each in turn) when they fit this machine's RAM together, else each alone. Returns the times in the
    configurations' order, whether they were interleaved, and a note when they were not."""
    need = sum(held) + max(p - h for p, h in zip(peaks, held))  # every workload held, one step running
    available = host_memory_available()
    runs = {"repeats": opts.repeats, "warmup": WARMUP_ROUNDS, "device": opts.step.device}
    if available is None or need <= HOST_SHARE * available:
        progress(f"timing {len(configs)} configurations, {opts.repeats} interleaved rounds after {WARMUP_ROUNDS}")
        workloads = {str(i): timed_workload(c.step) for i, c in enumerate(configs)}  # names may repeat (variants)
        times = time_workloads(workloads, **runs)
        return [times[str(i)] for i in range(len(configs))], True, None
    progress(f"timing {len(configs)} configurations one after another: together they would not fit this machine")
    times = [time_workloads({"step": timed_workload(c.step)}, **runs)["step"] for c in configs]
    note = (
        f"step times taken one configuration after another, not interleaved: the {len(configs)} workloads held "
        f"together would need about {format_size(need)} of the {format_size(available)} available"
    )
    return times, False, note


def set_times(points: list[TradeoffPoint], times: list[StepTime], interleaved: bool) -> None:
    """Each point's runs (`times`, in the points' order), their range, and its ratio to the first point (the model
    as built): per round when the runs were interleaved (run i of each ran side by side), else from the ranges
    (fastest over slowest and back); then the points whose ratio ranges overlap (mark_alike)."""
    reference = times[0]
    for p, t in zip(points, times):
        p.step_seconds, p.step_runs, p.step_seconds_low, p.step_seconds_high = t.median, t.runs, t.low, t.high
        if interleaved:
            ratios = [run / ref for run, ref in zip(t.runs, reference.runs)]
            p.time_ratio, p.time_ratio_low, p.time_ratio_high = statistics.median(ratios), min(ratios), max(ratios)
        else:
            p.time_ratio = t.median / reference.median
            p.time_ratio_low, p.time_ratio_high = t.low / reference.high, t.high / reference.low
    mark_alike(points)


def mark_alike(points: list[TradeoffPoint]) -> None:
    """Set each timed point's time_like: the other timed points whose ratio range overlaps its own, so that their
    step times cannot be told apart at this many runs."""
    timed = [p for p in points if p.time_ratio_low is not None]
    for p in timed:
        p.time_like = [
            q.name
            for q in timed
            if q is not p and q.time_ratio_low <= p.time_ratio_high and p.time_ratio_low <= q.time_ratio_high
        ]


def apply_measured(opts: TradeoffOptions, points: list[TradeoffPoint]) -> tuple[dict | None, str | None]:
    """Each layer mode's point (eager, no action, no variant) given the step time measured for its mode on the
    step's GPU for this model and shape (planner/cost/measured.py); the measurement as plain data and a note
    saying what was used, or with a GPU named and nothing measured, a note saying so."""
    gpu = opts.step.gpu
    if gpu is None or not points:
        return None, None
    step = opts.step
    times = measured_times(gpu.name, points[0].model, step.seq, step.batch, step.dtype)
    if times is None:
        return None, (f"no step time measured on {gpu.name} for {points[0].model} s{step.seq} b{step.batch} "
                      f"{step.dtype} (planner/cost/measured_times.json): compute by FLOPs only")  # fmt: skip
    for p in points:
        if p.compile_budget is None and p.variant is None and p.action is None and p.layers in times.seconds:
            p.measured_seconds = times.seconds[p.layers]
    return times.as_dict(), f"step times {times.describe()}"


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
    capture = sized_capture(opts.capture, opts.step, progress)
    budgets, notes = opts.budgets, []
    if capture.fake and budgets:
        budgets = ()
        notes.append("torch.compile not measured: it runs on real tensors, and these traces are fake")
    if capture.fake:
        notes.append("no step times: fake tensors compute nothing")
    # 2. Every layer mode eager, the model as built compiled at each budget, then each variant as built: traced,
    #    measured and counted one by one.
    configs = [configuration(opts, name, None, capture.fake) for name in SWEPT_MODES]
    configs += [configuration(opts, AS_BUILT, budget, capture.fake) for budget in budgets]
    configs += [configuration(opts, AS_BUILT, None, capture.fake, variant) for variant in opts.variants]
    measured = [measure_point(opts, c, progress, capture) for c in configs]
    # 3. Each action alone on the model as built, where it applies.
    actions, action_notes = action_configurations(opts, capture.fake) if opts.actions else ([], [])
    notes += action_notes
    for config in actions:
        outcome = measure_action(opts, config, progress)
        if isinstance(outcome, str):
            notes.append(outcome)
        else:
            configs.append(config)
            measured.append(outcome)
    points, held = [p for p, _ in measured], [h for _, h in measured]
    # 4. On real tensors, every configuration timed in interleaved rounds.
    timing = None
    if not capture.fake:
        times, interleaved, note = time_configurations(opts, configs, held, [p.peak_live for p in points], progress)
        set_times(points, times, interleaved)
        timing = "interleaved" if interleaved else "one after another"
        notes += [note] if note else []
    # 5. Compute against the model as built, eager; the frontiers; the figure.
    reference = points[0]
    for p in points:
        p.extra_flops = p.flops - reference.flops
    mark_frontiers(points)
    measured, note = apply_measured(opts, points)
    notes += [note] if note else []
    result = TradeoffResult(opts, capture, points, notes, timing=timing, measured=measured)
    if opts.output:
        progress(f"drawing {opts.output}")
        plot_tradeoff(result.summary(), opts.output)
        result.figure = opts.output
    result.seconds = time.monotonic() - start
    return result
