"""The one description of a step (StepSpec) and the one registry of layer modes (memplan.modes): what they
accept, what they refuse in one line, and what every stage reads from them."""

from __future__ import annotations

import pickle

import pytest
from click.testing import CliRunner

from memplan.cli import main
from memplan.errors import CompileError, MemplanError, PatchError
from memplan.modes import (
    AS_BUILT,
    BASELINE,
    FULL,
    MODES,
    OFFLOAD,
    OPTIMIZE_MODES,
    PER_LAYER_MODES,
    REGISTRY,
    SELECTIVE,
    SWEPT_MODES,
    TEMPO,
    describe_assignment,
    mode,
)
from memplan.step import StepError, StepSpec


def test_every_mode_is_named_by_its_parts_and_computes_with_the_core_they_imply():
    offloading = ("offload", "tempo+offload", "selective+offload")
    assert MODES == ("as-built", "baseline", "tempo", "selective", "tempo+selective", "full", "tempo+full", *offloading)
    for name, m in REGISTRY.items():
        beyond = sorted(m.parts - {BASELINE}, key=[TEMPO, SELECTIVE, FULL, OFFLOAD].index)
        assert name == ("+".join(beyond) or (BASELINE if m.parts else AS_BUILT))
        assert m.patches == (name != AS_BUILT) and (not m.parts or BASELINE in m.parts)
    cores = [None, BASELINE, TEMPO, SELECTIVE, SELECTIVE, BASELINE, TEMPO, BASELINE, TEMPO, SELECTIVE]
    assert [mode(n).core for n in MODES] == cores
    assert [n for n in MODES if mode(n).checkpoints] == ["full", "tempo+full"]
    assert PER_LAYER_MODES == tuple(n for n in MODES if n != BASELINE)  # baseline accounts for a whole model
    assert OPTIMIZE_MODES == ("as-built", "tempo", "selective", "tempo+selective", "full")
    assert SWEPT_MODES == MODES[: -len(offloading)]  # offload's time is the host link's: asked for by name


def test_a_step_is_checked_once_when_made_and_again_when_changed():
    step = StepSpec("m.py", batch=4, seq=64, dtype="bfloat16", mode="tempo")
    assert step.replace(batch=8).batch == 8 and step.batch == 4  # frozen: replace makes another
    for bad, message in [
        (dict(batch=0), "--batch 0: a whole number of at least 1"),
        (dict(seq=True), "--seq True: a whole number of at least 1"),
        (dict(dtype="float16"), "--dtype 'float16': choose one of float32, bfloat16"),
        (dict(mode="fast"), "unknown layers mode 'fast'; choose one of as-built, baseline"),
        (dict(mode={"layers.0": "baseline"}), "'baseline' is not a per-layer mode"),
        (dict(compile=1.5), "--memory-budget 1.5: choose a value from 0 to 1"),
        (dict(compile=float("nan")), "--memory-budget nan: choose a value from 0 to 1"),
    ]:
        with pytest.raises((StepError, PatchError, CompileError), match=message) as error:
            step.replace(**bad)
        assert isinstance(error.value, MemplanError) and "\n" not in str(error.value)


def test_per_layer_modes_are_kept_in_order_hashable_and_named_in_a_line():
    modes = {"layers.0": "full", "layers.1": "full", "layers.2": "tempo"}
    step = StepSpec("m.py", mode=modes)
    assert step.per_layer and step.layer_modes == modes and step.assignment == modes
    assert step.mode_name == describe_assignment(modes) == "per-layer: layers.0-1 full, layers.2 tempo"
    assert hash(step) == hash(StepSpec("m.py", mode=dict(modes)))  # a step can key a cache
    assert pickle.loads(pickle.dumps(step)) == step  # and cross to a rank's process
    assert StepSpec("m.py").assignment == AS_BUILT  # one default mode everywhere: the model as built


def test_a_steps_arguments_are_the_trace_command_that_rebuilds_it(tmp_path):
    step = StepSpec(tmp_path / "model.py", batch=3, seq=16, mode="tempo+selective", fake=True)
    assert step.arguments() == "--batch 3 --seq 16 --dtype float32 --layers tempo+selective --fake"
    compiled = StepSpec("m.py", compile=0.5)
    assert compiled.arguments().endswith("--layers as-built --compile --memory-budget 0.5")
    options = main.get_command(None, "trace").make_context("trace", ["m.py", *step.arguments().split()]).params
    assert (options["batch"], options["seq"], options["layers"], options["fake"]) == (3, 16, "tempo+selective", True)


def test_the_command_lines_help_lists_what_the_registry_says_each_mode_does():
    result = CliRunner().invoke(main, ["trace", "--help"], terminal_width=10_000)
    text = " ".join(result.output.split())
    for name, m in REGISTRY.items():
        assert f"{name}: {' '.join(m.replaces.split())}." in text
