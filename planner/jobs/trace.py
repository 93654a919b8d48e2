"""`memplan trace`: record one training step of a model file under a layer mode and write its trace, or one
trace per rank with `nproc`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from memplan.planner.layers import LayerMode
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
) -> tuple[dict, str]:
    """Trace MODEL_FILE's step with `layers` and write it to `output` (default: <model>.<layers>.trace.json.gz);
    returns the summary (the JSON of `memplan trace --json`) and its text."""
    mode = LayerMode(layers)  # a wrong mode fails here, before the model is built
    if nproc is not None:
        return trace_command_ranks(
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
    output = output or f"{Path(model_file).stem}.{layers}.trace.json.gz"
    kind = "fake tensors" if fake else "real tensors"
    progress(
        f"building {model_file} (batch {batch}, seq {seq}, {dtype}, {device}, layers {layers}, {kind}) "
        "and recording one training step after a warm-up step"
    )
    trace = trace_model_file(model_file, batch=batch, seq=seq, dtype=dtype, device=device, layers=mode, fake=fake)
    save(trace, output)
    progress(f"wrote {output}")
    summary = {**summarize(trace, top=top), "output": str(output)}
    return summary, render(summary) + f"\nwritten to {output}"
