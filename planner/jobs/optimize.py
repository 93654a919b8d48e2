"""`memplan optimize`: a mode per Transformer layer (and with max_batch the batch size) so the step fits a
memory size with the least recompute, chosen by CP-SAT on a model measured from traces, then checked
by tracing the chosen configuration and solving its plan.

The memory model (planner/optimize/terms.py) comes from the traces of terms.assignments_to_trace (every
layer in one mode, and pairs of modes alternating; the rest of the model as built); the recompute of a
layer in a mode is the FLOPs its subtree runs more than as built (planner/cost, one count per mode). An
assignment whose traced plan does not fit is cut from the model and CP-SAT asked again, so "optimal"
means: no assignment of less recompute fits, by the model, and the answer's own plan fits, measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from memplan.errors import MemplanError
from memplan.gpus import GPU
from memplan.modes import AS_BUILT, FULL, OPTIMIZE_MODES
from memplan.planner.cost import count_step_flops
from memplan.planner.layers import transformer_layers
from memplan.planner.optimize.choice_file import StepChoice
from memplan.planner.optimize.choose import Assignment, Choice, Flops, choose_modes, recompute_of
from memplan.planner.optimize.terms import MemoryTerms, assignments_to_trace, memory_terms
from memplan.planner.simulate.measure import measure
from memplan.planner.simulate.verdict import Budget, device_memory
from memplan.step import StepSpec
from memplan.traces.capture import recording_session
from memplan.traces.format import Trace, trace_digest
from memplan.traces.model_file import build_workload, import_model_file
from memplan.traces.trace_model import CaptureChoice, sized_capture, trace_step
from memplan.units import human_bytes

MEGATRON_RECIPE = FULL  # the mode Megatron's recipe checkpoints its first layers with

MAX_BATCH = 4096  # --max-batch stops doubling here
VERIFY_ROUNDS = 5  # assignments traced before the job gives up on a batch


class OptimizeError(MemplanError):
    """An optimize request that cannot be answered (no layers, nothing fits, bad options)."""


@dataclass(frozen=True)
class OptimizeOptions:
    """What to optimize: the step (its model file and shape; the modes are chosen here), the memory size (or a
    GPU), whether the batch is chosen too, and the solvers' time."""

    step: StepSpec
    memory: int | None = None  # bytes the step's plan must fit in; with `gpu`, set here from its budget
    max_batch: bool = False  # choose the largest batch that fits too (--max-batch); else the step's batch
    capture: str = "auto"  # real or fake traces: auto, real, fake
    time_limit: float = 10.0  # CP-SAT's per choice, and the plan solver's per trace
    gpu: GPU | None = None  # instead of `memory`: the GPU's memory less what it holds outside the allocator
    budget: Budget | None = field(default=None, init=False)  # the GPU's, when given

    def __post_init__(self) -> None:
        # a CUDA step on that GPU (fake CUDA traces where this machine has none)
        object.__setattr__(self, "step", self.step.on_gpu(self.gpu))
        memory, budget = device_memory(self.memory, self.gpu, self.step)
        object.__setattr__(self, "memory", memory)
        object.__setattr__(self, "budget", budget)


@dataclass
class Candidate:
    """One assignment, modelled and (when traced) measured."""

    name: str  # "chosen", "every layer tempo", "Megatron: first 2 full"
    assignment: Assignment
    recompute: Flops  # FLOPs over every layer as built
    predicted_peak: int  # the model's peak live bytes (aligned)
    peak_live: int | None = None  # of its trace, when traced (its Measurement's figures)
    plan_arena: int | None = None  # of its plan, when traced
    status: str | None = None  # its plan's proof, when traced
    fits: bool | None = None  # plan arena <= the memory size, when traced
    digest: str | None = None  # its trace's digest (traces.format.trace_digest), when traced


@dataclass
class OptimizeResult:
    """The answer: the batch, the per-layer modes, their measured plan, and what the alternatives cost."""

    options: OptimizeOptions
    capture: CaptureChoice
    batch: int
    layers: tuple[str, ...]
    choice: Choice  # CP-SAT's last answer (status: optimal, feasible, infeasible, unknown)
    chosen: Candidate | None  # the assignment whose traced plan fits; None when none does
    rejected: list[Candidate]  # assignments the model chose whose traced plans did not fit
    uniform: list[Candidate]  # every layer in one mode (traced)
    megatron: Candidate | None  # the first k layers full, the rest as built, least k the model fits (traced)
    step_flops: Flops  # FLOPs of the step with every layer as built
    seconds: float

    def step_choice(self) -> StepChoice | None:
        """The chosen actions with their verified figures, as `memplan optimize -o` writes them; None when
        nothing fits."""
        if self.chosen is None:
            return None
        step = self.options.step
        return StepChoice(
            step.model_file,
            self.batch,
            step.seq,
            step.dtype,
            tuple(zip(self.layers, self.chosen.assignment)),
            step.loss,
            step.optimizer,
            self.options.memory,
            self.chosen.peak_live,
            self.chosen.plan_arena,
            self.chosen.status,
            self.chosen.digest,
        )

    def summary(self) -> dict:
        return {
            "model_file": self.options.step.model_file,
            "memory": self.options.memory,
            "gpu": None if self.options.budget is None else self.options.budget.as_dict(),
            "batch": self.batch,
            "seq": self.options.step.seq,
            "dtype": self.options.step.dtype,
            "loss": self.options.step.loss,
            "optimizer": self.options.step.optimizer,
            "max_batch": self.options.max_batch,
            "capture": self.capture.name,
            "capture_reason": self.capture.reason,
            "layers": list(self.layers),
            "status": self.choice.status,
            "chosen": asdict(self.chosen) if self.chosen else None,
            "rejected": [asdict(c) for c in self.rejected],
            "uniform": [asdict(c) for c in self.uniform],
            "megatron": asdict(self.megatron) if self.megatron else None,
            "step_flops": self.step_flops,
            "seconds": round(self.seconds, 1),
        }


@dataclass
class Measured:
    """Everything measured at one batch size: the memory model, the layer costs, the traces."""

    batch: int
    terms: MemoryTerms
    cost: dict[tuple[int, str], Flops]
    step_flops: Flops
    traces: dict[Assignment, Trace]  # by assignment: those of terms.assignments_to_trace, and any traced since


def model_layers(opts: OptimizeOptions) -> tuple[str, ...]:
    """The model's Transformer layer paths, from a build under fake tensors (nothing allocated)."""
    step = opts.step.replace(batch=1, mode=AS_BUILT, device="cpu", fake=True)
    build = import_model_file(step.model_file)
    with recording_session(step.device, fake=True):
        return tuple(transformer_layers(build_workload(step, build).model))


def every_layer(layers: tuple[str, ...], mode: str) -> Assignment:
    """The assignment of `mode` to every layer."""
    return tuple(mode for _ in layers)


def step_of(opts: OptimizeOptions, layers: tuple[str, ...], assignment: Assignment, batch: int, fake: bool) -> StepSpec:
    """The step at `batch` with `assignment`'s mode for each layer."""
    return opts.step.replace(batch=batch, mode=dict(zip(layers, assignment)), fake=fake)


def measure_batch(opts: OptimizeOptions, layers: tuple[str, ...], batch: int, fake: bool, progress) -> Measured:
    """The model at `batch`: the traces of terms.assignments_to_trace, and one FLOP count per mode."""
    to_trace = assignments_to_trace(OPTIMIZE_MODES, len(layers))
    progress(f"[batch {batch}] tracing {len(to_trace)} assignments and counting the FLOPs of {len(OPTIMIZE_MODES)}")
    traces = {a: trace_step(step_of(opts, layers, a, batch, fake), progress=progress) for a in to_trace}
    flops = {m: count_step_flops(step_of(opts, layers, every_layer(layers, m), batch, fake)) for m in OPTIMIZE_MODES}
    cost = {
        (j, mode): flops[mode].by_module[path] - flops[AS_BUILT].by_module[path]
        for j, path in enumerate(layers)
        for mode in OPTIMIZE_MODES
    }
    return Measured(batch, memory_terms(traces, layers), cost, flops[AS_BUILT].total, traces)


def trace_candidate(
    opts: OptimizeOptions, layers, measured: Measured, candidate: Candidate, fake: bool, progress
) -> Candidate:
    """Trace `candidate` at the measured batch (unless it is uniform, already traced) and solve its plan."""
    trace = measured.traces.get(candidate.assignment)
    if trace is None:
        step = step_of(opts, layers, candidate.assignment, measured.batch, fake)
        progress(f"[batch {measured.batch}] tracing {candidate.name}: {step.mode_name}")
        trace = trace_step(step, progress=progress)
        measured.traces[candidate.assignment] = trace
    figures = measure(trace, candidate.name, time_limit=opts.time_limit).figures()
    candidate.peak_live, candidate.plan_arena, candidate.status = (
        figures["peak_live"],
        figures["plan_arena"],
        figures["status"],
    )
    candidate.fits = candidate.plan_arena <= opts.memory
    candidate.digest = trace_digest(trace)
    return candidate


def candidate(name: str, assignment: Assignment, measured: Measured) -> Candidate:
    """A candidate with its modelled figures."""
    return Candidate(name, assignment, recompute_of(assignment, measured.cost), measured.terms.peak(assignment))


def megatron_assignment(measured: Measured, memory: int) -> Assignment | None:
    """Megatron's recipe: the first k layers checkpointed whole, the rest as built, least k the model fits."""
    count = len(measured.terms.layers)
    for k in range(count + 1):
        assignment = tuple(MEGATRON_RECIPE if j < k else AS_BUILT for j in range(count))
        if measured.terms.peak(assignment) <= memory:
            return assignment
    return None


def choose_and_verify(opts, layers, measured: Measured, fake: bool, progress) -> tuple[Choice, Candidate | None, list]:
    """CP-SAT's choice at the measured batch, traced; a choice whose plan does not fit is cut and CP-SAT asked
    again, at most VERIFY_ROUNDS times."""
    rejected: list[Candidate] = []
    for _ in range(VERIFY_ROUNDS):
        choice = choose_modes(
            measured.terms, measured.cost, opts.memory, [c.assignment for c in rejected], opts.time_limit
        )
        if choice.assignment is None:
            return choice, None, rejected
        chosen = trace_candidate(
            opts, layers, measured, candidate("chosen", choice.assignment, measured), fake, progress
        )
        if chosen.fits:
            return choice, chosen, rejected
        progress(
            f"[batch {measured.batch}] the chosen modes' plan takes {human_bytes(chosen.plan_arena)}, "
            f"more than the model said: excluded, asking CP-SAT again"
        )
        rejected.append(chosen)
    return Choice(None, None, None, "unknown"), None, rejected


def largest_batch(opts, layers, fake, progress) -> Measured:
    """The largest batch at which the model has an assignment that fits: doubling, then bisection."""
    low, high = None, None  # largest batch known to fit by the model, least known not to
    batch, at = 1, {}
    while high is None or (low or 0) + 1 < high:
        at[batch] = measure_batch(opts, layers, batch, fake, progress)
        fits = choose_modes(at[batch].terms, at[batch].cost, opts.memory, (), opts.time_limit).assignment is not None
        low, high = (batch, high) if fits else (low, batch)
        if high is None and batch >= MAX_BATCH:
            break
        batch = batch * 2 if high is None else ((low or 0) + high) // 2
        if batch == 0:
            break
    if low is None:
        raise OptimizeError(nothing_fits(opts, at[1]))
    return at[low]


def nothing_fits(opts: OptimizeOptions, measured: Measured) -> str:
    """The one-line answer when no assignment fits: the least peak the model reaches at that batch."""
    least = min(measured.terms.peak(every_layer(measured.terms.layers, m)) for m in OPTIMIZE_MODES)
    return (
        f"no assignment of modes fits batch {measured.batch} in {human_bytes(opts.memory)} (proven within the "
        f"model by CP-SAT); the least any layer mode reaches on every layer is {human_bytes(least)}"
    )


def optimize(opts: OptimizeOptions, progress: Callable[[str], None] = lambda m: None) -> OptimizeResult:
    """Choose a mode per layer (and the batch with batch=None) for opts.memory; see the module docstring."""
    start = time.monotonic()
    # 1. The layers, and real or fake traces (auto: sized on a fake trace at batch 1 or the batch asked).
    layers = model_layers(opts)
    if not layers:
        raise OptimizeError(f"{opts.step.model_file}: no list of Transformer layers found to choose modes for")
    capture = sized_capture(opts.capture, opts.step.replace(batch=1) if opts.max_batch else opts.step, progress)
    progress(f"{len(layers)} layers; {capture.name} traces ({capture.reason})")
    # 2. The model at the batch asked, or at the largest batch it fits.
    if opts.max_batch:
        measured = largest_batch(opts, layers, capture.fake, progress)
    else:
        measured = measure_batch(opts, layers, opts.step.batch, capture.fake, progress)
    return answer(opts, layers, measured, capture, progress, start)


def answer(
    opts: OptimizeOptions,
    layers: tuple[str, ...],
    measured: Measured,
    capture: CaptureChoice,
    progress: Callable[[str], None],
    start: float,
) -> OptimizeResult:
    """Steps 3 and 4 of `optimize` on a measured model: CP-SAT's choice checked by its trace, and the
    alternatives (a benchmark asks for several memory sizes on one model)."""
    # 3. CP-SAT's choice, checked by its traced plan; a choice that does not fit is cut and CP-SAT asked again.
    choice, chosen, rejected = choose_and_verify(opts, layers, measured, capture.fake, progress)
    if choice.status == "infeasible" and not rejected:
        raise OptimizeError(nothing_fits(opts, measured))
    # 4. The alternatives: every layer in one mode, and Megatron's first k layers checkpointed.
    uniform = [
        trace_candidate(
            opts,
            layers,
            measured,
            candidate(f"every layer {m}", every_layer(layers, m), measured),
            capture.fake,
            progress,
        )
        for m in OPTIMIZE_MODES
    ]
    recipe = megatron_assignment(measured, opts.memory)
    megatron = None
    if recipe is not None:
        name = f"Megatron: first {recipe.count(MEGATRON_RECIPE)} {MEGATRON_RECIPE}"
        megatron = trace_candidate(opts, layers, measured, candidate(name, recipe, measured), capture.fake, progress)
    return OptimizeResult(
        opts,
        capture,
        measured.batch,
        layers,
        choice,
        chosen,
        rejected,
        uniform,
        megatron,
        measured.step_flops,
        time.monotonic() - start,
    )
