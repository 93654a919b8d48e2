"""The choice file memplan optimize writes and memplan.apply reads: a round trip, one-line errors on every
malformed file, and refusals that leave the model as it was."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import memplan
from memplan.planner.layers.patch import STATE as PATCHED
from memplan.planner.optimize.choice_file import FORMAT, ChoiceError, StepChoice, load_choice, save_choice
from memplan.planner.workloads import gpt2

LAYERS = (("layers.0", "full"), ("layers.1", "tempo"))
CHOICE = StepChoice(
    "examples/gpt2.py", 2, 64, "float32", LAYERS, "as-built", "as-built", 1000, 900, 950, "optimal", "sha256:0"
)


def tiny():
    torch.manual_seed(0)
    return gpt2.build_workload(batch_size=1, seq_len=16, config=gpt2.GPT2Config(layers=2, vocab_size=64))


def test_round_trip(tmp_path):
    save_choice(CHOICE, tmp_path / "c.json")
    assert load_choice(tmp_path / "c.json") == CHOICE
    assert json.loads((tmp_path / "c.json").read_text())["format"] == FORMAT


def broken(data: dict, path: str, value) -> dict:
    """`data` with the field at `path` (keys joined by /) set to `value` (or removed when value is ...)."""
    data = json.loads(json.dumps(data))
    *parents, last = path.split("/")
    owner = data
    for key in parents:
        owner = owner[key]
    if value is ...:
        del owner[last]
    else:
        owner[last] = value
    return data


@pytest.mark.parametrize(
    "path, value, message",
    [
        ("format", "memplan-plan/1", "its format is not"),
        ("step/batch", 0, "batch is not a whole number of at least 1"),
        ("step/seq", True, "seq is not a whole number"),
        ("step/dtype", "float8", "--dtype 'float8'"),
        ("actions/layers", ["layers.0"], "actions.layers is not an object"),
        ("actions/layers/layers.0", "baseline", "is not a per-layer mode"),
        ("actions/loss", "chunked", "unknown loss 'chunked'"),
        ("actions/optimizer", "lion", "unknown optimizer 'lion'"),
        ("verified/plan_arena", 2000, "larger than its memory"),
        ("verified/trace_digest", ..., "missing 'trace_digest'"),
        ("verified", [], "verified is not an object"),
    ],
)
def test_malformed_files_are_one_line_errors(tmp_path, path, value, message):
    target = tmp_path / "c.json"
    target.write_text(json.dumps(broken(CHOICE.to_dict(), path, value)))
    with pytest.raises(ChoiceError, match="c.json: ") as error:
        load_choice(target)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("content", [b"", b"{", b"\x1f\x8b garbage", b"[1, 2]"])
def test_unreadable_files_are_one_line_errors(tmp_path, content):
    (tmp_path / "c.json").write_bytes(content)
    with pytest.raises(ChoiceError) as error:
        load_choice(tmp_path / "c.json")
    assert "\n" not in str(error.value)
    with pytest.raises(ChoiceError, match="no such file"):
        load_choice(tmp_path / "absent.json")


def test_apply_patches_the_layers_it_names():
    workload = tiny()
    model, optimizer = memplan.apply(workload.model, workload.optimizer, CHOICE)
    assert model is workload.model and optimizer is workload.optimizer
    assert vars(model)[PATCHED] is not None and memplan.unpatch(model) > 0


def test_a_loss_that_cannot_apply_leaves_the_model_as_it_was():
    """memplan's decoder fuses its loss only when trained on TokenLoss: a loop that computes its own cannot."""
    workload = tiny()
    fused = dataclasses.replace(CHOICE, loss="fused")
    with pytest.raises(ChoiceError, match="the choice's loss 'fused' cannot apply to this model"):
        memplan.apply(workload.model, workload.optimizer, fused)
    assert PATCHED not in vars(workload.model)
    model, _ = memplan.apply(workload.model, workload.optimizer, fused, loss=workload.loss_fn)
    assert vars(model)[PATCHED] is not None


def test_the_optimizer_choice_rebuilds_the_optimizer_or_refuses_before_anything_changes():
    workload = tiny()
    model, optimizer = memplan.apply(
        workload.model, workload.optimizer, dataclasses.replace(CHOICE, optimizer="adamw-8bit")
    )
    assert optimizer is not workload.optimizer and type(optimizer).__name__ == "LowBitAdamW"
    assert optimizer.param_groups[0]["lr"] == workload.optimizer.param_groups[0]["lr"]
    fresh = tiny()
    sgd = torch.optim.SGD(fresh.model.parameters(), lr=0.1)
    with pytest.raises(ChoiceError, match="the choice's optimizer cannot apply: .*only AdamW and Adam convert"):
        memplan.apply(fresh.model, sgd, dataclasses.replace(CHOICE, optimizer="adamw-4bit"))
    assert PATCHED not in vars(fresh.model)
