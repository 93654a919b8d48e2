"""The layer modes: the one registry of what each mode is made of, what it replaces and how, and whether
`memplan optimize` offers it per layer. Everything that lists, parses, describes or applies a mode reads it
here (planner/layers/patch.py applies the parts, planner/layers/memory.py derives their bytes from the parts).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import groupby

from memplan.errors import PatchError

# The parts a mode is made of: each names one kind of change to a model, applied by planner/layers/patch.py.
BASELINE = "baseline"  # Megatron's reference accounting: 1-byte dropout masks, written-out attention cores
TEMPO = "tempo"  # Tempo's in-place activations and norms, gated MLPs rebuilt in backward, dropout recomputed
SELECTIVE = "selective"  # Megatron's selective recomputation: the attention core recomputed in backward
FULL = "full"  # every Transformer layer checkpointed
OFFLOAD = "offload"  # the tensors a Transformer layer saves for backward moved to host memory, brought back in backward
PARTS = (BASELINE, TEMPO, SELECTIVE, FULL, OFFLOAD)

AS_BUILT = "as-built"  # the model as its file builds it: no part, nothing patched
PER_LAYER = "per-layer"  # the name of an assignment giving each Transformer layer its own mode
JOIN = "+"  # between the parts of a name beyond baseline: tempo+selective


@dataclass(frozen=True)
class Mode:
    """One layer mode: its parts and what they change. Its activation bytes per layer follow from its parts
    (planner/layers/memory.py); as-built has none, so no formula."""

    name: str  # as the command line and the traces' meta spell it
    parts: frozenset[str]  # of PARTS; every mode but as-built includes BASELINE
    replaces: str  # what it swaps, and how, in a sentence (the command line's help and the patch report)
    per_layer: bool  # whether one Transformer layer may have it alone (baseline accounts for a whole model)
    optimize: bool  # whether `memplan optimize` offers it per layer
    swept: bool  # whether `memplan run`, `fit` and `tradeoff` try it when no mode is named

    @property
    def patches(self) -> bool:
        """Whether the mode changes the model at all."""
        return bool(self.parts)

    @property
    def tempo(self) -> bool:
        """Whether Tempo's in-place layers are swapped in."""
        return TEMPO in self.parts

    @property
    def recomputes_attention(self) -> bool:
        """Whether the attention core is recomputed in backward (Megatron's selective recomputation)."""
        return SELECTIVE in self.parts

    @property
    def checkpoints(self) -> bool:
        """Whether every Transformer layer is checkpointed."""
        return FULL in self.parts

    @property
    def offloads(self) -> bool:
        """Whether each Transformer layer's saved tensors go to host memory between its forward and its backward."""
        return OFFLOAD in self.parts

    @property
    def resident(self) -> str:
        """The name of the mode without offload: what a layer saves, kept on the device (itself if it offloads
        nothing)."""
        return _name(tuple(sorted(self.parts - {OFFLOAD}, key=PARTS.index)))

    @property
    def core(self) -> str | None:
        """The attention core the mode computes with (one of BASELINE, TEMPO, SELECTIVE; selective recomputation
        makes dropout recomputation moot), None for the model as built."""
        if not self.parts:
            return None
        return SELECTIVE if self.recomputes_attention else TEMPO if self.tempo else BASELINE


def _name(parts: tuple[str, ...]) -> str:
    return JOIN.join(p for p in parts if p != BASELINE) or (BASELINE if parts else AS_BUILT)


def _mode(parts: tuple[str, ...], replaces: str, per_layer: bool = True, optimize: bool = True) -> Mode:
    name = _name(parts)
    swept = OFFLOAD not in parts  # offload's time is the host link's: named, not swept, until tradeoff adds it
    return Mode(name, frozenset(parts), replaces, per_layer, optimize and swept, swept)


REGISTRY: dict[str, Mode] = {
    mode.name: mode
    for mode in (
        _mode((), "the model as its file builds it, nothing patched"),
        _mode(
            (BASELINE,),
            "Megatron's reference accounting: nn.Dropout keeps a 1-byte mask (the CPU's keeps a noise tensor), and "
            "HuggingFace attention that keeps an s x s tensor is written out by memplan's reference core (same "
            "arithmetic); SDPA's fused attention stays",
            per_layer=False,
            optimize=False,
        ),
        _mode(
            (BASELINE, TEMPO),
            "baseline plus Tempo's in-place GELU, LayerNorm, RMSNorm and SiLU, gated MLPs that rebuild their "
            "product in backward, and attention-dropout recomputation",
        ),
        _mode((BASELINE, SELECTIVE), "baseline plus the attention core recomputed in backward"),
        _mode((BASELINE, TEMPO, SELECTIVE), "tempo and selective together"),
        _mode((BASELINE, FULL), "baseline plus every Transformer layer checkpointed"),
        _mode((BASELINE, TEMPO, FULL), "tempo plus every Transformer layer checkpointed", optimize=False),
        # Offload composes with the parts that change what a layer saves (less to move), not with full: a
        # checkpointed layer saves its input in checkpoint's own frame, out of reach of the layer's hooks.
        _mode(
            (BASELINE, OFFLOAD),
            "baseline plus each Transformer layer's saved tensors (not its parameters) moved to host memory after "
            "its forward and brought back for its backward",
        ),
        _mode((BASELINE, TEMPO, OFFLOAD), "tempo plus each Transformer layer's saved tensors offloaded to the host"),
        _mode(
            (BASELINE, SELECTIVE, OFFLOAD),
            "selective plus each Transformer layer's saved tensors offloaded to the host",
        ),
    )
}
MODES = tuple(REGISTRY)  # every mode, in the order tables list them
PER_LAYER_MODES = tuple(name for name, mode in REGISTRY.items() if mode.per_layer)
OPTIMIZE_MODES = tuple(name for name, mode in REGISTRY.items() if mode.optimize)  # a layer's choices in optimize
SWEPT_MODES = tuple(name for name, mode in REGISTRY.items() if mode.swept)  # run, fit and tradeoff's default
REPLAYED_MODE = REGISTRY[TEMPO].name  # the mode whose plan `memplan run` replays


def mode(name: str) -> Mode:
    """The registered mode called `name`; PatchError naming the choices otherwise."""
    if not isinstance(name, str) or name not in REGISTRY:
        raise PatchError(f"unknown layers mode {name!r}; choose one of {', '.join(MODES)}")
    return REGISTRY[name]


def check_layer_modes(modes: Mapping[str, str]) -> dict[str, str]:
    """`modes` as a dict if it maps layer paths to PER_LAYER_MODES; PatchError naming the choices otherwise."""
    if not isinstance(modes, Mapping):
        raise PatchError(
            f"layers modes must be a mode name or a {{layer path: mode}} mapping, not {type(modes).__name__}"
        )
    for path, name in modes.items():
        if name not in PER_LAYER_MODES:
            raise PatchError(
                f"layer {path!r}: {name!r} is not a per-layer mode; choose one of {', '.join(PER_LAYER_MODES)}"
            )
    return dict(modes)


def spans(paths: list[str]) -> list[str]:
    """`paths` written short: consecutive layers of one list as one span (`layers.0-3`)."""
    runs: list[tuple[str, int, int]] = []  # (`layers.`, 0, 3); a path ending in no number: (path, -1, -1)
    for path in paths:
        number = path.rpartition(".")[2]
        head, index = (path.removesuffix(number), int(number)) if number.isdigit() else (path, -1)
        if index >= 0 and runs and runs[-1][0] == head and runs[-1][2] == index - 1:
            runs[-1] = (head, runs[-1][1], index)
        else:
            runs.append((head, index, index))
    return [
        head if first < 0 else f"{head}{first}" if first == last else f"{head}{first}-{last}"
        for head, first, last in runs
    ]


def describe_assignment(modes: Mapping[str, str]) -> str:
    """Per-layer modes in a line, runs of layers in one mode as spans: `per-layer: layers.0-1 full, layers.2 tempo`."""
    runs = groupby(modes.items(), key=lambda item: item[1])
    described = [f"{', '.join(spans([path for path, _ in run]))} {name}" for name, run in runs]
    return f"{PER_LAYER}: {', '.join(described)}" if described else PER_LAYER


def modes_help() -> str:
    """Every mode and what it does, for the command line's help."""
    return " ".join(f"{name}: {mode.replaces}." for name, mode in REGISTRY.items())


# The loss of a step, chosen once per step (not per layer): as built, or the fused linear cross-entropy of
# planner/layers/fused_loss.py, which never holds a causal LM's whole logits (planner/layers/loss_patch.py applies
# it). As built is the same AS_BUILT as the layer modes': nothing patched.
FUSED = "fused"
LOSSES: dict[str, str] = {
    AS_BUILT: "the model's own loss: the head's logits whole, then cross-entropy",
    FUSED: "the head and cross-entropy fused in chunks of rows: the logits never exist whole (HuggingFace causal "
    "LMs called with labels, and memplan's own decoders)",
}


def check_loss(name: str) -> str:
    """`name` if it is a registered loss; PatchError naming the choices otherwise."""
    if not isinstance(name, str) or name not in LOSSES:
        raise PatchError(f"unknown loss {name!r}; choose one of {', '.join(LOSSES)}")
    return name


def losses_help() -> str:
    """Every loss and what it does, for the command line's help."""
    return " ".join(f"{name}: {what}." for name, what in LOSSES.items())


# The optimizer of a step, chosen once per step: the model file's as built, or its AdamW (or Adam) rebuilt with the
# same parameter groups and hyperparameters as one that keeps its state smaller on the device
# (planner/layers/optimizer_choice.py converts it). As built is the same AS_BUILT as the layer modes'.
ADAMW_8BIT, ADAMW_4BIT, ADAMW_HOST = "adamw-8bit", "adamw-4bit", "adamw-host"
OPTIMIZERS: dict[str, str] = {
    AS_BUILT: "the model file's optimizer as built()",
    ADAMW_8BIT: "AdamW with both moments block-wise quantized to 8 bits (torchao's AdamW8bit layout: blocks of 256, "
    "an fp32 scale per block, a dynamic-tree map)",
    ADAMW_4BIT: "AdamW with both moments block-wise quantized to 4 bits, two per byte (torchao's AdamW4bit layout: "
    "blocks of 128, an fp32 scale per block)",
    ADAMW_HOST: "AdamW with its state and its fp32 step on the host (CPU offload): the device holds the parameters "
    "and gradients only",
}


def check_optimizer(name: str) -> str:
    """`name` if it is a registered optimizer choice; PatchError naming the choices otherwise."""
    if not isinstance(name, str) or name not in OPTIMIZERS:
        raise PatchError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    return name


def optimizers_help() -> str:
    """Every optimizer choice and what it does, for the command line's help."""
    return " ".join(f"{name}: {what}." for name, what in OPTIMIZERS.items())
