"""Swap a model's GELU, LayerNorm, dropout and attention core for memplan's layers in place, and swap them back.

Works on the bundled workloads (`planner.workloads`) and on HuggingFace BertModel / GPT2Model
built from configs. Parameters and buffers are moved, never copied or re-initialised, so an
optimizer built before patching keeps working and a patched model in eval mode computes the same
outputs. HuggingFace attention is switched through its attention-function registry.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from torch import nn

from memplan.planner.layers.attention import CORES, PatchedAttentionCore
from memplan.planner.layers.gelu import InplaceGELU
from memplan.planner.layers.layernorm import InplaceLayerNorm
from memplan.planner.workloads.blocks import AttentionCore, Dropout
from memplan.traces.errors import MemplanError

MODES = ("baseline", "tempo", "selective", "tempo+selective")
HF_GELU_FORMS = {"GELUActivation": "none", "NewGELUActivation": "tanh", "GELUTanh": "tanh"}
HF_ATTENTION = {"BertSelfAttention", "GPT2Attention"}
HF_CONTAINERS = {"BertAttention"}
NEUTRAL = (
    nn.Linear,
    nn.Embedding,
    nn.Identity,
    nn.Tanh,
    Dropout,
    InplaceGELU,
    InplaceLayerNorm,
    PatchedAttentionCore,
    AttentionCore,
)
NEUTRAL_NAMES = {
    "Conv1D",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ParallelSelfAttention",
}  # parallel: planner.parallel
STATE = "_memplan_patch"


class PatchError(MemplanError):
    """A model cannot be patched with the mode asked for."""


@dataclass
class PatchReport:
    """What `patch` did: the mode, how many modules of each type it swapped, and the module types it did not know."""

    mode: str
    swapped: dict[str, int] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"mode": self.mode, "swapped": dict(self.swapped), "unknown": list(self.unknown)}


@dataclass
class PatchState:
    """Kept on a patched model so `unpatch` can put every original module and the attention setting back."""

    replaced: list[tuple[nn.Module, str, nn.Module]]
    hf_config: object | None = None
    hf_attention: str | None = None


def core_kind(mode: str) -> str:
    """Which attention core a mode uses (selective recomputation makes dropout recomputation moot)."""
    return "selective" if "selective" in mode else "tempo" if mode == "tempo" else "baseline"


def replacement(module: nn.Module, mode: str) -> nn.Module | None:
    """The memplan module that replaces `module` under `mode`, or None when it stays."""
    tempo = mode.startswith("tempo")
    name = type(module).__name__
    if type(module) is nn.Dropout:
        return Dropout(module.p)
    if tempo and type(module) is nn.GELU:
        return InplaceGELU(module.approximate)
    if tempo and name in HF_GELU_FORMS and type(module).__module__.startswith("transformers."):
        return InplaceGELU(HF_GELU_FORMS[name])
    if tempo and type(module) is nn.LayerNorm:
        return InplaceLayerNorm.from_layernorm(module)
    if isinstance(module, AttentionCore) and core_kind(mode) != "baseline":
        return PatchedAttentionCore(module.dropout.p, core_kind(mode))
    return None


def is_known(module: nn.Module) -> bool:
    """Whether patch knows what `module` keeps for backward (containers count as known; their leaves are checked)."""
    name = type(module).__name__
    if isinstance(module, NEUTRAL) or name in NEUTRAL_NAMES or name in HF_ATTENTION or name in HF_CONTAINERS:
        return True
    if type(module) in (nn.Dropout, nn.GELU, nn.LayerNorm) or name in HF_GELU_FORMS:
        return True
    if "Attention" in name:  # an attention block is known when its core is memplan's
        return any(isinstance(c, (AttentionCore, PatchedAttentionCore)) for c in module.children())
    return next(module.children(), None) is not None


def check_mode(mode: str) -> str:
    """`mode` if it is one of MODES; PatchError naming the choices otherwise."""
    if mode not in MODES:
        raise PatchError(f"unknown layers mode {mode!r}; choose one of {', '.join(MODES)}")
    return mode


def patch(model: nn.Module, mode: str) -> PatchReport:
    """Swap `model`'s layers in place for `mode` (baseline, tempo, selective, tempo+selective); undoes any
    earlier patch first."""
    check_mode(mode)
    if any(type(m).__name__ in HF_ATTENTION and getattr(m, "reorder_and_upcast_attn", False) for m in model.modules()):
        raise PatchError(
            "GPT-2's reorder_and_upcast_attn computes attention in fp32 its own way; "
            "memplan's attention cores would change its numbers: turn it off to patch"
        )
    unpatch(model)
    report = PatchReport(mode)
    swapped: Counter[str] = Counter()
    unknown: set[str] = set()
    state = PatchState(replaced=[])
    done: dict[int, nn.Module] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = done.get(id(child)) or replacement(child, mode)
            if new is None:
                continue
            done[id(child)] = new
            new.train(child.training)
            setattr(parent, name, new)
            state.replaced.append((parent, name, child))
            swapped[type(child).__name__] += 1
    hf_attention = [m for m in model.modules() if type(m).__name__ in HF_ATTENTION]
    if hf_attention:
        config = hf_attention[0].config
        state.hf_config, state.hf_attention = config, config._attn_implementation
        config._attn_implementation = register_hf_attention(core_kind(mode))
        swapped.update(type(m).__name__ for m in hf_attention)
    for m in model.modules():
        if not is_known(m):
            unknown.add(type(m).__name__)
    object.__setattr__(model, STATE, state)
    report.swapped = dict(sorted(swapped.items()))
    report.unknown = sorted(unknown)
    return report


@dataclass(frozen=True)
class LayerMode:
    """A layer mode, checked when named and applied by calling it on a model: what a trace of a model file
    takes as its `layers` (a traces.model_file.ModelPatch), so a wrong name fails before build() runs."""

    name: str  # one of MODES

    def __post_init__(self) -> None:
        check_mode(self.name)

    def __call__(self, model: nn.Module) -> PatchReport:
        return patch(model, self.name)


def unpatch(model: nn.Module) -> int:
    """Put back every module `patch` replaced (and HuggingFace's attention setting); returns how many modules."""
    state: PatchState | None = model.__dict__.pop(STATE, None)
    if state is None:
        return 0
    for parent, name, original in reversed(state.replaced):
        original.train(getattr(parent, name).training)
        setattr(parent, name, original)
    if state.hf_config is not None:
        state.hf_config._attn_implementation = state.hf_attention
    return len(state.replaced)


def register_hf_attention(kind: str) -> str:
    """Register memplan's `kind` core (and the eager mask builder) with transformers; returns its registry name."""
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.modeling_utils import AttentionInterface

    name = f"memplan_{kind}"
    core = CORES[kind]

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if kwargs.get("head_mask") is not None:
            raise PatchError("memplan's attention cores take no head mask: unpatch the model to use one")
        scale = query.size(-1) ** -0.5 if scaling is None else scaling
        out = core(query, key, value, attention_mask, scale, dropout, module.training)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, eager_mask)
    return name
