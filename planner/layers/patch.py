"""Swap a model's layers for memplan's memory-saving ones in place, report what changed, and swap them back.

Modes: `as-built` changes nothing. `baseline` is Megatron's reference accounting: nn.Dropout becomes a
dropout keeping a 1-byte mask (nn.Dropout on the CPU keeps a noise tensor the size of its input), and
HuggingFace attention that keeps an s x s tensor is computed written out by memplan's reference core
(the same arithmetic, with that 1-byte mask); attention that keeps none (SDPA's fused kernels) stays.
`tempo` adds Tempo's layers (in-place GELU, LayerNorm, RMSNorm, SiLU, gated MLPs rebuilding their
product, attention-dropout recomputation); `selective` recomputes the attention core in backward;
`full` checkpoints every Transformer layer. Parameters are moved, never copied or re-initialised, so an
optimizer built before patching keeps working and a patched model in eval mode computes the same outputs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from torch import nn

from memplan.planner.layers import checkpoint, hf_attention
from memplan.planner.layers.attention import PatchedAttentionCore
from memplan.planner.layers.gated_mlp import GatedMLP
from memplan.planner.layers.gelu import HF_GELU_FORMS, InplaceGELU
from memplan.planner.layers.layernorm import InplaceLayerNorm
from memplan.planner.layers.rmsnorm import InplaceRMSNorm
from memplan.planner.layers.silu import InplaceSiLU
from memplan.planner.workloads.blocks import AttentionCore, Dropout
from memplan.traces.errors import MemplanError
from memplan.traces.model_file import AS_BUILT

MODES = (AS_BUILT, "baseline", "tempo", "selective", "tempo+selective", "full", "tempo+full")
NEUTRAL = (
    nn.Linear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.Embedding,
    nn.Identity,
    nn.Dropout,  # only at p = 0 (nonzero ones are swapped in every mode)
    Dropout,
    AttentionCore,
    PatchedAttentionCore,
    InplaceGELU,
    InplaceLayerNorm,
    InplaceRMSNorm,
    InplaceSiLU,
    GatedMLP,
)  # modules whose memory is not the layer modes' business, or memplan's own
NEUTRAL_NAMES = {"Conv1D", "ColumnParallelLinear", "RowParallelLinear", "ParallelSelfAttention"}
STATE = "_memplan_patch"


class PatchError(MemplanError):
    """A model cannot be patched with the mode asked for."""


@dataclass(frozen=True)
class Swap:
    """One kind of change a mode made: `count` modules of type `original` now computed by `replacement`."""

    original: str  # the module type as built (`GELUActivation`, `LlamaAttention`, `LlamaDecoderLayer`)
    replacement: str  # what computes it now (`InplaceGELU`, `memplan_selective attention`, `checkpoint`)
    count: int


@dataclass
class PatchReport:
    """What `patch` did: the swaps, the module types it left as built, and why it did not do the rest."""

    mode: str
    swapped: list[Swap] = field(default_factory=list)
    left_alone: list[str] = field(default_factory=list)  # types that keep activations, as built
    notes: list[str] = field(default_factory=list)  # what the mode found nothing to do for, and why

    @property
    def changed(self) -> bool:
        """Whether the model differs from the model as built."""
        return bool(self.swapped)

    def count(self, original: str) -> int:
        """How many modules of type `original` were swapped."""
        return sum(s.count for s in self.swapped if s.original == original)

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "changed": self.changed,
            "swapped": [vars(s) for s in self.swapped],
            "left_alone": list(self.left_alone),
            "notes": list(self.notes),
        }


@dataclass
class PatchState:
    """Kept on a patched model so `unpatch` can put every original module and setting back."""

    replaced: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list)
    checkpointing: list[tuple[nn.Module, dict]] = field(default_factory=list)  # checkpoint.restore's argument
    hf_attention: list[tuple[object, str]] = field(default_factory=list)  # (HF config, its _attn_implementation)


def parts(mode: str) -> set[str]:
    """The components of a mode name (`tempo+selective` -> {tempo, selective})."""
    return set(mode.split("+"))


def core_kind(mode: str) -> str:
    """Which attention core a mode uses (selective recomputation makes dropout recomputation moot)."""
    return "selective" if "selective" in parts(mode) else "tempo" if "tempo" in parts(mode) else "baseline"


def replacement(module: nn.Module, mode: str) -> nn.Module | None:
    """The memplan module that replaces `module` under `mode`, or None when it stays."""
    name, from_hf = type(module).__name__, type(module).__module__.startswith("transformers.")
    if type(module) is nn.Dropout and module.p > 0:  # at p = 0 it keeps nothing: nothing to change
        return Dropout(module.p)
    if isinstance(module, AttentionCore) and core_kind(mode) != "baseline":
        return PatchedAttentionCore(module.dropout.p, core_kind(mode))
    if "tempo" not in parts(mode):
        return None
    if type(module) is nn.GELU:
        return InplaceGELU(module.approximate)
    if from_hf and name in HF_GELU_FORMS:
        return InplaceGELU(HF_GELU_FORMS[name])
    if type(module) is nn.LayerNorm:
        return InplaceLayerNorm.from_layernorm(module)
    if type(module) is nn.SiLU or (from_hf and name in InplaceSiLU.HF_NAMES):
        return InplaceSiLU()
    return InplaceRMSNorm.from_module(module) or GatedMLP.from_module(module)


def is_attention(module: nn.Module) -> bool:
    """Whether `module` computes an attention core itself (not through a memplan core it contains)."""
    if hf_attention.uses_registry(module):
        return True
    cores = (AttentionCore, PatchedAttentionCore)
    inner = (m for m in module.modules() if m is not module)
    return "Attention" in type(module).__name__ and not any(
        isinstance(m, cores) or hf_attention.uses_registry(m) for m in inner
    )


def keeps_activations(module: nn.Module) -> bool:
    """Whether `module` itself keeps tensors for backward that a layer mode is about: leaves and attention
    modules that are not neutral (containers only pass their children's tensors on)."""
    name = type(module).__name__
    if isinstance(module, NEUTRAL) or name in NEUTRAL_NAMES or name.endswith("RotaryEmbedding"):
        return False  # rotary embeddings compute their angles without gradients
    return is_attention(module) or next(module.children(), None) is None


def check_mode(mode: str) -> str:
    """`mode` if it is one of MODES; PatchError naming the choices otherwise."""
    if mode not in MODES:
        raise PatchError(f"unknown layers mode {mode!r}; choose one of {', '.join(MODES)}")
    return mode


def device_type(model: nn.Module) -> str:
    """The device type of the model's first parameter (cpu when it has none)."""
    first = next(model.parameters(), None)
    return first.device.type if first is not None else "cpu"


def swap_modules(module: nn.Module, mode: str, state: PatchState, swaps: Counter, done: dict) -> None:
    """Replace `module`'s descendants for `mode`, outermost first (a replaced module's children are not visited)."""
    for name, child in list(module.named_children()):
        new = done.get(id(child)) or replacement(child, mode)
        if new is None:
            swap_modules(child, mode, state, swaps, done)
            continue
        done[id(child)] = new
        new.train(child.training)
        setattr(module, name, new)
        state.replaced.append((module, name, child))
        swaps[type(child).__name__, type(new).__name__] += 1


def switch_attention(model: nn.Module, mode: str, state: PatchState, swaps: Counter) -> list[str]:
    """Point HuggingFace attention that keeps an s x s tensor at memplan's core for `mode` (every config that
    holds such modules: T5's encoder and decoder each have their own); the notes say which attention
    modules have nothing to give."""
    modules = [m for m in model.modules() if hf_attention.uses_registry(m)]
    if not modules or mode == AS_BUILT:
        return []
    if any(getattr(m, "reorder_and_upcast_attn", False) for m in modules):
        raise PatchError(
            "GPT-2's reorder_and_upcast_attn computes attention in fp32 its own way; "
            "memplan's attention cores would change its numbers: turn it off to patch"
        )
    device = device_type(model)
    configs = {id(m.config): m.config for m in modules if hf_attention.keeps_square(m, device)}
    fused = [m for m in modules if id(m.config) not in configs]
    notes = []
    if fused:
        kinds = sorted({type(m).__name__ for m in fused})
        notes.append(
            f"attention left as built: {', '.join(kinds)} uses {fused[0].config._attn_implementation} with no "
            f"dropout on {device} ({hf_attention.FUSED} keeps no s x s tensor), so there is nothing to recompute"
        )
    if configs:
        registered = hf_attention.register(core_kind(mode))
        for config in configs.values():
            state.hf_attention.append((config, config._attn_implementation))
            config._attn_implementation = registered
        for m in modules:
            if id(m.config) in configs:
                swaps[type(m).__name__, f"{registered} attention"] += 1
    return notes


def checkpoint_layers(model: nn.Module, state: PatchState, swaps: Counter) -> list[str]:
    """Checkpoint every Transformer layer (the `full` part of a mode); a note when the model has no layer list."""
    layers, state.checkpointing = checkpoint.enable(model)
    if not layers:
        return ["full: no list of Transformer layers found, nothing checkpointed"]
    for layer in layers:
        swaps[type(layer).__name__, "checkpoint"] += 1
    return []


def patch(model: nn.Module, mode: str) -> PatchReport:
    """Swap `model`'s layers in place for `mode` (one of MODES) and say what changed; undoes any earlier
    patch first."""
    check_mode(mode)
    unpatch(model)
    state, swaps = PatchState(), Counter()
    # 1. The attention setting first: it is the only step that can refuse the model, and nothing is swapped yet.
    notes = switch_attention(model, mode, state, swaps)
    # 2. Leaf modules and gated MLPs; 3. whole layers checkpointed.
    if mode != AS_BUILT:
        swap_modules(model, mode, state, swaps, {})
    if "full" in parts(mode):
        notes += checkpoint_layers(model, state, swaps)
    # 4. The report: every swap, and the types that keep activations as built.
    swapped_types = {original for original, _ in swaps}
    left = sorted({type(m).__name__ for m in model.modules() if keeps_activations(m)} - swapped_types)
    if "selective" in parts(mode) and not notes and not any("selective" in new for _, new in swaps):
        notes.append("selective: nothing to recompute: no attention core here keeps an s x s tensor memplan can reach")
    object.__setattr__(model, STATE, state)
    swapped = [Swap(original, new, n) for (original, new), n in sorted(swaps.items())]
    return PatchReport(mode, swapped, left, notes)


@dataclass(frozen=True)
class LayerMode:
    """A layer mode, checked when named and applied by calling it on a model: what a trace of a model file
    takes as its `layers` (a traces.model_file.ModelPatch), so a wrong name fails before build() runs.
    Calling it returns the patch report as a dict, which the trace keeps in meta "patch"."""

    name: str  # one of MODES

    def __post_init__(self) -> None:
        check_mode(self.name)

    def __call__(self, model: nn.Module) -> dict:
        return patch(model, self.name).to_dict()


def unpatch(model: nn.Module) -> int:
    """Put back every module `patch` replaced, the checkpointing and HuggingFace's attention setting;
    returns how many modules."""
    state: PatchState | None = model.__dict__.pop(STATE, None)
    if state is None:
        return 0
    for parent, name, original in reversed(state.replaced):
        original.train(getattr(parent, name).training)
        setattr(parent, name, original)
    checkpoint.restore(state.checkpointing)
    for config, implementation in state.hf_attention:
        config._attn_implementation = implementation
    return len(state.replaced) + len(state.checkpointing)
