"""`memplan trace`: record one training step of a model file under a layer mode and write its trace, or one
trace per rank with `nproc`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from memplan.errors import CompileError
from memplan.planner.cost.transfer import host_transfer
from memplan.step import StepSpec
from memplan.traces.compile import Compile, describe_compile, require_real_tensors
from memplan.traces.format import save
from memplan.traces.inputs.trace_model import trace_step
from memplan.traces.ranks.launch import trace_ranks
from memplan.traces.summary import summarize


def trace_to_file(
    step: StepSpec,
    output: str | None,
    *,
    top: int,
    nproc: int | None,
    progress: Callable[[str], None],
    host_bandwidth: int | None = None,
    every_rank: bool = False,
) -> dict:
    """Trace `step` and write it to `output` (default: <model>.<step name>.trace.json.gz, the step's name its layer
    mode and any loss and optimizer but as-built, `tempo.loss-fused.adamw-8bit`;
    <model>.<step name>.compiled-<budget>.trace.json.gz for a compiled step); returns the summary (the JSON of
    `memplan trace --json`; planner.report.trace_text.render_trace_file is its text), with `host_transfer`, the time
    offloaded layers' host copies take over the host link of the step's GPU or at `host_bandwidth` bytes/s, when
    there are copies and a link (else None)."""
    require_real_tensors(step)  # before anything is said or built
    if nproc is not None:
        if step.compile is not None:
            raise CompileError("--compile traces one process: it does not take --nproc")
        ranks = trace_command_ranks(step, output, nproc, top=top, progress=progress, every_rank=every_rank)
        return {**ranks, "compile": None}
    variant = "" if step.compile is None else f".compiled-{step.compile:g}"
    output = output or f"{Path(step.model_file).stem}.{step.name}{variant}.trace.json.gz"
    how = "" if step.compile is None else f", compiled: {describe_compile(Compile(step.compile).meta())}"
    progress(
        f"building {step.model_file} ({step.describe()}{how}) and recording {step.window}"
        + (" (which compiles it)" if step.compile is not None else "")
    )
    trace = trace_step(step, progress=progress)
    save(trace, output)
    progress(f"wrote {output}")
    meta = trace.meta.get("compile")
    summary = summarize(trace, top=top)
    transfer = None
    if summary.host and (step.gpu is not None or host_bandwidth is not None):
        transfer = host_transfer(summary.host["moved"], step.gpu, host_bandwidth).to_dict()
    return {**summary.to_dict(), "compile": meta, "output": str(output), "host_transfer": transfer}


def trace_command_ranks(
    step: StepSpec,
    output: str | None,
    nproc: int,
    *,
    top: int,
    progress: Callable[[str], None],
    every_rank: bool = False,
) -> dict:
    """`memplan trace --nproc N`: trace every rank (under --fake, the ranks alike by construction once, unless
    `every_rank`) and return the summary (JSON keys: world_size, ranks: each distinct trace's summary with its
    rank, the ranks it stands for and its output)."""
    output = output or f"{Path(step.model_file).stem}.{step.name}.trace.json.gz"
    backend = "fake process group, fake tensors" if step.fake else "nccl" if step.device == "cuda" else "gloo"
    progress(
        f"{'tracing' if step.fake else 'starting'} {nproc} ranks ({backend}): {step.model_file} (batch {step.batch}, "
        f"seq {step.seq}, {step.dtype}, layers {step.name}), {step.window} on each"
    )
    results = trace_ranks(step, output, nproc, top=top, alike=not every_rank)
    ranks = []
    for path, alike, summary in results:
        progress(f"wrote {path}")
        ranks.append({**summary, "rank": alike[0], "ranks": alike, "output": str(path)})
    return {"world_size": nproc, "ranks": ranks}
