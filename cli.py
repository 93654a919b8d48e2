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


if __name__ == "__main__":
    sys.exit(main())
