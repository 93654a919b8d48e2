"""Every command that takes --seq has the same default sequence length, and its --help says so."""

import re

import click
from click.testing import CliRunner

from memplan.cli import main

DEFAULT_SEQ = 128


def _commands(group: click.Group, prefix: str = ""):
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from _commands(command, f"{prefix}{name} ")
        else:
            yield f"{prefix}{name}", command


def test_every_seq_option_has_the_same_default_and_shows_it():
    seq = {
        name: next(p for p in command.params if p.name == "seq")
        for name, command in _commands(main)
        if any(p.name == "seq" for p in command.params)
    }
    assert {"trace", "replay", "run", "fit"} <= set(seq)
    assert {name: option.default for name, option in seq.items()} == dict.fromkeys(seq, DEFAULT_SEQ)
    for name, option in seq.items():
        command = dict(_commands(main))[name]
        opts, text = option.get_help_record(click.Context(command, info_name=name))
        assert re.search(rf"\[default: {DEFAULT_SEQ}\b", text), (name, text)
        result = CliRunner().invoke(main, [*name.split(), "--help"])
        assert result.exit_code == 0, result.output
        help_text = " ".join(result.output.split())  # the same text however --help wraps it
        assert f"{opts} {' '.join(text.split())}" in help_text, (name, help_text)
