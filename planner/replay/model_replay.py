"""`memplan replay`: replay a plan on a model file's training step and compare with the reference run."""

from __future__ import annotations

from collections.abc import Callable

import torch

from memplan.modes import AS_BUILT
from memplan.planner.layers import LayerMode
from memplan.planner.plan import load_plan
from memplan.planner.replay.cpu_session import CPUPlanAllocator
from memplan.planner.replay.report import ReplayReport
from memplan.planner.replay.runner import replay
from memplan.planner.replay.schedule import ReplayError, schedule_from
from memplan.traces.capture import capture_step
from memplan.traces.compile import Compile, compile_model
from memplan.traces.format import load, trace_digest
from memplan.traces.model_file import load_workload


def replay_model_file(
    plan_file: str,
    model_file: str,
    *,
    trace_file: str | None = None,
    steps: int = 3,
    device: str = "cpu",
    batch: int = 2,
    seq: int = 128,
    dtype: str = "float32",
    layers: str = AS_BUILT,
    progress: Callable[[str], None] = lambda m: None,
    compile: float | None = None,
) -> ReplayReport:
    """Replay PLAN on MODEL's step. The plan's trace is `trace_file`, or (CPU) the model's step captured now.
    With `compile` (the activation memory budget), the model is compiled as `memplan trace --compile` compiles
    it, so the steps allocate the sequence the plan was made for (the warm-up step compiles it)."""
    if device == "cuda":
        from memplan.planner.replay.cuda_session import CUDAPlanAllocator, install_plugin

        lib = install_plugin()  # before anything touches CUDA
    elif device != "cpu":
        raise ReplayError(f"--device {device}: replay supports cpu and cuda")

    mode = LayerMode(layers)
    compiled = None if compile is None else Compile(compile)
    plan = load_plan(plan_file)
    torch_dtype = getattr(torch, dtype)

    def make_workload():
        workload = load_workload(model_file, batch=batch, seq=seq, dtype=torch_dtype, device=device, layers=mode)
        if compiled is not None:
            compile_model(workload.model, compiled)
        return workload

    if trace_file is not None:
        trace = load(trace_file)
        require_same_compile(trace_file, trace.meta.get("compile"), compiled)
    elif device == "cuda":
        raise ReplayError(
            "--device cuda needs --trace (the plan's trace): a capture cannot see allocations "
            "made through the plan plugin"
        )
    else:
        progress(f"capturing one step of {model_file} to find the plan's allocation order")
        trace = capture_step(make_workload)
        if trace_digest(trace) != plan.digest:
            how = "" if compiled is None else f", compiled with memory budget {compiled.budget:g}"
            raise ReplayError(
                f"{plan_file} was not made from this step of {model_file} (batch {batch}, seq {seq}, "
                f"{dtype}, {layers}{how}): pass the plan's trace with --trace"
            )
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
