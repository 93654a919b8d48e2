"""`memplan replay`: replay a plan on a model file's training step and compare with the reference run."""

from __future__ import annotations

from collections.abc import Callable

from memplan.planner.plan import PlanMismatchError, load_plan
from memplan.planner.replay.cpu_session import CPUPlanAllocator
from memplan.planner.replay.report import ReplayReport
from memplan.planner.replay.runner import replay
from memplan.planner.replay.schedule import ReplayError, schedule_from
from memplan.step import StepSpec
from memplan.traces.capture import capture_step
from memplan.traces.compile import Compile, compile_model
from memplan.traces.format import Trace, load
from memplan.traces.inputs.model_file import load_workload


def replay_model_file(
    plan_file: str,
    step: StepSpec,
    *,
    trace_file: str | None = None,
    steps: int = 3,
    progress: Callable[[str], None] = lambda m: None,
) -> ReplayReport:
    """Replay PLAN on the model file's `step` (real tensors). The plan's trace is `trace_file`, or (CPU) the step
    captured now; the plan is verified against it before anything runs, and refused when it fails. A compiled step
    is compiled as `memplan trace --compile` compiles it, so the steps allocate the sequence the plan was made for
    (the warm-up step compiles it)."""
    device = step.device
    if step.fake:
        raise ReplayError("a replay runs the real step: it takes no fake tensors")
    if device == "cuda":
        from memplan.planner.replay.cuda_session import CUDAPlanAllocator, install_plugin

        lib = install_plugin()  # before anything touches CUDA
    elif device != "cpu":
        raise ReplayError(f"--device {device}: replay supports cpu and cuda")

    compiled = None if step.compile is None else Compile(step.compile)

    def make_workload():
        workload = load_workload(step)
        if compiled is not None:
            compile_model(workload.model, compiled)
        return workload

    traces: list[Trace] = []

    def plan_trace() -> Trace:
        """The trace the plan is checked against: the --trace file, or (CPU) the step captured now."""
        if trace_file is not None:
            trace = load(trace_file)
            require_same_compile(trace_file, trace.meta.get("compile"), compiled)
        elif device == "cuda":
            raise ReplayError(
                "--device cuda needs --trace (the plan's trace): a capture cannot see allocations "
                "made through the plan plugin"
            )
        else:
            progress(f"capturing one step of {step.model_file} to find the plan's allocation order")
            trace = capture_step(make_workload, progress=progress)
        traces.append(trace)
        return trace

    try:
        plan = load_plan(plan_file, plan_trace)  # verified against its trace before anything runs on it
    except PlanMismatchError:
        if trace_file is not None:
            raise
        how = "" if compiled is None else f", compiled with memory budget {compiled.budget:g}"
        raise ReplayError(
            f"{plan_file} was not made from this step of {step.model_file} (batch {step.batch}, seq {step.seq}, "
            f"{step.dtype}, {step.mode_name}{how}): pass the plan's trace with --trace"
        ) from None
    trace = traces[0]
    schedule = schedule_from(plan, trace, device)
    if device == "cuda":
        allocator = CUDAPlanAllocator(lib, schedule)
        reference = "cudaMalloc/cudaFree (the plugin with no plan; PyTorch's caching allocator cannot come back)"
    else:
        allocator = CPUPlanAllocator(schedule)
        reference = "PyTorch's default CPU allocator"
    progress(f"replaying {steps} step(s) with the plan allocator, then with the reference allocator")
    return replay(schedule, make_workload, allocator, steps=steps, device=device, reference=reference)


def require_same_compile(trace_file: str, traced: dict | None, compiled: Compile | None) -> None:
    """The replayed step must be compiled as the plan's trace was (meta "compile"), or its allocations differ."""
    if traced == (None if compiled is None else compiled.meta()):
        return
    if traced is None:
        raise ReplayError(f"{trace_file} is an eager step: replay its plan without --compile")
    raise ReplayError(
        f"{trace_file} is a compiled step: replay its plan with --compile --memory-budget {traced['memory_budget']:g}"
    )
