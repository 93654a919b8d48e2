"""memplan's public API: each function is a docstring and a line or two over the stages that do the work.

    import memplan
    trace = memplan.trace_model_file("examples/gpt2.py", layers="tempo", batch=2, seq=128)
    plan = memplan.solve(trace, time_limit=5)      # verified before it is returned
    print(memplan.simulate(trace, plan=plan).bound, plan.arena)

`memplan.record` records one step of your own training loop instead of a model file.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

from torch import nn

from memplan import __all__ as PUBLIC_API
from memplan.errors import MemplanError, PatchError, PlanError, TraceError
from memplan.gpus import GPU, GPUS, gpu
from memplan.limits import MAX_PARAMETERS, short_repr
from memplan.modes import AS_BUILT, MODES, SWEPT_MODES
from memplan.planner.jobs.fit import FitResult, fit_model
from memplan.planner.jobs.optimize import OptimizeOptions, OptimizeResult
from memplan.planner.jobs.optimize import optimize as optimize_job
from memplan.planner.jobs.run import DEFAULT_MODEL, RunOptions, RunResult
from memplan.planner.jobs.run import run as run_job
from memplan.planner.jobs.tradeoff import TradeoffOptions, TradeoffResult
from memplan.planner.jobs.tradeoff import tradeoff as tradeoff_job
from memplan.planner.layers import patch, transformer_layers, unpatch
from memplan.planner.optimize.apply import apply_choice
from memplan.planner.optimize.choice_file import StepChoice, load_choice, save_choice
from memplan.planner.plan import Plan, check_plan, load_plan, plan_problem
from memplan.planner.plan import save_plan as save_checked_plan
from memplan.planner.problem import problem_from_trace
from memplan.planner.report.compare import CompareRow, compare_traces
from memplan.planner.report.plots import PlotError, plot_reports
from memplan.planner.simulate.alloc_conf import AllocConfError
from memplan.planner.simulate.measure import Measurement, measure, simulate_trace
from memplan.planner.simulate.plan_footprint import match_plans
from memplan.planner.simulate.snapshot_export import make_snapshot, write_snapshot
from memplan.planner.simulate.verdict import Verdict, require_memory_or_gpu
from memplan.routing import DEFAULT as DEFAULT_ROUTING
from memplan.solvers import solve as solve_problem
from memplan.step import StepSpec, require_fake_for_routing
from memplan.traces.capture import Recording, record
from memplan.traces.format import Trace, load, save
from memplan.traces.inputs.snapshot import import_snapshot
from memplan.traces.inputs.trace_model import trace_step
from memplan.units import SizeError, parse_size

__all__ = PUBLIC_API  # the one list, in __init__.py (which loads this module on first use)

PathLike = str | os.PathLike
GPULike = str | GPU  # a GPU of the catalogue by name (memplan.gpu), or a GPU object
STEP_OPTIONS = {field.name for field in dataclasses.fields(StepSpec)} - {"model_file"}


def load_trace(path: PathLike) -> Trace:
    """Read a memplan-trace/1 file (.json or .json.gz); TraceError names what is wrong with a bad one."""
    return load(as_path(path, "trace file", TraceError))


def save_trace(trace: Trace, path: PathLike) -> None:
    """Write `trace` atomically (gzipped when the name ends in .gz)."""
    save(as_trace(trace), as_path(path, "trace file", TraceError))


def trace_model_file(
    path: PathLike,
    *,
    layers: str | Mapping[str, str] = AS_BUILT,
    batch: int = 2,
    seq: int = 128,
    dtype: str = "float32",
    device: str = "cpu",
    fake: bool = False,
    compile: float | None = None,
    warmup: bool = True,
    loss: str = AS_BUILT,
    routing: str = DEFAULT_ROUTING,
    optimizer: str = AS_BUILT,
    torch: str | None = None,
    max_parameters: int = MAX_PARAMETERS,
) -> Trace:
    """One training step of a model file (docs/capture.md) with memplan's `layers` mode (or a mode per
    Transformer layer: {"layers.0": "full", ...}), as `memplan trace` records it; `fake` runs it under fake
    tensors (any size, nothing allocated; a mixture of experts routes its tokens by `routing`: balanced, worst or
    loads=W0,W1,...); `compile` under torch.compile at that activation memory budget; `warmup=False` records the
    first step (the optimizer creates its state inside it), not the steady one; `loss="fused"` computes a causal
    LM's loss fused with its head, the logits never whole; `optimizer` rebuilds the model file's AdamW with smaller
    state (memplan.modes.OPTIMIZERS: adamw-8bit, adamw-4bit, adamw-host); `torch` ("2.11") the torch a fake CUDA
    step will run on (its attention and cuBLAS rules; default the installed one); a HuggingFace config's model may
    have at most `max_parameters` parameters (LimitError past it)."""
    require_fake_for_routing(routing, fake)
    step = StepSpec(path, batch, seq, dtype, device, layers, fake, compile, warmup, loss=loss, routing=routing,
                    optimizer=optimizer, torch=torch, max_parameters=max_parameters)  # fmt: skip
    return trace_step(step)


def solve(
    trace: Trace,
    *,
    time_limit: float = 10.0,
    method: str = "auto",
    capacity: int | None = None,
    scope: str = "all",
    alignment: int = 512,
) -> Plan:
    """Offsets for every buffer of `trace` (or only the step's own with scope="step"), with the lower bound
    and proof status; the plan has passed the independent verifier."""
    problem = problem_from_trace(as_trace(trace), alignment=as_count(alignment, "--alignment"), scope=scope)
    return solve_problem(
        problem, method=method, time_limit=as_seconds(time_limit), capacity=as_size(capacity, "--capacity")
    )


def verify(plan: Plan, trace: Trace) -> None:
    """PlanError unless `plan` was made for `trace` and no two buffers that may be live together share bytes."""
    trace = as_trace(trace)
    plan = as_plan(plan, trace, optional=False)
    check_plan(plan, plan_problem(plan, trace))


def save_plan(plan: Plan, trace: Trace, path: PathLike) -> None:
    """Verify `plan` against `trace`, then write it (memplan-plan/1 JSON)."""
    trace = as_trace(trace)
    plan = as_plan(plan, trace, optional=False)
    save_checked_plan(plan, plan_problem(plan, trace), as_path(path, "plan file", PlanError))


def simulate(
    trace: Trace,
    *,
    plan: Plan | None = None,
    alloc_conf: str = "",
    capacity: int | None = None,
    gpu: GPULike | None = None,
) -> Measurement:
    """`trace` on PyTorch's caching allocator (with PYTORCH_CUDA_ALLOC_CONF `alloc_conf` and a device
    `capacity`) and, when given, on `plan`: bound, peaks, fragmentation, as `memplan simulate` prints; with
    `gpu`, its `verdict`: whether the step fits that GPU, or where it runs out of memory. `trace` and `plan` may be
    their files' paths; `capacity` a size as the command line takes it (16GiB, or bytes)."""
    trace = as_trace(trace)
    plan = as_plan(plan, trace)
    return simulate_trace(trace, "trace", plan=plan, plan_name="plan" if plan else None,
                          alloc_conf=as_alloc_conf(alloc_conf), capacity=as_size(capacity, "--capacity"),
                          gpu=as_gpu(gpu))  # fmt: skip


def export_snapshot(
    trace: Trace, path: PathLike | None = None, *, plan: Plan | None = None, alloc_conf: str = ""
) -> dict:
    """`trace` as a PyTorch memory snapshot (`memplan export`): the dict torch.cuda._memory_viz takes, with the
    simulated caching allocator's addresses (or `plan`'s, checked against the trace), written to `path` (.pickle)
    for pytorch.org/memory_viz when given."""
    trace = as_trace(trace)
    snapshot = make_snapshot(trace, as_plan(plan, trace), alloc_conf=as_alloc_conf(alloc_conf))
    if path is not None:
        write_snapshot(snapshot, as_path(path, "snapshot file", TraceError))
    return snapshot


def plot(traces: Sequence[Trace], output: PathLike, *, plans: Sequence[Plan] = (), address_space: bool = False) -> None:
    """Memory over time of `traces` side by side (and each plan's address space), written to .png or .svg."""
    named = [(f"trace {i}", as_trace(t)) for i, t in enumerate(as_list(traces, "traces", TraceError))]
    given = match_plans(named, [(f"plan {i}", as_plan(p)) for i, p in enumerate(as_list(plans, "plans", PlanError))])
    reports = [
        simulate_trace(trace, name, plan=match[1] if match else None, plan_name=match[0] if match else None)
        for (name, trace), match in zip(named, given)
    ]
    plot_reports(reports, as_path(output, "figure", PlotError), address_space=address_space)


def compare(traces: Sequence[Trace], *, plans: Sequence[Plan] = (), time_limit: float = 5.0) -> list[CompareRow]:
    """One row per trace: peak live bytes by category, caching allocator reserved, plan arena, bound."""
    named = [(f"trace {i}", as_trace(t)) for i, t in enumerate(as_list(traces, "traces", TraceError))]
    given = [(f"plan {i}", as_plan(p)) for i, p in enumerate(as_list(plans, "plans", PlanError))]
    return compare_traces(named, given, time_limit=as_seconds(time_limit))


def fit(
    model_file: PathLike,
    memory: int | None = None,
    *,
    gpu: GPULike | None = None,
    layers: Sequence[str] = SWEPT_MODES,
    seq: int = 128,
    dtype: str = "float32",
    capture: str = "auto",
    loss: str = AS_BUILT,
    routing: str = DEFAULT_ROUTING,
    optimizer: str = AS_BUILT,
    nproc: int | None = None,
    every_rank: bool = False,
    torch: str | None = None,
    max_parameters: int = MAX_PARAMETERS,
) -> FitResult:
    """The largest batch of `model_file` whose step fits `memory` bytes (or `gpu`: its memory less what it holds
    outside the caching allocator) under each layer mode (with the step's `loss` and `optimizer`), under the caching
    allocator and under a plan, each proven by direct traces (real or fake, as `capture` says; fake ones route a
    mixture of experts by `routing`). With `nproc`, a distributed model file on that many ranks: a batch fits only
    where it fits on every rank (`every_rank`: each traced, even those alike by construction). `torch` ("2.11"): the
    torch the step will run on, whose rules a fake CUDA step and the budget follow (default the installed one)."""
    require_fake_for_routing(routing, capture != "real")
    step = StepSpec(model_file, seq=seq, dtype=dtype, loss=loss, routing=routing, optimizer=optimizer, torch=torch,
                    max_parameters=max_parameters)  # fmt: skip
    modes = (layers,) if isinstance(layers, str) else tuple(as_list(layers, "layers", PatchError))
    memory, gpu = as_size(memory, "--memory"), as_gpu(gpu)
    require_memory_or_gpu(memory, gpu)
    return fit_model(step, memory, gpu=gpu, modes=modes, capture=capture, nproc=nproc, every_rank=every_rank)


def tradeoff(model_file: PathLike, **options) -> TradeoffResult:
    """Memory against extra compute (`memplan tradeoff`) for every layer mode and torch.compile budget, the
    Pareto frontiers marked; TradeoffOptions names the options (budgets, batch, seq, output, ...)."""
    step, rest = split_step(model_file, options)
    return tradeoff_job(TradeoffOptions(step, **rest))


def optimize(
    model_file: PathLike, memory: int | None = None, *, gpu: GPULike | None = None, **options
) -> OptimizeResult:
    """A mode per Transformer layer, and the loss and optimizer (`memplan optimize`), so the step's plan fits
    `memory` bytes (or `gpu`: its memory less what it holds outside the caching allocator) with the least added step
    time, proven within the model by CP-SAT and checked by a trace; OptimizeOptions names the options (batch=None
    chooses the largest batch too; actions=False keeps to the layer modes).
    `result.step_choice()` is the answer, for `save_choice` and `apply`."""
    choose_batch = "batch" in options and options["batch"] is None
    step, rest = split_step(model_file, {**options, "batch": 1} if choose_batch else options)
    max_batch = rest.pop("max_batch", False) or choose_batch
    memory, gpu = as_size(memory, "--memory"), as_gpu(gpu)
    require_memory_or_gpu(memory, gpu)
    return optimize_job(OptimizeOptions(step, memory, max_batch=max_batch, gpu=gpu, **rest))


def apply(model: nn.Module, optimizer: object, choice: PathLike | StepChoice, *, loss: object = None) -> tuple:
    """Put a choice (`memplan optimize -o FILE`, or a StepChoice) on your own model in place: its mode per
    Transformer layer and its loss (`loss`: the one you train on where it is not the model's own, as a model file's
    `loss`), and your optimizer rebuilt as its optimizer choice. Returns (model, optimizer) to train with;
    ChoiceError where the choice is not this model's."""
    return apply_choice(model, optimizer, choice if isinstance(choice, StepChoice) else load_choice(choice), loss)


def run(model_file: PathLike | None = None, output: PathLike = "memplan-out", **options) -> RunResult:
    """The main job (`memplan run`): every layer mode traced, solved, simulated, the tempo plan replayed,
    and report.md with two pictures in `output` (with gpu=, each mode's verdict on it; with nproc=, each distinct
    rank's row per mode); RunOptions names the other options."""
    step, rest = split_step(model_file or DEFAULT_MODEL, options)
    return run_job(RunOptions(step, str(output), **{**rest, "gpu": as_gpu(rest.get("gpu"))}))


class ArgumentError(MemplanError):
    """An argument of the Python API that the command line would refuse too (a time limit of 0, a count of -1)."""


def as_gpu(value: GPULike | None) -> GPU | None:
    """A GPU given by name (looked up in the catalogue: GPUError for an unknown or empty name, or anything not a name)
    or as itself; None stays None."""
    return value if value is None or isinstance(value, GPU) else gpu(value)


def as_path(value, what: str, error: type[MemplanError]) -> PathLike:
    """`value` if it names a file (a str or os.PathLike); `error` otherwise."""
    if not isinstance(value, (str, os.PathLike)):
        raise error(f"{what}: expected a path (a str or os.PathLike), got {type(value).__name__}")
    return value


def as_trace(value: Trace | PathLike) -> Trace:
    """A Trace, or the trace file a path names (read and checked as `memplan.load_trace` reads it); TraceError
    otherwise."""
    if isinstance(value, Trace):
        return value
    if not isinstance(value, (str, os.PathLike)):
        raise TraceError(f"trace: expected a memplan.Trace or a trace file's path, got {type(value).__name__}")
    return load(value)


def as_plan(value: Plan | PathLike | None, trace: Trace | None = None, optional: bool = True) -> Plan | None:
    """A Plan, or the plan file a path names (read and verified against `trace`, as `memplan.load_plan` does); None
    stays None where `optional`; PlanError otherwise."""
    if isinstance(value, Plan) or (value is None and optional):
        return value
    if not isinstance(value, (str, os.PathLike)):
        raise PlanError(f"plan: expected a memplan.Plan or a plan file's path, got {type(value).__name__}")
    path = value
    if trace is None:
        raise PlanError(f"{path}: a plan file is read with its trace: memplan.load_plan(path, trace)")
    return load_plan(path, trace)


def as_list(values, what: str, error: type[MemplanError]) -> list:
    """The items of a list or tuple (of traces, plans or modes); `error` for a single item or anything else."""
    if not isinstance(values, (list, tuple)):
        raise error(f"{what}: expected a list or tuple, got {type(values).__name__}")
    return list(values)


def as_size(value: int | str | None, option: str) -> int | None:
    """A memory size as the command line takes it: a positive number of bytes, or a size such as '16GiB' or '80GB'
    (units.parse_size); None stays None; SizeError otherwise."""
    if value is None:
        return None
    if isinstance(value, str):
        return parse_size(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SizeError(f"{option} {short_repr(value)}: a size must be a positive number of bytes, or such as '16GiB'")
    return value


def as_count(value: int, option: str) -> int:
    """A whole number of at least 1 (ArgumentError otherwise), as the command line's integer options take it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ArgumentError(f"{option} {short_repr(value)}: a whole number of at least 1")
    return value


def as_seconds(value: float) -> float:
    """A time limit in seconds: a finite number above 0 (ArgumentError otherwise), as --time-limit takes it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ArgumentError(f"--time-limit {short_repr(value)}: a number of seconds above 0")
    return value


def as_alloc_conf(value: str | None) -> str:
    """A PYTORCH_CUDA_ALLOC_CONF string ('' or None: PyTorch's defaults); AllocConfError for anything else."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise AllocConfError(f"PYTORCH_CUDA_ALLOC_CONF: expected a string, got {type(value).__name__}")
    return value


def split_step(model_file: PathLike, options: Mapping) -> tuple[StepSpec, dict]:
    """`options` parted into the StepSpec of `model_file` they describe and the job's own options."""
    step = StepSpec(model_file, **{name: value for name, value in options.items() if name in STEP_OPTIONS})
    rest = {name: value for name, value in options.items() if name not in STEP_OPTIONS}
    require_fake_for_routing(step.routing, step.fake or rest.get("capture", "auto") != "real")
    return step, rest
