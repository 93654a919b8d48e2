"""The `memplan` command line: argument parsing, progress and exit codes; the logic lives in the packages."""
from __future__ import annotations

import json
import sys

import click

from traces.errors import MemplanError


class MemplanGroup(click.Group):
    """A click group that turns memplan's typed errors into one line and exit code 1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except MemplanError as e:
            raise click.ClickException(str(e)) from None


def emit(summary: dict, as_json: bool, text: str) -> None:
    """Print a command's summary: the JSON document with --json, the human text otherwise."""
    click.echo(json.dumps(summary, indent=2, sort_keys=True) if as_json else text)


def progress(message: str) -> None:
    """Progress lines go to stderr so that --json output on stdout stays parseable."""
    click.echo(message, err=True)


@click.group(cls=MemplanGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="memplan")
def main() -> None:
    """memplan: trace a training step, plan its memory, replay and simulate it, and plot it."""


@main.command("trace")
@click.argument("model_file", type=click.Path(dir_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False),
              help="Trace file to write (default: <model>.<layers>.trace.json.gz).")
@click.option("--batch", type=click.IntRange(min=1), default=2, show_default=True, help="Batch size passed to build().")
@click.option("--seq", type=click.IntRange(min=1), default=128, show_default=True, help="Sequence length passed to build().")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True)
@click.option("--layers", default="baseline", show_default=True,
              help="Memory-saving layers applied to the model (baseline, or a mode of planner.layers).")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda.")
@click.option("--top", type=click.IntRange(min=0), default=5, show_default=True, help="Largest buffers to list.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def trace_command(model_file, output, batch, seq, dtype, layers, device, top, as_json):
    """Record one training step of MODEL_FILE and write its trace.

    Example: memplan trace examples/bert.py --batch 2 --seq 128 -o bert.trace.json.gz
    """
    from pathlib import Path

    import torch

    from traces.capture import capture_step
    from traces.format import save
    from traces.model_file import load_workload
    from traces.summary import render, summarize

    stem = Path(model_file).stem
    output = output or f"{stem}.{layers}.trace.json.gz"
    progress(f"building {model_file} (batch {batch}, seq {seq}, {dtype}, {device}, layers {layers})")
    workload = load_workload(model_file, batch=batch, seq=seq, dtype=getattr(torch, dtype),
                             device=device, layers=layers)
    progress("recording one training step after a warm-up step")
    trace = capture_step(workload, meta={"model": stem, "layers": layers, "batch": batch, "seq": seq,
                                         "model_file": str(model_file)})
    save(trace, output)
    progress(f"wrote {output}")
    summary = summarize(trace, top=top)
    summary["output"] = str(output)
    emit(summary, as_json, render(summary) + f"\nwritten to {output}")


if __name__ == "__main__":
    sys.exit(main())
