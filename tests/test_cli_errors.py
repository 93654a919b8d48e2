"""Every command: --help shows an example, and a list of bad inputs each gives one `Error:` line,
a non-zero exit and no file left behind; every --seq option has the same default, shown in --help."""

from __future__ import annotations

import gzip
import json
import pickle
import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from memplan.cli import main
from memplan.traces import make_trace, save

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
def inputs(tmp_path, monkeypatch):
    """A valid trace, a plan made for a different trace, and a few broken files; the working directory
    is the same folder, so files a command would write by default are seen too."""
    monkeypatch.chdir(tmp_path)
    save(make_trace({"size": [1024, 2048, 512], "alloc": [1, 2, 3], "free": [4, 5, 6]}), tmp_path / "t.json")
    save(make_trace({"size": [4096], "alloc": [1], "free": [2]}), tmp_path / "other.json")
    assert (
        CliRunner()
        .invoke(main, ["solve", str(tmp_path / "other.json"), "-o", str(tmp_path / "other.plan.json")])
        .exit_code
        == 0
    )
    good = (tmp_path / "t.json").read_bytes()
    (tmp_path / "cut.json").write_text('{"format": "memplan-trace/1", "buffers": {"size": [1')
    (tmp_path / "cut.json.gz").write_bytes(gzip.compress(good)[:-20])
    (tmp_path / "garbled.json.gz").write_bytes(gzip.compress(good)[:12] + b"\x00" * 40)
    doc = json.loads(good)
    doc["buffers"]["free"] = doc["buffers"]["free"][:2]
    (tmp_path / "mismatched.json").write_text(json.dumps(doc))
    doc = json.loads(good)
    doc["buffers"]["size"][0] = 2**70
    (tmp_path / "huge.json").write_text(json.dumps(doc))
    (tmp_path / "nobuild.py").write_text("def make(batch_size, seq_len, dtype, device):\n    return None\n")
    (tmp_path / "exits.py").write_text(
        "import sys\n\ndef build(batch_size, seq_len, dtype, device):\n    sys.exit(3)\n"
    )
    (tmp_path / "text.pickle").write_text("not a pickle at all")
    (tmp_path / "object.pickle").write_bytes(pickle.dumps({"segments": [], "device_traces": [[Path("x")]]}))
    (tmp_path / "bad.csv").write_text("name,start,end\n1,2,3\n")
    return tmp_path


BAD = {
    "trace": [
        ["{d}/missing.py"],
        ["{d}/nobuild.py"],
        ["{d}/exits.py"],
        ["{d}/nobuild.py", "--dtype", "float16"],
        ["{e}/bert.py", "--device", "cuda"],
        ["{e}/bert.py", "--batch", "0"],
        ["{e}/bert.py", "--layers", "fastest"],
        ["{e}/bert.py", "-o", "/proc/no/such/dir/t.json.gz"],
        ["{e}/gpt2_parallel.py", "--fake", "--nproc", "3"],
        ["{d}/exits.py", "--fake"],
    ],
    "import": [["{d}/missing.pickle"], ["{d}/text.pickle"], ["{d}/object.pickle"], ["{d}/t.json"]],
    "explain": [
        ["{d}/missing.pickle"],
        ["{d}/text.pickle"],
        ["{d}/object.pickle"],
        ["{d}/t.json", "--gpu", "H200"],
        ["{d}/object.pickle", "--gpu", "H9000"],
        ["{d}/object.pickle", "--gpu", "H200", "--memory", "80GB"],
        ["{d}/object.pickle", "--outside", "lots"],
    ],
    "check": [
        ["--", "python", "{d}/missing.py"],
        ["--", "python", "{d}/t.json"],
        ["--", "python", "{d}/exits.py"],
        ["--gpu", "H9000", "--", "python", "{d}/exits.py"],
        ["--steps", "0", "--", "python", "{d}/exits.py"],
        ["--gpu", "H100", "--outside", "lots", "--", "python", "{d}/exits.py"],
        ["--", "python", "-m"],
    ],
    "export": [
        ["{d}/missing.json"],
        ["{d}/cut.json.gz"],
        ["{d}/t.json", "-o", "{d}/t.pkl"],
        ["{d}/t.json", "--alloc-conf", "max_split_size_mb:lots"],
        ["{d}/t.json", "--plan", "{d}/other.plan.json"],
        ["{d}/t.json", "--plan", "{d}/other.plan.json", "--alloc-conf", "expandable_segments:True"],
        ["{d}/t.json", "-o", "/proc/no/such/dir/t.pickle"],
    ],
    "solve": [
        ["{d}/missing.json"],
        ["{d}/cut.json"],
        ["{d}/cut.json.gz"],
        ["{d}/garbled.json.gz"],
        ["{d}/mismatched.json"],
        ["{d}/huge.json"],
        ["{d}/t.json", "--capacity", "1024"],
        ["{d}/bad.csv"],
        ["{d}/t.json", "--method", "magic"],
        ["{d}/t.json", "--time-limit", "0"],
    ],
    "simulate": [
        ["{d}/missing.json"],
        ["{d}/t.json", "--alloc-conf", "max_split_size_mb:lots"],
        ["{d}/t.json", "--plan", "{d}/other.plan.json"],
        ["{d}/cut.json"],
        ["{d}/cut.json.gz"],
        ["{d}/t.json", "--timeline", "/proc/no/such/dir/t.csv"],
    ],
    "plot": [
        ["{d}/t.json", "-o", "{d}/out.jpg"],
        ["{d}/missing.json", "-o", "{d}/out.png"],
        ["{d}/t.json", "-o", "{d}/out.png", "--address-space"],
        ["{d}/t.json"],
        ["{d}/t.json", "-o", "/proc/no/such/dir/out.png"],
    ],
    "report": [
        ["{d}/t.json", "-o", "{d}/out.png"],
        ["{d}/missing.json", "-o", "{d}/out.html"],
        ["{d}/cut.json.gz", "-o", "{d}/out.html"],
        ["{d}/t.json", "--plan", "{d}/other.plan.json", "-o", "{d}/out.html"],
        ["{d}/t.json", "--gpu", "nosuchgpu", "-o", "{d}/out.html"],
        ["{d}/t.json"],
        ["{d}/t.json", "-o", "/proc/no/such/dir/out.html"],
    ],
    "compare": [["{d}/missing.json"], ["{d}/t.json", "--plan", "{d}/other.plan.json"], []],
    "replay": [
        ["{d}/missing.plan.json", "{e}/bert.py"],
        ["{d}/cut.json", "{e}/bert.py"],
        ["{d}/other.plan.json", "{d}/nobuild.py"],
    ],
    "fit": [
        ["{d}/missing.py", "--memory", "1GiB"],
        ["{e}/bert.py", "--memory", "lots"],
        ["{d}/nobuild.py", "--memory", "1GiB"],
        ["{e}/bert.py"],
    ],
    "run": [["{d}/missing.py", "-o", "{d}/run-out"], ["{d}/nobuild.py", "-o", "{d}/run-out"]],
    "tradeoff": [
        ["{d}/missing.py"],
        ["{e}/bert.py", "--budgets", "2"],
        ["{e}/bert.py", "--budgets", "half"],
        ["{e}/bert.py", "-o", "{d}/figure.txt"],
        ["{e}/bert.py", "--variant", "{d}/nobuild.py"],
        ["{e}/bert.py", "--variant", "{d}/missing.py"],
    ],
    "optimize": [
        ["{d}/missing.py", "--memory", "1GiB"],
        ["{e}/bert.py", "--memory", "lots"],
        ["{e}/bert.py", "--memory", "0GiB"],
        ["{e}/bert.py"],
        ["{e}/bert.py", "--memory", "1GiB", "--batch", "2", "--max-batch"],
    ],
}


@pytest.mark.parametrize(
    "command, args",
    [(c, a) for c, cases in BAD.items() for a in cases],
    ids=lambda v: v if isinstance(v, str) else " ".join(v),
)
def test_bad_input_is_one_line_and_leaves_nothing(inputs, command, args):
    before = set(inputs.rglob("*"))
    r = CliRunner().invoke(main, [command] + [a.format(d=inputs, e=EXAMPLES) for a in args])
    assert r.exit_code not in (0, None), r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.stdout == ""
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and r.stderr.rstrip().splitlines()[-1] == errors[0], r.stderr
    assert set(inputs.rglob("*")) == before


def test_every_command_is_covered_and_has_an_example():
    for name in main.commands:
        assert name in BAD, f"no bad inputs listed for memplan {name}"
        r = CliRunner().invoke(main, [name, "--help"])
        assert r.exit_code == 0 and "Example" in r.output, name


DEFAULT_SEQ = 128


def _commands(group: click.Group, prefix: str = ""):
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from _commands(command, f"{prefix}{name} ")
        else:
            yield f"{prefix}{name}", command


def test_every_seq_option_has_the_same_default_and_shows_it():
    """Every command that takes --seq has the same default sequence length, and its --help says so."""
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
