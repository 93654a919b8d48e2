"""`memplan optimize`: a mode per Transformer layer, the step's loss and optimizer (the actions), and with max_batch
the batch size, so the step fits a memory size with the least added step time, chosen by CP-SAT on a model measured
from traces, then checked by tracing the chosen configuration and solving its plan.

The memory model (planner/optimize/terms.py) comes from the traces of terms.assignments_to_trace (every layer in one
mode, and pairs of modes alternating; the rest of the model as built), and one trace per step-level action (the loss
fused, each optimizer choice) with every layer as built. The added time of a choice is its work at the step's rates
(planner/cost/rates.py): a layer mode's recompute FLOPs over its subtree (one count per mode), an offloading mode's
transfers over the host link, the fused loss's extra FLOPs, the host optimizer's copies and host step; 8-bit and
4-bit optimizer state are counted as adding none. Offloading modes and the host optimizer are offered only when the
host link is known (--gpu or --host-bandwidth). A choice whose traced plan does not fit is cut from the model and
CP-SAT asked again, so "optimal" means: no choice of less added time fits, by the model, and the answer's own plan
fits, measured.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from itertools import product

from memplan.errors import MemplanError, PatchError
from memplan.gpus import GPU
from memplan.modes import ADAMW_HOST, AS_BUILT, FULL, LOSSES, MODES, OPTIMIZE_MODES, OPTIMIZERS, mode
from memplan.planner.cost import count_step_flops
from memplan.planner.cost.measured import measured_times
from memplan.planner.cost.rates import Rates, step_rates
from memplan.planner.layers import transformer_layers
from memplan.planner.optimize.alike import alike_terms, layers_alike, walks_to_trace
from memplan.planner.optimize.choice_file import StepChoice
from memplan.planner.optimize.choose import Choice, Flops, choose_modes, families, recompute_of, work_of
from memplan.planner.optimize.terms import (
    Action,
    Assignment,
    MemoryTerms,
    action_deltas,
    assignments_to_trace,
    memory_terms,
)
from memplan.planner.simulate.caching_allocator import simulate_caching
from memplan.planner.simulate.measure import measure
from memplan.planner.simulate.verdict import Budget, device_memory, judged
from memplan.step import StepSpec
from memplan.traces.capture import recording_session
from memplan.traces.format import Trace, trace_digest
from memplan.traces.host import host_bytes
from memplan.traces.inputs.model_file import build_workload, import_model_file
from memplan.traces.inputs.trace_model import CaptureChoice, sized_capture, trace_step
from memplan.traces.summary import changes_model
from memplan.units import human_bytes

MEGATRON_RECIPE = FULL  # the mode Megatron's recipe checkpoints its first layers with

LOSS, OPTIMIZER = "loss", "optimizer"  # the families of step-level actions
OFFLOAD_MODES = tuple(name for name in MODES if mode(name).offloads and mode(name).per_layer)
MAX_BATCH = 4096  # --max-batch stops doubling here
VERIFY_ROUNDS = 5  # assignments traced before the job gives up on a batch


class OptimizeError(MemplanError):
    """An optimize request that cannot be answered (no layers, nothing fits, bad options)."""


@dataclass(frozen=True)
class OptimizeOptions:
    """What to optimize: the step (its model file and shape; the modes are chosen here), the memory size (or a
    GPU), whether the batch and the actions are chosen too, the host link, and the solvers' time."""

    step: StepSpec
    memory: int | None = None  # bytes the step's plan must fit in; with `gpu`, set here from its budget
    max_batch: bool = False  # choose the largest batch that fits too (--max-batch); else the step's batch
    capture: str = "auto"  # real or fake traces: auto, real, fake
    time_limit: float = 10.0  # CP-SAT's per choice, and the plan solver's per trace
    gpu: GPU | None = None  # instead of `memory`: the GPU's memory less what it holds outside the allocator
    actions: bool = True  # offer the actions beyond the layer modes the step does not fix: its loss, its
    #                       optimizer, and (with a host link) the offloading modes
    host_bandwidth: int | None = None  # bytes/s one way over the host link (else the GPU's, with `gpu`)
    modes: tuple[str, ...] | None = None  # the layer modes offered (None: OPTIMIZE_MODES, and with actions and a
    #                                        host link the offloading modes)
    alike: bool = True  # where the layers are alike, measure their contexts on walks (alike.py); False: every
    #                     context at every layer (M² traces of M modes)
    budget: Budget | None = field(default=None, init=False)  # the GPU's, when given

    def __post_init__(self) -> None:
        # a CUDA step on that GPU (fake CUDA traces where this machine has none)
        object.__setattr__(self, "step", self.step.on_gpu(self.gpu))
        offloading = [name for name in self.modes or () if mode(name).offloads]
        if offloading and self.gpu is None and self.host_bandwidth is None:
            reason = needs_host_link("an offloading mode's")
            raise OptimizeError(f"--modes {', '.join(offloading)}: {reason}")
        memory, budget = device_memory(self.memory, self.gpu, self.step)
        object.__setattr__(self, "memory", memory)
        object.__setattr__(self, "budget", budget)


@dataclass
class Candidate:
    """One assignment, modelled and (when traced) measured."""

    name: str  # "chosen", "every layer tempo", "Megatron: first 2 full"
    assignment: Assignment
    recompute: Flops  # the layers' added work over every layer as built (recompute FLOPs, transfers at the rate)
    predicted_peak: int  # the model's peak live bytes (aligned)
    actions: tuple[Action, ...] = ()  # the step-level actions (none: the step's own loss and optimizer)
    work: Flops = 0  # the layers' and the actions' added work, FLOPs at the rate
    added_seconds: float = 0.0  # that work in seconds at the rate
    peak_live: int | None = None  # of its trace, when traced (its Measurement's figures)
    plan_arena: int | None = None  # of its plan, when traced
    status: str | None = None  # its plan's proof, when traced
    fits: bool | None = None  # plan arena <= the memory size (and, with a GPU, caching_fits), when traced
    caching_reserved: int | None = None  # with a GPU: its whole program's peak reserved on the caching allocator
    caching_fits: bool | None = None  # with a GPU: the caching allocator serves its whole program on the GPU
    digest: str | None = None  # its trace's digest (traces.format.trace_digest), when traced
    host_moved: int | None = None  # bytes its offloading layers moved each way, when traced and any offload


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
    rates: Rates | None = None  # what the added work was timed at
    notes: list[str] = field(default_factory=list)  # actions not offered, and why
    pricing: dict | None = None  # the modes priced at step times measured on the GPU (`measured_pricing`); None: FLOPs

    def step_choice(self) -> StepChoice | None:
        """The chosen actions with their verified figures, as `memplan optimize -o` writes them; None when
        nothing fits."""
        if self.chosen is None:
            return None
        step = self.options.step
        actions = dict(self.chosen.actions)
        return StepChoice(
            step.model_file,
            self.batch,
            step.seq,
            step.dtype,
            tuple(zip(self.layers, self.chosen.assignment)),
            actions.get(LOSS, step.loss),
            actions.get(OPTIMIZER, step.optimizer),
            self.options.memory,
            self.chosen.peak_live,
            self.chosen.plan_arena,
            self.chosen.status,
            self.chosen.digest,
        )

    def gap_seconds(self) -> float | None:
        """How much less time a choice that fits the model might add than CP-SAT's answer (0 when proven optimal);
        None with no answer."""
        choice = self.choice
        if choice.work is None or choice.least_work is None or self.rates is None:
            return None
        return (choice.work - choice.least_work) / self.rates.flops

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
            "gap_seconds": self.gap_seconds(),
            "actions": self.options.actions,
            "chosen": asdict(self.chosen) if self.chosen else None,
            "rejected": [asdict(c) for c in self.rejected],
            "uniform": [asdict(c) for c in self.uniform],
            "megatron": asdict(self.megatron) if self.megatron else None,
            "step_flops": self.step_flops,
            "rates": None if self.rates is None else self.rates.to_dict(),
            "pricing": self.pricing,
            "notes": self.notes,
            "seconds": round(self.seconds, 1),
        }


@dataclass
class Measured:
    """Everything measured at one batch size: the memory model, the costs, the traces."""

    batch: int
    terms: MemoryTerms  # with the offered actions' deltas
    cost: dict[tuple[int, str], Flops]  # a layer's added work in a mode: recompute FLOPs, transfers at the rate
    step_flops: Flops
    traces: dict[tuple[Assignment, tuple[Action, ...]], Trace]  # the traces taken, by assignment and actions
    rates: Rates
    action_cost: dict[Action, Flops] = field(default_factory=dict)  # each offered action's added work
    notes: list[str] = field(default_factory=list)  # actions not offered, and why
    pricing: dict | None = None  # the modes priced at measured step times (`measured_pricing`); None: FLOPs only


def model_layers(opts: OptimizeOptions) -> tuple[str, ...]:
    """The model's Transformer layer paths, from a build under fake tensors (nothing allocated)."""
    step = opts.step.replace(batch=1, mode=AS_BUILT, device="cpu", fake=True)
    build = import_model_file(step.model_file)
    with recording_session(step.device, fake=True):
        return tuple(transformer_layers(build_workload(step, build).model))


def every_layer(layers: tuple[str, ...], mode: str) -> Assignment:
    """The assignment of `mode` to every layer."""
    return tuple(mode for _ in layers)


def step_of(
    opts: OptimizeOptions, layers: tuple[str, ...], assignment: Assignment, batch: int, fake: bool, actions=()
) -> StepSpec:
    """The step at `batch` with `assignment`'s mode for each layer and the step-level `actions`."""
    chosen = dict(actions)
    return opts.step.replace(
        batch=batch,
        mode=dict(zip(layers, assignment)),
        fake=fake,
        loss=chosen.get(LOSS, opts.step.loss),
        optimizer=chosen.get(OPTIMIZER, opts.step.optimizer),
    )


def needs_host_link(whose: str) -> str:
    """Why a choice that moves bytes to the host is not offered: `whose` cost is the host link's, unknown."""
    return f"{whose} cost is the host link's; name a GPU (--gpu) or give --host-bandwidth"


def offered_modes(opts: OptimizeOptions, rates: Rates) -> tuple[tuple[str, ...], list[str]]:
    """The layer modes offered, and a note when the offloading modes are left out for want of a host link."""
    if opts.modes is not None:
        return opts.modes, []
    if not opts.actions:
        return OPTIMIZE_MODES, []
    if rates.host_bandwidth is None:
        return OPTIMIZE_MODES, [f"{', '.join(OFFLOAD_MODES)} not offered: {needs_host_link('their')}"]
    return OPTIMIZE_MODES + OFFLOAD_MODES, []


def work(seconds: float, rates: Rates) -> Flops:
    """`seconds` of added time as work: FLOPs at the rate, rounded up."""
    return math.ceil(seconds * rates.flops)


def layer_costs(layers, modes, flops, traces, rates: Rates) -> dict[tuple[int, str], Flops]:
    """Each layer's added work in each mode: the FLOPs its subtree runs more than as built, and an offloading mode's
    host copies to the host and back at the link's rate (the
    bytes its uniform trace's host meta gives the layer)."""
    cost = {}
    for name in modes:
        moved: dict[str, int] = {}
        host = host_bytes(traces[every_layer(layers, name), ()]) if mode(name).offloads else None
        for size, module in zip(host.size.tolist(), host.module) if host is not None else ():
            moved[module] = moved.get(module, 0) + int(size)
        for j, path in enumerate(layers):
            recompute = flops[name].by_module[path] - flops[AS_BUILT].by_module[path]
            transfer = work(rates.transfer_seconds(moved.get(path, 0)), rates) if moved else 0
            cost[j, name] = recompute + transfer
    return cost


def measured_pricing(opts, layers, batch: int, trace: Trace, modes, cost, rates: Rates) -> dict | None:
    """Where the step's GPU has step times measured for this model and shape (planner/cost/measured.py), each
    measured mode's layers priced at the seconds it added a layer over the measurement's baseline (none when it
    was faster) instead of their FLOPs, `cost` changed in place; what was used, or None (FLOPs throughout)."""
    gpu = opts.step.gpu
    times = measured_times(gpu and gpu.name, trace.meta.get("model"), opts.step.seq, batch, opts.step.dtype)
    if times is None:
        return None
    priced = {}
    for name in modes:
        added = times.added_per_layer(name, len(layers))
        if added is not None and name != AS_BUILT:
            priced[name] = added
            for j in range(len(layers)):
                cost[j, name] = work(max(0.0, added), rates)
    return {"label": times.label(), "measurement": times.as_dict(), "added_per_layer": priced} if priced else None


def offered_actions(opts: OptimizeOptions, rates: Rates) -> tuple[list[Action], list[str]]:
    """The step-level actions offered: the losses and optimizer choices the step does not fix (the host optimizer
    only with a host link); with notes for those left out."""
    if not opts.actions:
        return [], []
    actions, notes = [], []
    if opts.step.loss == AS_BUILT:
        actions += [(LOSS, name) for name in LOSSES if name != AS_BUILT]
    if opts.step.optimizer == AS_BUILT:
        for name in OPTIMIZERS:
            if name == ADAMW_HOST and rates.host_bandwidth is None:
                notes.append(f"optimizer {name} not offered: {needs_host_link('its')}")
            elif name != AS_BUILT:
                actions.append((OPTIMIZER, name))
    return actions, notes


def action_work(action: Action, trace: Trace, step: StepSpec, base_flops: Flops, rates: Rates) -> Flops:
    """An action's added work: the fused loss's extra FLOPs (none when it counts fewer), the host optimizer's
    copies (gradients down, parameters up) and host step at the rates; 8-bit and 4-bit state count none."""
    family, name = action
    if family == LOSS:
        return max(0, count_step_flops(step).total - base_flops)
    if name != ADAMW_HOST:
        return 0
    state = trace.meta["optimizer_state"]
    return work(rates.host_optimizer_seconds(state["elements"], state["parameter_bytes"]), rates)


def measure_actions(opts, layers, measured: Measured, fake: bool, progress, earlier: Measured | None = None) -> None:
    """Each offered action traced alone with every layer as built: its per-segment delta on the step's own trace
    and its added work go into `measured`; an action that cannot apply or changes nothing gets a note instead. An
    optimizer choice measured at an `earlier` batch is taken from it: its state and step are the parameters', the
    same at every batch (and its trace the slowest of all under fake tensors)."""
    offered, notes = offered_actions(opts, measured.rates)
    measured.notes += notes
    base = measured.traces[every_layer(layers, AS_BUILT), ()]
    alike = earlier is not None and set(earlier.terms.segments) == set(measured.terms.segments)
    deltas = {}
    for action in offered:
        known = alike and action[0] == OPTIMIZER
        if known and action in earlier.action_cost:
            deltas[action], measured.action_cost[action] = earlier.terms.deltas[action], earlier.action_cost[action]
            continue
        if known:
            measured.notes += [note for note in earlier.notes if note.startswith(f"{action[0]} {action[1]} ")]
            continue
        step = step_of(opts, layers, every_layer(layers, AS_BUILT), measured.batch, fake, (action,))
        progress(f"[batch {measured.batch}] tracing {action[0]} {action[1]} with every layer as built")
        try:
            trace = trace_step(step, progress=progress)
        except PatchError as e:
            measured.notes.append(f"{action[0]} {action[1]} not offered: {e}")
            continue
        if not changes_model(trace):
            measured.notes.append(f"{action[0]} {action[1]} not offered: it changes nothing in this model")
            continue
        measured.traces[every_layer(layers, AS_BUILT), (action,)] = trace
        deltas[action] = action_deltas(base, trace, layers)
        measured.action_cost[action] = action_work(action, trace, step, measured.step_flops, measured.rates)
    measured.terms = measured.terms.with_deltas(deltas)


def measure_batch(
    opts: OptimizeOptions, layers: tuple[str, ...], batch: int, fake: bool, progress, earlier: Measured | None = None
) -> Measured:
    """The model at `batch`: every layer in each offered mode, then walks through the modes where the layers are
    alike (alike.py) or else the alternating pairs of terms.assignments_to_trace; one FLOP count per mode; and each
    offered action's trace (an optimizer choice's from an `earlier` batch's measurement, if any)."""
    rates = step_rates(opts.step.dtype, opts.step.gpu, opts.host_bandwidth)
    modes, notes = offered_modes(opts, rates)
    traces: dict[tuple[Assignment, tuple[Action, ...]], Trace] = {}  # every trace taken, by assignment and actions

    def trace_all(assignments: list[Assignment], what: str) -> dict[Assignment, Trace]:
        progress(f"[batch {batch}] tracing {len(assignments)} assignments: {what}")
        traced = {a: trace_step(step_of(opts, layers, a, batch, fake), progress=progress) for a in assignments}
        traces.update({(a, ()): trace for a, trace in traced.items()})
        return traced

    # 1. Every layer in each mode (as-built too: the actions' deltas are taken against it).
    uniform = trace_all([every_layer(layers, m) for m in dict.fromkeys([*modes, AS_BUILT])], "every layer in a mode")
    offered = {a: trace for a, trace in uniform.items() if set(a) <= set(modes)}
    # 2. The contexts of distinct modes: walks where the layers are alike and walks are fewer, else alternating pairs.
    pairs = [a for a in assignments_to_trace(modes, len(layers)) if len(set(a)) > 1]
    walks = walks_to_trace(modes, len(layers)) if opts.alike else None
    if walks is not None and len(walks) < len(pairs) and layers_alike(offered, layers):
        notes.append(f"the layers are alike: {len(walks)} walks through the modes traced for their contexts, "
                     f"not {len(pairs)} alternating pairs")  # fmt: skip
        terms = alike_terms({**offered, **trace_all(walks, "walks through the modes")}, layers)
    else:
        terms = memory_terms({**offered, **trace_all(pairs, "pairs of modes alternating")}, layers)
    # 3. The FLOPs of each mode, and the actions.
    counted = tuple(dict.fromkeys([AS_BUILT, *modes]))
    progress(f"[batch {batch}] counting the FLOPs of {len(counted)} modes")
    flops = {m: count_step_flops(step_of(opts, layers, every_layer(layers, m), batch, fake)) for m in counted}
    cost = layer_costs(layers, modes, flops, traces, rates)
    pricing = measured_pricing(opts, layers, batch, uniform[every_layer(layers, AS_BUILT)], modes, cost, rates)
    measured = Measured(batch, terms, cost, flops[AS_BUILT].total, traces, rates, notes=notes, pricing=pricing)
    measure_actions(opts, layers, measured, fake, progress, earlier)
    return measured


def trace_candidate(
    opts: OptimizeOptions, layers, measured: Measured, candidate: Candidate, fake: bool, progress
) -> Candidate:
    """Trace `candidate` at the measured batch (unless it is traced already) and solve its plan."""
    key = (candidate.assignment, candidate.actions)
    trace = measured.traces.get(key)
    if trace is None:
        step = step_of(opts, layers, candidate.assignment, measured.batch, fake, candidate.actions)
        progress(f"[batch {measured.batch}] tracing {candidate.name}: {step.mode_name}{describe(candidate.actions)}")
        trace = trace_step(step, progress=progress)
        measured.traces[key] = trace
    figures = measure(trace, candidate.name, time_limit=opts.time_limit).figures()
    candidate.peak_live, candidate.plan_arena, candidate.status = (
        figures["peak_live"],
        figures["plan_arena"],
        figures["status"],
    )
    candidate.fits = candidate.plan_arena <= opts.memory
    if opts.budget is not None:  # the GPU runs it with PyTorch's caching allocator: its whole program must run
        program = judged(trace)
        candidate.caching_reserved = simulate_caching(program).peak_reserved
        fits = candidate.caching_reserved <= opts.memory or simulate_caching(program, capacity=opts.memory).oom is None
        candidate.caching_fits = fits
        candidate.fits = candidate.fits and fits
    candidate.digest = trace_digest(trace)
    host = host_bytes(trace)
    candidate.host_moved = None if host is None else host.moved
    return candidate


def describe(actions: tuple[Action, ...]) -> str:
    """The actions in words after a mode's name: `, loss fused, optimizer adamw-8bit` (empty for none)."""
    return "".join(f", {family} {name}" for family, name in actions)


def candidate(name: str, assignment: Assignment, measured: Measured, actions: tuple[Action, ...] = ()) -> Candidate:
    """A candidate with its modelled figures."""
    added = work_of(assignment, actions, measured.cost, measured.action_cost)
    return Candidate(
        name,
        assignment,
        recompute_of(assignment, measured.cost),
        measured.terms.peak(assignment, actions),
        actions,
        added,
        added / measured.rates.flops,
    )


def megatron_assignment(measured: Measured, memory: int) -> Assignment | None:
    """Megatron's recipe: the first k layers checkpointed whole, the rest as built, least k the model fits."""
    count = len(measured.terms.layers)
    for k in range(count + 1):
        assignment = tuple(MEGATRON_RECIPE if j < k else AS_BUILT for j in range(count))
        if measured.terms.peak(assignment) <= memory:
            return assignment
    return None


def combinations(measured: Measured) -> list[tuple[Action, ...]]:
    """Every combination of the offered actions: none or one of each family."""
    grouped = families(measured.action_cost).values()
    return [tuple(a for a in pick if a is not None) for pick in product(*[[None, *g] for g in grouped])]


def uniform_hint(measured: Measured, memory: int, excluded=()) -> tuple[Assignment, tuple[Action, ...]] | None:
    """The uniform choice (every layer in one mode, a combination of actions) of least added work that the model
    fits in `memory`, other than `excluded`; None when none does."""
    layers, fitting = measured.terms.layers, []
    for name in measured.terms.modes:
        for actions in combinations(measured):
            choice = (every_layer(layers, name), actions)
            if choice not in excluded and measured.terms.peak(*choice) <= memory:
                fitting.append((work_of(*choice, measured.cost, measured.action_cost), choice))
    return min(fitting)[1] if fitting else None


def choose(measured: Measured, memory: int, excluded=(), time_limit: float = 10.0) -> Choice:
    """CP-SAT's choice on the measured model, started from the best uniform choice that fits."""
    hint = uniform_hint(measured, memory, list(excluded))
    terms, cost, actions = measured.terms, measured.cost, measured.action_cost
    return choose_modes(terms, cost, memory, excluded, time_limit, actions, hint)


def choose_and_verify(opts, layers, measured: Measured, fake: bool, progress) -> tuple[Choice, Candidate | None, list]:
    """CP-SAT's choice at the measured batch, traced; a choice whose plan does not fit is cut and CP-SAT asked
    again, for the memory less the most a cut plan took beyond the model's peak, at most VERIFY_ROUNDS times."""
    rejected: list[Candidate] = []
    for _ in range(VERIFY_ROUNDS):
        # a plan packs the peak's buffers with some room left over: the most a rejected one needed beyond the
        # model's peak is asked of the rest too, so near the memory CP-SAT does not offer its neighbours one by one
        margin = max([max(c.plan_arena, c.caching_reserved or 0) - c.predicted_peak for c in rejected] + [0])
        excluded = [(c.assignment, c.actions) for c in rejected]
        choice = choose(measured, opts.memory - margin, excluded, opts.time_limit)
        if choice.assignment is None:
            return choice, None, rejected
        chosen = trace_candidate(
            opts, layers, measured, candidate("chosen", choice.assignment, measured, choice.actions), fake, progress
        )
        if chosen.fits:
            return choice, chosen, rejected
        needs = f"plan takes {human_bytes(chosen.plan_arena)}"
        if chosen.caching_fits is False:
            needs = (
                f"program does not run on the caching allocator (it reserves {human_bytes(chosen.caching_reserved)})"
            )
        progress(f"[batch {measured.batch}] the chosen modes' {needs}, more than the model said: excluded, asking "
                 "CP-SAT again")  # fmt: skip
        rejected.append(chosen)
    return Choice(None, None, None, "unknown"), None, rejected


def largest_batch(opts, layers, fake, progress) -> Measured:
    """The largest batch at which the model has a choice that fits: doubling, then bisection."""
    low, high = None, None  # largest batch known to fit by the model, least known not to
    batch, at, status = 1, {}, {}
    while high is None or (low or 0) + 1 < high:
        at[batch] = measure_batch(opts, layers, batch, fake, progress, earlier=next(iter(at.values()), None))
        status[batch] = choose(at[batch], opts.memory, (), opts.time_limit).status
        fits = status[batch] in ("optimal", "feasible")
        low, high = (batch, high) if fits else (low, batch)
        if high is None and batch >= MAX_BATCH:
            break
        batch = batch * 2 if high is None else ((low or 0) + high) // 2
        if batch == 0:
            break
    if low is None:
        raise OptimizeError(nothing_fits(opts, at[1], status[1]))
    return at[low]


def least_peak(measured: Measured) -> int:
    """The least peak the model reaches with every layer in one mode, under any combination of the actions."""
    layers, terms = measured.terms.layers, measured.terms
    return min(terms.peak(every_layer(layers, m), c) for m in terms.modes for c in combinations(measured))


def nothing_fits(opts: OptimizeOptions, measured: Measured, status: str = "infeasible") -> str:
    """The one-line answer when nothing fits (CP-SAT proved it, or found nothing in its time): the least peak the
    model reaches at that batch."""
    proof = "proven within the model by CP-SAT" if status == "infeasible" else "CP-SAT found none in --time-limit"
    return (
        f"no assignment of modes{' and actions' if measured.action_cost else ''} fits batch {measured.batch} in "
        f"{human_bytes(opts.memory)} ({proof}); the least any layer mode reaches on every layer is "
        f"{human_bytes(least_peak(measured))}"
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
    if choice.status in ("infeasible", "unknown") and not rejected:
        raise OptimizeError(nothing_fits(opts, measured, choice.status))
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
        for m in measured.terms.modes
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
        measured.rates,
        measured.notes,
        measured.pricing,
    )
