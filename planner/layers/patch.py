"""Swap a model's layers for memplan's memory-saving ones in place, report what changed, and swap them back.

Modes: `as-built` changes nothing. `baseline` is Megatron's reference accounting: nn.Dropout becomes a
dropout keeping a 1-byte mask (nn.Dropout on the CPU keeps a noise tensor the size of its input), and
HuggingFace attention that keeps an s x s tensor is computed written out by memplan's reference core
(the same arithmetic, with that 1-byte mask); attention that keeps none (SDPA's fused kernels) stays.
`tempo` adds Tempo's layers (in-place GELU, LayerNorm, RMSNorm, SiLU, gated MLPs rebuilding their
product, attention-dropout recomputation); `selective` recomputes the attention core in backward;
`full` checkpoints every Transformer layer; `offload` moves what each Transformer layer saves for backward to
host memory (planner/layers/offload.py). Parameters are moved, never copied or re-initialised, so an
optimizer built before patching keeps working and a patched model in eval mode computes the same outputs.

Per layer, `patch(model, {layer path: mode})` does to each Transformer layer named (`transformer_layers`) what
its mode (one of PER_LAYER_MODES) does to every layer, and leaves the other layers and every module outside
the layers (embeddings, final norm, head) as built.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn

from memplan.errors import PatchError
from memplan.modes import (
    AS_BUILT,
    BASELINE,
    OFFLOAD,
    PER_LAYER,
    SELECTIVE,
    Mode,
    check_layer_modes,
    mode,
    spans,
)
from memplan.planner.layers import activations, checkpoint, hf_attention, hf_attention_check, offload
from memplan.planner.layers.attention import PatchedAttentionCore
from memplan.planner.layers.baseline import AttentionCore, Dropout
from memplan.planner.layers.gated_mlp import GatedMLP
from memplan.planner.layers.gelu import InplaceGELU
from memplan.planner.layers.layernorm import InplaceLayerNorm
from memplan.planner.layers.reversible import ReversibleBlock
from memplan.planner.layers.rmsnorm import InplaceRMSNorm
from memplan.planner.layers.silu import InplaceSiLU

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

    @classmethod
    def from_dict(cls, data: dict) -> PatchReport:
        """A report back from `to_dict`'s data (a trace's meta "patch"); a per-layer one as a LayerModesReport."""
        swapped = [Swap(**swap) for swap in data["swapped"]]
        common = (data["mode"], swapped, list(data["left_alone"]), list(data["notes"]))
        return LayerModesReport(*common, dict(data["layers"])) if "layers" in data else cls(*common)


@dataclass
class LayerModesReport(PatchReport):
    """What a per-layer `patch` did: PatchReport's account, and the mode it gave each layer."""

    layers: dict[str, str] = field(default_factory=dict)  # Transformer layer path -> mode

    def to_dict(self) -> dict:
        return {**super().to_dict(), "layers": dict(self.layers)}


@dataclass
class PatchState:
    """Kept on a patched model so `unpatch` can put every original module and setting back."""

    replaced: list[tuple[nn.Module, str, nn.Module]] = field(default_factory=list)
    checkpointing: list[tuple[nn.Module, dict]] = field(default_factory=list)  # checkpoint.restore's argument
    hf_attention: list[tuple[object, str]] = field(default_factory=list)  # (HF config, its _attn_implementation)
    routed: list[nn.Module] = field(default_factory=list)  # attention modules with an hf_attention.CHOICE
    offloading: list[tuple[nn.Module, object]] = field(default_factory=list)  # offload.restore's argument
    host: offload.HostLedger | None = None  # the host copies of the offloaded layers, when any is


def replacement(module: nn.Module, chosen: Mode) -> nn.Module | None:
    """The memplan module that replaces `module` under the mode `chosen` (not as-built), or None when it stays:
    tempo's layers replace the modules proven (by what they compute, not their class names) to be what they
    compute."""
    if type(module) is nn.Dropout and module.p > 0:  # at p = 0 it keeps nothing: nothing to change
        return Dropout(module.p)
    if isinstance(module, AttentionCore) and chosen.core != BASELINE:
        return PatchedAttentionCore(module.dropout.p, chosen.core)
    if not chosen.tempo or isinstance(module, NEUTRAL):
        return None
    if type(module) is nn.LayerNorm:
        return InplaceLayerNorm.from_layernorm(module)
    activation = activations.activation_of(module)
    if activation is not None:
        return activations.inplace(activation)
    return InplaceRMSNorm.from_module(module) or GatedMLP.from_module(module)


def core_of(module: nn.Module) -> str | None:
    """The kind of memplan core `module` computes attention with (as a PatchedAttentionCore, or HuggingFace attention
    pointed at one), None when none."""
    return module.kind if isinstance(module, PatchedAttentionCore) else hf_attention.memplan_core(module)


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


def transformer_layers(model: nn.Module) -> list[str]:
    """The module paths of `model`'s Transformer layers, in order (`layers.0`, `model.layers.0`): the keys of a
    per-layer `patch`."""
    paths = {id(module): path for path, module in model.named_modules()}
    return [paths[id(layer)] for layers in checkpoint.layer_lists(model) for layer in layers]


def check_layer_paths(model: nn.Module, modes: dict[str, str]) -> dict[str, str]:
    """`modes` if every path in it is one of `model`'s Transformer layers; PatchError naming them otherwise."""
    layers = transformer_layers(model)
    unknown = [path for path in modes if path not in layers]
    if unknown:
        choices = ", ".join(spans(layers)) or "none (it has no list of Transformer layers)"
        raise PatchError(f"{unknown[0]!r} is not a Transformer layer of this model; its layers: {choices}")
    return modes


def assignment(model: nn.Module, modes: str | Mapping[str, str]) -> tuple[str, dict[str, str]]:
    """`modes` checked, as the mode of the modules outside the layers it names and the mode of each layer it names."""
    if isinstance(modes, str):
        return mode(modes).name, {}
    return AS_BUILT, check_layer_paths(model, check_layer_modes(modes))


def module_modes(model: nn.Module, rest: str, layers: dict[str, str]) -> dict[int, str]:
    """The mode of each of `model`'s modules, by id: that of the layer in `layers` holding it, else `rest`."""
    modes = {id(module): rest for module in model.modules()}
    named = dict(model.named_modules())
    for path, name in layers.items():
        modes.update((id(module), name) for module in named[path].modules())
    return modes


def device_type(model: nn.Module) -> str:
    """The device type of the model's first parameter (cpu when it has none)."""
    first = next(model.parameters(), None)
    return first.device.type if first is not None else "cpu"


def swap_modules(module: nn.Module, modes: dict[int, str], state: PatchState, swaps: Counter, done: dict) -> None:
    """Replace `module`'s descendants for their modes (`module_modes`), outermost first (a replaced module's
    children are not visited); as-built ones stay."""
    for name, child in list(module.named_children()):
        chosen = mode(modes[id(child)])
        new = done.get(id(child)) or (replacement(child, chosen) if chosen.patches else None)
        if new is None:
            swap_modules(child, modes, state, swaps, done)
            continue
        done[id(child)] = new
        new.train(child.training)
        setattr(module, name, new)
        state.replaced.append((module, name, child))
        swaps[type(child).__name__, type(new).__name__] += 1


def switch_attention(model: nn.Module, modes: dict[int, str], state: PatchState, swaps: Counter) -> list[str]:
    """Point HuggingFace attention that keeps an s x s tensor, where its mode is not as-built, at memplan's core for
    that mode, through every config that holds such modules (T5's encoder and decoder each have their own); the
    notes say which attention modules have nothing to give."""
    modules = [m for m in model.modules() if hf_attention.uses_registry(m)]
    patched = [m for m in modules if modes[id(m)] != AS_BUILT]
    if not patched:
        return []
    if any(getattr(m, "reorder_and_upcast_attn", False) for m in modules):
        raise PatchError(
            "GPT-2's reorder_and_upcast_attn computes attention in fp32 its own way; "
            "memplan's attention cores would change its numbers: turn it off to patch"
        )
    # 1. The function each module is to call: memplan's core for its mode where it keeps an s x s tensor and the core
    #    computes what it computes, else its own.
    device = device_type(model)
    fused = [m for m in patched if not hf_attention.keeps_square(m, device)]
    fused_ids = {id(m) for m in fused}
    refused = {id(m): hf_attention_check.mismatch(m) for m in patched if id(m) not in fused_ids}
    refused = {key: reason for key, reason in refused.items() if reason is not None}
    routed = [m for m in patched if id(m) not in fused_ids and id(m) not in refused]
    cores = {id(m): hf_attention.register(mode(modes[id(m)]).core) for m in routed}
    functions = {id(m): cores.get(id(m), m.config._attn_implementation) for m in modules}
    # 2. The configs whose modules are to call another function; where they differ, each must name one it can call.
    groups = [
        group
        for group in config_groups(modules)
        if functions_of(group, functions) != {group[0].config._attn_implementation}
    ]
    for group in groups:
        check_dispatch(group, functions)
    # 3. Each config set to its modules' one function, or to the dispatching one.
    for group in groups:
        switch_config(group, functions, state)
    for m in routed:
        swaps[type(m).__name__, f"{cores[id(m)]} attention"] += 1
    notes = [f"attention left as built: {reason}" for reason in dict.fromkeys(refused.values())]
    if not fused:
        return notes
    kinds = sorted({type(m).__name__ for m in fused})
    return notes + [
        f"attention left as built: {', '.join(kinds)} uses {fused[0].config._attn_implementation} with no "
        f"dropout on {device} ({hf_attention.FUSED} keeps no s x s tensor), so there is nothing to recompute"
    ]


def config_groups(modules: list[nn.Module]) -> list[list[nn.Module]]:
    """`modules` grouped by the HuggingFace config they share (the one whose attention setting they read)."""
    groups: dict[int, list[nn.Module]] = {}
    for m in modules:
        groups.setdefault(id(m.config), []).append(m)
    return list(groups.values())


def functions_of(modules: list[nn.Module], functions: dict[int, str]) -> set[str]:
    """The attention functions `modules` are to call, by registry name."""
    return {functions[id(m)] for m in modules}


def check_dispatch(modules: list[nn.Module], functions: dict[int, str]) -> None:
    """PatchError, before anything changes, when modules of one config are to call different functions and one of
    them has none memplan can call for it."""
    if len(functions_of(modules, functions)) == 1:
        return
    for m in modules:
        try:
            hf_attention.attention_function(m, functions[id(m)])
        except hf_attention.AttentionPatchError as error:
            raise PatchError(f"per-layer modes cannot reach {type(m).__name__}'s attention: {error}") from None


def switch_config(modules: list[nn.Module], functions: dict[int, str], state: PatchState) -> None:
    """Set the config `modules` share to the one function they call, or, when they call different ones (layers in
    different modes), to hf_attention's dispatching function with each module naming its own."""
    config, names = modules[0].config, functions_of(modules, functions)
    state.hf_attention.append((config, config._attn_implementation))
    if len(names) == 1:
        config._attn_implementation = names.pop()
        return
    config._attn_implementation = hf_attention.register_dispatch()
    for m in modules:
        setattr(m, hf_attention.CHOICE, functions[id(m)])
        state.routed.append(m)


def checkpoint_layers(model: nn.Module, modes: dict[int, str], state: PatchState, swaps: Counter) -> list[str]:
    """Checkpoint the Transformer layers whose mode is `full` or `tempo+full`, except reversible blocks (which keep
    nothing to checkpoint); a note when the model's mode asks for it and it has no layer list, or when a reversible
    block was asked for it."""
    layers = [layer for layers in checkpoint.layer_lists(model) for layer in layers]
    asked = [layer for layer in layers if mode(modes[id(layer)]).checkpoints]
    checkpointed = [layer for layer in asked if not isinstance(layer, ReversibleBlock)]
    if not layers and mode(modes[id(model)]).checkpoints:
        return ["full: no list of Transformer layers found, nothing checkpointed"]
    if checkpointed:
        state.checkpointing = checkpoint.enable(model, checkpointed)
    for layer in checkpointed:
        swaps[type(layer).__name__, "checkpoint"] += 1
    if len(checkpointed) < len(asked):
        return ["full: reversible layers keep no activations; nothing to checkpoint"]
    return []


def offload_layers(model: nn.Module, modes: dict[int, str], state: PatchState, swaps: Counter) -> list[str]:
    """Offload the saved tensors of the Transformer layers whose mode offloads (around whatever else their mode
    did); a note when the model's mode asks for it and it has no layer list."""
    paths = {id(module): path for path, module in model.named_modules()}
    layers = [layer for layers in checkpoint.layer_lists(model) for layer in layers]
    asked = {paths[id(layer)]: layer for layer in layers if mode(modes[id(layer)]).offloads}
    if not layers and mode(modes[id(model)]).offloads:
        return [f"{OFFLOAD}: no list of Transformer layers found, nothing offloaded"]
    if asked:
        state.host = offload.HostLedger()
        state.offloading = offload.enable(asked, state.host)
    for layer in asked.values():
        swaps[type(layer).__name__, OFFLOAD] += 1
    return []


def host_ledger(model: nn.Module) -> offload.HostLedger | None:
    """The ledger of host copies of `model`'s offloaded layers; None when `patch` offloaded none."""
    state: PatchState | None = model.__dict__.get(STATE)
    return state.host if state is not None else None


def patch(model: nn.Module, modes: str | Mapping[str, str]) -> PatchReport:
    """Swap `model`'s layers in place and say what changed; undoes any earlier patch first. `modes` is one of MODES
    for the whole model, or {Transformer layer path (`transformer_layers`): one of PER_LAYER_MODES}, the layers not
    named and every module outside the layers as built."""
    # 1. The modes, checked before anything changes: the one outside the layers named, and each named layer's.
    rest, layers = assignment(model, modes)
    unpatch(model)
    state, swaps, by_module = PatchState(), Counter(), module_modes(model, rest, layers)
    # 2. The attention setting: the only step that can refuse the model, and nothing is swapped yet.
    notes = switch_attention(model, by_module, state, swaps)
    # 3. Leaf modules and gated MLPs; 4. whole layers checkpointed.
    swap_modules(model, by_module, state, swaps, {})
    notes += checkpoint_layers(model, by_module, state, swaps)
    notes += offload_layers(model, by_module, state, swaps)
    object.__setattr__(model, STATE, state)
    # 5. The report: every swap, and the types of the modules that keep activations as built.
    left = sorted({type(m).__name__ for m in model.modules() if keeps_activations(m) and core_of(m) is None})
    selective = any(mode(name).recomputes_attention for name in (rest, *layers.values()))
    if selective and not notes and not any(core_of(m) == SELECTIVE for m in model.modules()):
        notes.append("selective: nothing to recompute: no attention core here keeps an s x s tensor memplan can reach")
    swapped = [Swap(original, new, n) for (original, new), n in sorted(swaps.items())]
    if isinstance(modes, str):
        return PatchReport(rest, swapped, left, notes)
    return LayerModesReport(PER_LAYER, swapped, left, notes, layers)


def idle_notes(model: nn.Module) -> list[str]:
    """Notes, after a step has run uncompiled, on tempo's activations that saved nothing: never called (Mamba's
    mixer calls F.silu, not its activation module), or every call kept its input, a view of a larger tensor that
    stays alive anyway (`inverse.keeps_input` counts)."""
    swapped = [m for m in model.modules() if isinstance(m, (InplaceGELU, InplaceSiLU))]
    never = sorted({type(m).__name__ for m in swapped if not getattr(m, "calls", 0)})
    views = sorted({type(m).__name__ for m in swapped if getattr(m, "calls", 0) and m.kept_views == m.calls})
    notes = [f"tempo: {', '.join(never)} never called in the step (the model computes it otherwise)"] if never else []
    if views:
        notes.append(
            f"tempo: {', '.join(views)} kept its input in every call (a view of a larger tensor, alive anyway), "
            "so it saves nothing in this model"
        )
    return notes


def leaves_as_built(model: nn.Module) -> bool:
    """Whether `patch` left `model` exactly as built: nothing swapped, checkpointed, offloaded or set, and no module
    that `idle_notes` speaks of. Its step is then the model as built's, allocation for allocation (`memplan run` takes
    the as-built trace for such a mode instead of tracing the same step again)."""
    state: PatchState | None = model.__dict__.get(STATE)
    if state is not None and (
        state.replaced or state.checkpointing or state.hf_attention or state.routed or state.offloading or state.host
    ):
        return False
    return not any(isinstance(m, (InplaceGELU, InplaceSiLU)) for m in model.modules())


def unpatch(model: nn.Module) -> int:
    """Put back every module `patch` replaced, the checkpointing and HuggingFace's attention setting (and the
    function each attention module named); returns how many modules."""
    state: PatchState | None = model.__dict__.pop(STATE, None)
    if state is None:
        return 0
    for parent, name, original in reversed(state.replaced):
        original.train(getattr(parent, name).training)
        setattr(parent, name, original)
    offload.restore(state.offloading)
    checkpoint.restore(state.checkpointing)
    for config, implementation in state.hf_attention:
        config._attn_implementation = implementation
    for module in state.routed:
        module.__dict__.pop(hf_attention.CHOICE, None)
    return len(state.replaced) + len(state.checkpointing) + len(state.offloading)
