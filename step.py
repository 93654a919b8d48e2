"""StepSpec: the one description of a training step to trace, replay or cost, handed whole to every stage (as
torchtitan hands its JobConfig), checked once when made."""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass

from memplan.errors import CompileError, MemplanError
from memplan.gpus import GPU, gpu
from memplan.limits import MAX_PARAMETERS, short_repr
from memplan.modes import AS_BUILT, check_layer_modes, check_loss, check_optimizer, describe_assignment, mode
from memplan.routing import DEFAULT as DEFAULT_ROUTING
from memplan.routing import Routing
from memplan.torch_versions import INSTALLED, TorchRules, torch_rules

DTYPES = ("float32", "bfloat16", "bf16-mixed")
# Each dtype's parameters and autocast: bf16-mixed is fp32 parameters with forward and loss under bf16 autocast.
PRECISIONS = {"float32": ("float32", None), "bfloat16": ("bfloat16", None), "bf16-mixed": ("float32", "bfloat16")}


class StepError(MemplanError):
    """A step described with a value it cannot take."""


@dataclass(frozen=True)
class StepSpec:
    """One training step of a model file: its shape, its layer mode, and how it is run and recorded."""

    model_file: str  # the model file (docs/capture.md: The model file) whose build() makes the workload
    batch: int = 2  # build()'s batch_size
    seq: int = 128  # build()'s seq_len
    dtype: str = "float32"  # one of DTYPES: the parameters' dtype, or bf16-mixed (fp32 under bf16 autocast)
    device: str = "cpu"  # cpu or cuda[:n]
    mode: str | tuple[tuple[str, str], ...] = AS_BUILT  # one of modes.MODES, or (layer path, mode) pairs per layer
    fake: bool = False  # under fake tensors: nothing allocated or computed, any size
    compile: float | None = None  # torch.compile's activation memory budget (0 to 1); None: eager (traced on real
    #                               tensors only: traces.compile.require_real_tensors)
    warmup: bool = True  # a warm-up step before the recorded one (the steady state; else the optimizer's first)
    gpu: GPU | None = None  # the GPU (gpus.py; a name is looked up) a CUDA step is planned for: a fake one
    #                         takes its rules
    loss: str = AS_BUILT  # one of modes.LOSSES: the model's loss as built, or fused (planner/layers/loss_patch.py)
    routing: str = DEFAULT_ROUTING  # the rule a fake step's mixture of experts routes its tokens by (memplan.routing:
    #                                 balanced, worst, loads=W0,W1,...); a real step routes by its router's values
    optimizer: str = AS_BUILT  # one of modes.OPTIMIZERS: the model file's optimizer as built, or its AdamW rebuilt
    #                            with smaller state (planner/layers/optimizer_choice.py)
    torch: TorchRules = INSTALLED  # the torch the step will run on (torch_versions.py; a version is looked up): a
    #                                fake CUDA step takes its attention and cuBLAS rules, the verdict its measurements
    max_parameters: int = MAX_PARAMETERS  # the most parameters a HuggingFace config's model may have (limits.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "model_file", os.fspath(self.model_file))
        for name in ("batch", "seq", "max_parameters"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise StepError(f"--{name.replace('_', '-')} {short_repr(value)}: a whole number of at least 1")
        if self.dtype not in DTYPES:
            raise StepError(f"--dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if isinstance(self.mode, Mapping):
            object.__setattr__(self, "mode", tuple(check_layer_modes(self.mode).items()))
        elif isinstance(self.mode, str):
            mode(self.mode)
        else:
            object.__setattr__(self, "mode", tuple(check_layer_modes(dict(self.mode)).items()))
        if self.compile is not None:
            check_budget(self.compile)
        if isinstance(self.gpu, str):
            object.__setattr__(self, "gpu", gpu(self.gpu))
        object.__setattr__(self, "torch", torch_rules(self.torch))
        if check_loss(self.loss) != AS_BUILT and self.compile is not None:
            raise StepError(f"--loss {self.loss} does not take --compile: Dynamo does not trace its deferred head")
        object.__setattr__(self, "routing", str(Routing.parse(self.routing)))
        check_optimizer(self.optimizer)

    def replace(self, **changes) -> StepSpec:
        """This step with `changes` (checked again)."""
        return dataclasses.replace(self, **changes)

    @property
    def per_layer(self) -> bool:
        """Whether each Transformer layer has its own mode."""
        return not isinstance(self.mode, str)

    @property
    def layer_modes(self) -> dict[str, str]:
        """{Transformer layer path: mode} of a per-layer step; {} for one mode for the whole model."""
        return dict(self.mode) if self.per_layer else {}

    @property
    def assignment(self) -> str | dict[str, str]:
        """The mode as planner.layers.patch takes it: a mode's name, or {Transformer layer path: mode}."""
        return self.layer_modes if self.per_layer else self.mode

    @property
    def mode_name(self) -> str:
        """The mode as traces' meta "layers" and the reports name it."""
        return describe_assignment(self.layer_modes) if self.per_layer else self.mode

    def arguments(self) -> str:
        """This step as `memplan trace` options (per-layer modes have no command-line form)."""
        parts = [f"--batch {self.batch}", f"--seq {self.seq}", f"--dtype {self.dtype}"]
        parts += [] if self.device == "cpu" else [f"--device {self.device}"]
        parts += [f"--layers {shlex.quote(self.mode_name)}"] if not self.per_layer else []
        parts += [] if self.loss == AS_BUILT else [f"--loss {self.loss}"]
        parts += [] if self.optimizer == AS_BUILT else [f"--optimizer {self.optimizer}"]
        parts += ["--fake"] if self.fake else []
        parts += [f"--routing {self.routing}"] if self.fake and self.routing != DEFAULT_ROUTING else []
        parts += [] if self.gpu is None else [f"--gpu {shlex.quote(self.gpu.name)}"]
        parts += [] if self.torch is INSTALLED else [f"--torch {self.torch.version}"]
        parts += [] if self.compile is None else [f"--compile --memory-budget {self.compile:g}"]
        parts += [] if self.max_parameters == MAX_PARAMETERS else [f"--max-parameters {self.max_parameters}"]
        return " ".join(parts)

    def on_gpu(self, target: GPU | str | None) -> StepSpec:
        """This step planned for `target` (None: unchanged): a CUDA step (on CUDA's device 0 unless it names one)
        that takes the GPU's rules."""
        if target is None:
            return self
        return self.replace(device=self.device if self.device.startswith("cuda") else "cuda", gpu=target)

    @property
    def name(self) -> str:
        """The step's layer mode, and its loss and optimizer when not as built, as trace files name it: `tempo`,
        `tempo.loss-fused`, `tempo.loss-fused.adamw-8bit` (the optimizer choices' names say what they are)."""
        name = self.mode_name if self.loss == AS_BUILT else f"{self.mode_name}.loss-{self.loss}"
        return name if self.optimizer == AS_BUILT else f"{name}.{self.optimizer}"

    @property
    def parameters_dtype(self) -> str:
        """The torch dtype name of the parameters (build()'s `dtype`)."""
        return PRECISIONS[self.dtype][0]

    @property
    def autocast(self) -> str | None:
        """The torch dtype name forward and loss run under autocast in, or None."""
        return PRECISIONS[self.dtype][1]

    @property
    def window(self) -> str:
        """Which step is recorded, in words: the steady one after its warm-up steps (one, two under DDP), or the
        first."""
        return "one training step after its warm-up" if self.warmup else "the first training step (no warm-up)"

    def describe(self) -> str:
        """The step in words, for progress lines: `batch 2, seq 128, float32, cpu, layers tempo, real tensors` (a fake
        step names a routing rule other than the default)."""
        tensors = "fake tensors" if self.fake else "real tensors"
        tensors += f", routing {self.routing}" if self.fake and self.routing != DEFAULT_ROUTING else ""
        where = self.device if self.gpu is None else f"{self.device} ({self.gpu.name})"
        losses = "" if self.loss == AS_BUILT else f", loss {self.loss}"
        losses += "" if self.optimizer == AS_BUILT else f", optimizer {self.optimizer}"
        return f"batch {self.batch}, seq {self.seq}, {self.dtype}, {where}, layers {self.mode_name}{losses}, {tensors}"


def require_fake_for_routing(routing: str, fake: bool) -> None:
    """StepError for a routing rule other than the default asked of real tensors: a real mixture of experts routes
    by its router's values, only a fake one by a rule."""
    rule = str(Routing.parse(routing))
    if rule != DEFAULT_ROUTING and not fake:
        raise StepError(
            f"--routing {rule}: a routing rule routes fake tensors (--fake, --capture fake or auto); a real step "
            "routes by its router's values"
        )


def check_budget(budget: float) -> float:
    """`budget` if it is an activation memory budget (0 to 1); CompileError otherwise."""
    if not 0.0 <= budget <= 1.0:
        raise CompileError(f"--memory-budget {budget:g}: choose a value from 0 to 1")
    return budget
