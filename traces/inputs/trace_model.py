"""Trace one training step of a model file (a StepSpec): the one function behind `memplan trace`, `run`, `fit`,
`tradeoff` and `optimize`, so every command records a model file the same way."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from memplan.errors import MemplanError
from memplan.modes import AS_BUILT
from memplan.planner.layers.patch import leaves_as_built
from memplan.step import StepSpec
from memplan.traces.capture import capture_step
from memplan.traces.compile import Compile, compile_model, require_real_tensors
from memplan.traces.format import Trace
from memplan.traces.inputs.model_file import build_workload, import_model_file, load_workload, require_device
from memplan.units import human_bytes


def trace_step(step: StepSpec, meta: dict | None = None, progress: Callable[[str], None] | None = None) -> Trace:
    """Build the step's workload (its shape, device and layer mode) and record one training step (after a warm-up
    step unless `step.warmup` is off); under fake tensors when `step.fake` (nothing allocated or computed, any
    size, also a CUDA device on a CPU); compiled by torch.compile when `step.compile` is a budget (the warm-up
    step compiles it, so the compiler's own allocations are not the recorded step's; a recorded step that
    compiles again is a CompileError). A trace that runs long reports through `progress` every few seconds."""
    require_device(step.device, step.fake)
    require_real_tensors(step)
    compiled = None if step.compile is None else Compile(step.compile)
    build_function = import_model_file(step.model_file)  # before recording: import-time tensors are not the step's

    compilations = []  # the compiled forward's Compilations, once built

    def build():
        workload = build_workload(step, build_function)
        if compiled is not None:
            compilations.append(compile_model(workload.model, compiled))
        return workload

    info = {  # meta "model" is capture_step's: the workload's name (the model file's "name", else its file name)
        "layers": step.mode_name,
        "loss": step.loss,
        "optimizer_choice": step.optimizer,
        "batch": step.batch,
        "seq": step.seq,
        "dtype": step.dtype,
        "model_file": step.model_file,
        **({"compile": compiled.meta()} if compiled is not None else {}),
    }
    meta = {**info, **(meta or {})}
    trace = capture_step(
        build,
        step.device,
        fake=step.fake,
        warmup=step.warmup,
        meta=meta,
        gpu=step.gpu,
        progress=progress,
        routing=step.routing,
        torch_version=step.torch,
    )
    for compilation in compilations:
        compilation.require_steady(step.model_file, steps=2 if step.warmup else 1)
    return trace


def as_built_patch(step: StepSpec) -> dict | None:
    """The patch report (a trace's meta "patch") of the step's layer mode when the mode leaves the model exactly as
    built (planner.layers.patch.leaves_as_built), so that its trace is the as-built step's but for the meta naming the
    mode; None when the mode changes anything, or the step is compiled or fake (a fake capture's program differs in
    the order two alike buffers of its warm-up are freed between the first capture of a process and later ones).
    Builds the model and runs no step: a build costs far less than the two steps of a trace."""
    if step.compile is not None or step.fake:
        return None
    workload = load_workload(step)
    return workload.patch if leaves_as_built(workload.model) else None


def as_built_trace(trace: Trace, mode: str, patch: dict) -> Trace:
    """`trace` (of the model as built) as a trace of `mode`, which leaves the model as built (`as_built_patch` gave
    `patch`): the same buffers and program, the meta's "layers" and "patch" (and the program's) naming the mode."""

    def relabel(meta: dict) -> dict:
        return {**meta, **{k: v for k, v in (("layers", mode), ("patch", patch)) if k in meta}}

    program = trace.program
    if program is not None:
        program = replace(program, trace=replace(program.trace, meta=relabel(program.trace.meta)))
    return replace(trace, meta=relabel(trace.meta), program=program)


CAPTURES = ("auto", "real", "fake")
REAL_STEP_BYTES = 2 << 30  # auto traces a step holding more than this under fake tensors: a real CPU step
#                            takes about 8 s per GiB held on 2 cores (BERT-Large layers), a fake one seconds
HOST_SHARE = 0.7  # and a real trace may use at most this share of the RAM available now


def host_memory_available() -> int | None:
    """Bytes of RAM this machine can still give (MemAvailable of /proc/meminfo), None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass(frozen=True)
class CaptureChoice:
    """Real or fake tensors for a command's traces, and why, in words for its report."""

    fake: bool
    reason: str
    sizing: tuple[StepSpec, Trace] | None = field(default=None, compare=False, repr=False)  # auto's trace, and its step

    @property
    def name(self) -> str:
        return "fake" if self.fake else "real"

    def trace(self, step: StepSpec, progress: Callable[[str], None] | None = None) -> Trace:
        """trace_step(step), or the trace auto took to size the steps when `step` is that one (a command tracing the
        model as built on fake tensors need not trace it twice)."""
        if self.sizing is not None and self.sizing[0] == step:
            return self.sizing[1]
        return trace_step(step, progress=progress)


def sized_capture(capture: str, step: StepSpec, progress: Callable[[str], None] | None = None) -> CaptureChoice:
    """`choose_capture` for a model file's step: auto sizes it on a fake, eager trace of the model as built (only
    auto traces anything; a long one reports through `progress`)."""
    if capture != "auto":
        return choose_capture(capture, 0, step.device)
    sizing = step.replace(mode=AS_BUILT, fake=True, compile=None)
    trace = trace_step(sizing, progress=progress)
    choice = choose_capture(capture, trace.peak()[0], step.device)
    return CaptureChoice(choice.fake, choice.reason, (sizing, trace) if choice.fake else None)


def rank_capture(capture: str, device: str = "cpu") -> CaptureChoice:
    """`--capture` for the ranks of a distributed model file (`--nproc`): auto traces them on the fake process group
    under fake tensors (each fake rank equals the gloo rank buffer for buffer, docs/parallel.md: no step need be
    sized first), real starts a process per rank."""
    if capture == "auto":
        return CaptureChoice(True, "--capture auto: the ranks on torch.distributed's fake process group")
    return choose_capture(capture, 0, device)


def choose_capture(capture: str, need: int, device: str = "cpu") -> CaptureChoice:
    """`--capture auto|real|fake` for steps holding about `need` bytes on `device`: auto traces fake tensors when a
    real step would be slow (above REAL_STEP_BYTES) or would not fit this machine's RAM, and a CUDA step on a
    machine without a GPU always."""
    if capture not in CAPTURES:
        raise MemplanError(f"--capture {capture}: choose from {', '.join(CAPTURES)}")
    if device.startswith("cuda") and not torch.cuda.is_available() and capture != "fake":
        if capture == "real":
            raise MemplanError("--capture real: a CUDA step, and this machine has no CUDA device (use fake or auto)")
        return CaptureChoice(True, f"--capture {capture}: a CUDA step on a machine without a GPU")
    if capture != "auto":
        return CaptureChoice(capture == "fake", f"--capture {capture}")
    available = host_memory_available()
    limit = REAL_STEP_BYTES if available is None else min(REAL_STEP_BYTES, int(HOST_SHARE * available))
    if need > limit:
        return CaptureChoice(
            True,
            f"--capture auto: the steps hold about {human_bytes(need, unit='GiB')}, more than the "
            f"{human_bytes(limit, unit='GiB')} traced for real on this machine",
        )
    return CaptureChoice(
        False,
        f"--capture auto: the steps hold about {human_bytes(need, unit='GiB')}, within the "
        f"{human_bytes(limit, unit='GiB')} traced for real on this machine",
    )
