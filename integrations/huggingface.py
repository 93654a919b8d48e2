"""Record one optimizer step of a HuggingFace `Trainer` run, or of an Accelerate training loop, as a trace.

`MemplanCallback(step=K)` is a `transformers.TrainerCallback`: at `on_step_begin` of step K (as
`state.global_step` counts) it enters `memplan.record` around the model, the optimizer and the step's
micro-batches, and at `on_step_end` it leaves it, so the recorded window is one whole optimizer step: the
forward and backward of every micro-batch of gradient accumulation, the clipping, `optimizer.step()`, the
scheduler and `zero_grad`. The trace is the one `memplan.record` gives around the same step of a hand-written
loop. `dry_run` runs a Trainer under fake tensors up to that step, before any training (nothing allocated, any
size, a CUDA device on any machine). `record_accelerate` is `memplan.record` for a model and optimizer that
`Accelerator.prepare` wrapped.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from memplan.errors import MemplanError
from memplan.traces.capture import Recording, record, run_user_code
from memplan.traces.fake.mode import is_fake
from memplan.traces.format import Trace

SOURCE = "memplan.integrations.huggingface"
DEFAULT_OUTPUT = "step.trace.json.gz"


class IntegrationError(MemplanError):
    """A training framework's step cannot be recorded (a bad step number, a dry run's build that makes no fake
    Trainer, a run that ends before the step)."""


def unwrap_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's `AcceleratedOptimizer` (or any wrapper holding it as `.optimizer`):
    the one whose step hooks run and whose state holds the moments."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _running_trainer(callback: TrainerCallback) -> Trainer | None:
    """The Trainer whose callback handler is calling `callback` now (found on the call stack), or None: Trainer
    hands its callbacks the model and optimizer but not itself, nor the step's batches."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer) and callback in owner.callback_handler.callbacks:
            return owner
        frame = frame.f_back
    return None


class MemplanCallback(TrainerCallback):
    """Record training step `step` (0 is the first, as `state.global_step` counts) of a Trainer run into a trace
    written to `output` (None: kept only as `callback.trace`). Use it as a context manager around
    `trainer.train()` so that a step that raises is discarded (nothing written) and the recorder removed."""

    def __init__(self, step: int, output: str | os.PathLike | None = DEFAULT_OUTPUT, meta: dict | None = None):
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise IntegrationError(f"MemplanCallback: step must be an integer >= 0, not {step!r}")
        self.step, self.output, self.meta = step, output, dict(meta or {})
        self.trace: Trace | None = None  # the recorded step's trace, once it has ended
        self._stack: contextlib.ExitStack | None = None
        self._recording: Recording | None = None
        self._batches: tuple[list, Any] = ([], None)  # the micro-batches of the step about to run
        self._trainer: Trainer | None = None
        self._session: Recording | None = None  # dry_run's fake recording, whose step this callback marks

    def on_train_begin(self, args, state, control, **kwargs):
        """Find the Trainer running this callback and watch the micro-batches it fetches for each step."""
        self.close()  # a recording left open by a run that raised outside `with callback:`
        trainer = _running_trainer(self)
        if trainer is not None and "get_batch_samples" not in vars(trainer):
            fetch = trainer.get_batch_samples

            def watched(*fetch_args, **fetch_kwargs):
                self._batches = fetch(*fetch_args, **fetch_kwargs)
                return self._batches

            trainer.get_batch_samples = watched
            self._trainer = trainer

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        """At step `step`: start recording, with the step's micro-batches (fetched already) as its inputs."""
        if state.global_step != self.step or self._stack is not None or self.trace is not None:
            return
        stack = contextlib.ExitStack()
        if self._session is not None:  # a dry run: the session is recording already, from before the model was built
            stack.enter_context(self._session.step(model, unwrap_optimizer(optimizer), inputs=self._batches))
            self._recording = self._session
        else:
            self._recording = stack.enter_context(
                record(model, unwrap_optimizer(optimizer), inputs=self._batches, output=self.output,
                       meta=self._meta(args))
            )  # fmt: skip
        self._stack = stack

    def on_step_end(self, args, state, control, **kwargs):
        """After zero_grad of step `step`: stop recording and write the trace."""
        if self._stack is None:
            return
        stack, self._stack = self._stack, None
        stack.close()
        self.trace = self._recording.trace
        if self._session is not None:
            self.trace.meta.update(self._meta(args))  # before record() writes it, as the session ends
            control.should_training_stop = True  # a dry run ends with its step

    def _meta(self, args) -> dict:
        """What the trace's meta says of the run: memplan's source, the step, the micro-batches in a step."""
        run = {"source": SOURCE, "step": self.step, "gradient_accumulation_steps": args.gradient_accumulation_steps}
        return {**run, **self.meta}

    def on_train_end(self, args, state, control, **kwargs):
        self._release()

    def close(self) -> None:
        """Discard a recording still open (training stopped inside the step): nothing is written."""
        if self._stack is not None:
            stack, self._stack = self._stack, None
            with contextlib.suppress(_Discarded):
                stack.__exit__(_Discarded, _Discarded(), None)
        self._release()

    def _release(self) -> None:
        """Give the Trainer back its own get_batch_samples."""
        if self._trainer is not None:
            vars(self._trainer).pop("get_batch_samples", None)
            self._trainer = None
        self._batches = ([], None)

    def __enter__(self) -> MemplanCallback:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._stack is not None and exc is not None:
            stack, self._stack = self._stack, None
            with contextlib.suppress(BaseException):
                stack.__exit__(exc_type, exc, tb)  # record() sees the error: it writes nothing
        self.close()


class _Discarded(Exception):
    """Thrown into a recording that training left open, so that it ends without a trace."""


@contextlib.contextmanager
def record_accelerate(
    accelerator: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    inputs: Any = None,
    output: str | os.PathLike | None = None,
    meta: dict | None = None,
) -> Iterator[Recording]:
    """`memplan.record` for one optimizer step of an Accelerate loop: `model` and `optimizer` as
    `accelerator.prepare` returned them (unwrapped here); the block holds every micro-batch of the step."""
    with record(
        accelerator.unwrap_model(model),
        unwrap_optimizer(optimizer),
        inputs=inputs,
        output=output,
        meta={"source": SOURCE, "framework": "accelerate", **(meta or {})},
    ) as recording:
        yield recording


def dry_run(
    build: Callable[[], Trainer],
    step: int = 1,
    *,
    device: str | torch.device = "cpu",
    gpu: str | None = None,
    output: str | os.PathLike | None = None,
    meta: dict | None = None,
) -> Trace:
    """Step `step` of the Trainer that `build()` makes (its model, TrainingArguments and Trainer built inside), run
    under fake tensors on `device` (a CUDA one follows `gpu`'s rules) as a trace: the memory of a Trainer run before
    any is rented. Training stops after that step; nothing is allocated or computed, so sizes need not fit here."""
    callback = MemplanCallback(step, output=None, meta={"dry_run": True, **(meta or {})})
    with record(fake=True, device=device, gpu=gpu, output=output) as session:
        trainer = run_user_code("Trainer's build", "dry_run", build, IntegrationError)
        if not isinstance(trainer, Trainer):
            raise IntegrationError(f"dry_run: build() returned {type(trainer).__name__}, not a transformers.Trainer")
        if not all(is_fake(p) for p in trainer.model.parameters()):
            raise IntegrationError("dry_run: the model holds real tensors: make it inside build(), under fake tensors")
        callback._session = session
        trainer.add_callback(callback)
        with callback:
            trainer.train()
        trainer.remove_callback(callback)
        if callback.trace is None:
            raise IntegrationError(f"dry_run: the run ended before step {step} (max_steps {trainer.state.max_steps})")
    return session.trace
