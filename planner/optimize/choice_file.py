"""The choice file: what `memplan optimize -o FILE` chose for one step (a mode per Transformer layer, the step's
loss and optimizer), with the figures of the trace and plan that verified it, for `memplan.apply` to put on the
user's own model. Format memplan-choice/1, JSON (docs/formats.md: Choice files)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from memplan.errors import MemplanError
from memplan.files import atomic_write, read_json
from memplan.modes import AS_BUILT, check_layer_modes, check_loss, check_optimizer
from memplan.step import StepSpec

FORMAT = "memplan-choice/1"


class ChoiceError(MemplanError):
    """A choice file that cannot be read, or a choice that does not fit the model it is applied to."""


@dataclass(frozen=True)
class StepChoice:
    """The actions chosen for one step and what their verified trace and plan measured."""

    model_file: str  # the model file optimize measured
    batch: int  # the step's shape, as optimize traced it
    seq: int
    dtype: str
    layers: tuple[tuple[str, str], ...]  # (Transformer layer path, its mode), in the model's order
    loss: str  # of modes.LOSSES, chosen once per step
    optimizer: str  # of modes.OPTIMIZERS, chosen once per step
    memory: int  # bytes the step's plan was asked to fit
    peak_live: int  # the verified trace's peak live bytes
    plan_arena: int  # its plan's arena: at most `memory`
    status: str  # its plan's proof: optimal or feasible
    trace_digest: str  # the verified trace's digest (traces.format.trace_digest): a recording of the step on a
    #                    model the choice is applied to has the same one

    def step(self) -> StepSpec:
        """The step the choice was verified on, as memplan traces it (`memplan trace` of the model file)."""
        return StepSpec(
            self.model_file,
            self.batch,
            self.seq,
            self.dtype,
            mode=self.layers,
            loss=self.loss,
            optimizer=self.optimizer,
        )

    def to_dict(self) -> dict[str, Any]:
        """The file's JSON object."""
        return {
            "format": FORMAT,
            "model_file": self.model_file,
            "step": {"batch": self.batch, "seq": self.seq, "dtype": self.dtype},
            "actions": {"layers": dict(self.layers), "loss": self.loss, "optimizer": self.optimizer},
            "verified": {
                "memory": self.memory,
                "peak_live": self.peak_live,
                "plan_arena": self.plan_arena,
                "status": self.status,
                "trace_digest": self.trace_digest,
            },
        }


def save_choice(choice: StepChoice, path: str | os.PathLike) -> None:
    """Write `choice` to `path` whole or not at all."""
    atomic_write(path, json.dumps(choice.to_dict(), indent=1) + "\n")


def load_choice(path: str | os.PathLike) -> StepChoice:
    """Read a memplan-choice/1 file; ChoiceError names the file and the first fault."""
    name = os.fspath(path)
    data = read_json(path, ChoiceError)
    try:
        return _parse(data)
    except (KeyError, TypeError, ValueError, MemplanError) as e:
        detail = f"missing {e}" if isinstance(e, KeyError) else str(e)
        raise ChoiceError(f"{name}: not a {FORMAT} file ({detail})") from None


def _parse(data: Any) -> StepChoice:
    """The StepChoice of a decoded file, every field checked for type and range."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"its format is not {FORMAT!r}")
    step, actions, verified = (_object(data, key) for key in ("step", "actions", "verified"))
    layers = actions["layers"]
    if not isinstance(layers, dict) or not all(isinstance(path, str) for path in layers):
        raise ValueError("actions.layers is not an object of layer paths")
    choice = StepChoice(
        model_file=_text(data, "model_file"),
        batch=_count(step, "batch", 1),
        seq=_count(step, "seq", 1),
        dtype=_text(step, "dtype"),
        layers=tuple(check_layer_modes(layers).items()),
        loss=check_loss(actions.get("loss", AS_BUILT)),
        optimizer=check_optimizer(actions.get("optimizer", AS_BUILT)),
        memory=_count(verified, "memory", 0),
        peak_live=_count(verified, "peak_live", 0),
        plan_arena=_count(verified, "plan_arena", 0),
        status=_text(verified, "status"),
        trace_digest=_text(verified, "trace_digest"),
    )
    choice.step()  # the shape and dtype as StepSpec checks them
    if choice.plan_arena > choice.memory:
        raise ValueError(f"its plan ({choice.plan_arena:,} B) is larger than its memory ({choice.memory:,} B)")
    return choice


def _object(data: dict, key: str) -> dict:
    value = data[key]
    if not isinstance(value, dict):
        raise ValueError(f"{key} is not an object")
    return value


def _text(data: dict, key: str) -> str:
    value = data[key]
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key} is not a non-empty string")
    return value


def _count(data: dict, key: str, least: int) -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{key} is not a whole number of at least {least}")
    return value
