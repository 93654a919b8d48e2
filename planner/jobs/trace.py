"""`memplan trace`: record one training step of a model file under a layer mode and write its trace, or one
trace per rank with `nproc`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from memplan.planner.layers import LayerMode
from memplan.traces.compile import Compile, CompileError, describe_compile, require_real_tensors
from memplan.traces.distributed import trace_command_ranks
from memplan.traces.format import save
from memplan.traces.summary import render, summarize
from memplan.traces.trace_model import trace_model_file


def trace_to_file(
    model_file: str,
    output: str | None,
    *,
    layers: str,
    batch: int,
    seq: int,
    dtype: str,
    device: str,
    fake: bool,
    top: int,
    nproc: int | None,
    progress: Callable[[str], None],
    compile: float | None = None,
) -> tuple[dict, str]:
    """Trace MODEL_FILE's step with `layers` and write it to `output` (default: <model>.<layers>.trace.json.gz,
    <model>.<layers>.compiled-<budget>.trace.json.gz when `compile` is the activation memory budget of a compiled
    step); returns the summary (the JSON of `memplan trace --json`) and its text."""
    # 1. Check the request before the model is built: the layer mode, the budget, real tensors for --compile.
    mode = LayerMode(layers)
    compiled = None if compile is None else Compile(compile)
    if compiled is not None:
        require_real_tensors(fake)
        if nproc is not None:
            raise CompileError("--compile traces one process: it does not take --nproc")
    # 2. Per rank with --nproc (eager), else this process's one step.
    if nproc is not None:
        summary, text = trace_command_ranks(
            model_file,
            output,
            nproc,
            batch=batch,
            seq=seq,
            dtype=dtype,
            layers=mode,
            device=device,
            top=top,
            progress=progress,
            fake=fake,
        )
        return {**summary, "compile": None}, text
    variant = "" if compiled is None else f".compiled-{compiled.budget:g}"
    output = output or f"{Path(model_file).stem}.{layers}{variant}.trace.json.gz"
    kind = "fake tensors" if fake else "real tensors"
    how = "" if compiled is None else f", compiled: {describe_compile(compiled.meta())}"
    progress(
        f"building {model_file} (batch {batch}, seq {seq}, {dtype}, {device}, layers {layers}, {kind}{how}) "
        "and recording one training step after a warm-up step" + (" (which compiles it)" if compiled else "")
    )
    trace = trace_model_file(
        model_file, batch=batch, seq=seq, dtype=dtype, device=device, layers=mode, fake=fake, compile=compiled
    )
    save(trace, output)
    progress(f"wrote {output}")
    meta = trace.meta.get("compile")
    summary = {**summarize(trace, top=top), "compile": meta, "output": str(output)}
    compiled_line = "" if meta is None else f"\ncompiled: {describe_compile(meta)}"
    return summary, render(summary) + compiled_line + f"\nwritten to {output}"
