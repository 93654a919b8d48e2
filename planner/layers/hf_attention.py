"""HuggingFace attention through its attention-function registry: which modules use it, whether their
attention already keeps no s x s tensor, and memplan's cores registered as attention functions.

Every model whose attention modules call `ALL_ATTENTION_FUNCTIONS` with `config._attn_implementation`
(BERT, GPT-2, Llama, Mistral, Qwen2, GPT-NeoX, ViT, T5, ...) is reached the same way: the patch sets
the config's implementation to a memplan core, and `unpatch` puts the original name back. Where the
modules sharing one config need different functions (layers patched in different modes), the config is
set to DISPATCH, and each module names the function it calls in its attribute CHOICE.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

from torch import nn

from memplan.errors import MemplanError
from memplan.planner.layers.attention import CORES

REGISTRY_NAME = "ALL_ATTENTION_FUNCTIONS"  # the name HuggingFace's modeling files call attention through
FUSED = "sdpa"  # the implementation whose kernels keep no s x s tensor (flash, memory-efficient)
EAGER = "eager"  # HuggingFace's written-out attention: each modeling file's own function, not the registry's
DISPATCH = "memplan_layers"  # the registry name of the function that calls each module's CHOICE
CHOICE = "_memplan_attention"  # on a module under DISPATCH: the registry name of the function it calls
CORE_PREFIX = "memplan_"  # the registry names of memplan's cores: memplan_baseline, memplan_tempo, memplan_selective
COMPUTED = frozenset(  # the attention functions' parameters memplan's cores compute (head_mask: only None)
    {"module", "query", "key", "value", "attention_mask", "scaling", "dropout", "position_bias", "head_mask"}
)


class AttentionPatchError(MemplanError):
    """An attention module asks for something memplan's cores do not compute."""


def unwrapped_forward(module_type: type) -> Callable:
    """The function behind `module_type`'s forward, unwrapped from decorators (transformers 5.24 wraps T5's in
    `deprecate_kwarg`), whose code names what the forward calls."""
    return inspect.unwrap(module_type.forward)


def uses_registry(module: nn.Module) -> bool:
    """Whether `module` is a HuggingFace attention module that computes its core through the registry."""
    code = getattr(unwrapped_forward(type(module)), "__code__", None)
    return (
        type(module).__module__.startswith("transformers.")
        and code is not None
        and REGISTRY_NAME in code.co_names
        and hasattr(getattr(module, "config", None), "_attn_implementation")
    )


def dropout_probability(module: nn.Module) -> float:
    """The attention dropout an attention module applies in training (its attribute names differ per model)."""
    for name in ("attention_dropout", "dropout_prob", "attn_dropout", "dropout"):
        value = getattr(module, name, None)
        if isinstance(value, nn.Dropout):
            return float(value.p)
        if isinstance(value, (int, float)):
            return float(value)
    return 0.0


def keeps_square(module: nn.Module, device_type: str) -> bool:
    """Whether `module`'s attention as configured keeps an s x s tensor for backward: eager always does;
    SDPA does only on its math path, which the CPU takes for dropout in training (CUDA's fused kernels
    apply dropout themselves; the CPU's flash kernel has none)."""
    if module.config._attn_implementation != FUSED:
        return True
    return device_type == "cpu" and module.training and dropout_probability(module) > 0.0


def memplan_core(module: nn.Module) -> str | None:
    """The kind of memplan core (`tempo`) HuggingFace attention `module` computes with now, None when none: the
    function it names, else its config's."""
    if not uses_registry(module):
        return None
    name = getattr(module, CHOICE, module.config._attn_implementation)
    return name.removeprefix(CORE_PREFIX) if name.startswith(CORE_PREFIX) else None


def register_function(name: str, attention: Callable) -> str:
    """Register `attention` with transformers as `name`, with the eager mask builder (an additive float mask, which
    memplan's cores take, and which eager and SDPA attention compute the same arithmetic with); returns `name`."""
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, eager_mask)
    return name


def core_name(kind: str) -> str:
    """The registry name of memplan's `kind` core."""
    return f"{CORE_PREFIX}{kind}"


def register(kind: str) -> str:
    """Register memplan's `kind` core with transformers; returns its registry name."""
    core = CORES[kind]

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if kwargs.get("head_mask") is not None:
            raise AttentionPatchError("memplan's attention cores take no head mask: unpatch the model to use one")
        given = [name for name in extra_parameters(type(module)) if kwargs.get(name) is not None]
        if given:
            raise AttentionPatchError(
                f"{type(module).__name__} passes its attention {', '.join(given)}, which memplan's cores do not "
                "compute: unpatch the model (--layers as-built) to run it"
            )
        # 1. Grouped-query attention: repeat k and v per query head, as HuggingFace's eager attention does.
        groups = query.size(1) // key.size(1)
        if groups > 1:
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        # 2. Additive biases: the mask, and T5's relative position bias.
        bias = attention_mask
        if kwargs.get("position_bias") is not None:
            bias = kwargs["position_bias"] if bias is None else kwargs["position_bias"] + bias
        scale = query.size(-1) ** -0.5 if scaling is None else scaling
        out = core(query, key, value, bias, scale, dropout, module.training)
        return out.transpose(1, 2).contiguous(), None

    return register_function(core_name(kind), attention)


def attention_function(module: nn.Module, name: str) -> Callable:
    """The function `module` computes attention with under the implementation `name`, as HuggingFace picks it: the
    registry's, else, for `eager`, its own modeling file's (`eager_attention_forward`, one in each file)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[name]
    eager = eager_function(type(module))
    if name != EAGER or eager is None:
        raise AttentionPatchError(f"{type(module).__name__} has no attention function {name!r} memplan can call")
    return eager


def eager_function(module_type: type) -> Callable | None:
    """`module_type`'s own modeling file's eager attention function (`eager_attention_forward`), None when none."""
    forward = unwrapped_forward(module_type)
    eager = [forward.__globals__[n] for n in forward.__code__.co_names if n.endswith("eager_attention_forward")]
    return eager[0] if eager else None


@functools.cache
def extra_parameters(module_type: type) -> tuple[str, ...]:
    """The named parameters of `module_type`'s own eager attention function beyond what memplan's cores compute
    (Gemma 2's softcap, ModernBERT's sliding_window): what it would compute that the cores would not."""
    eager = eager_function(module_type)
    if eager is None:
        return ()
    names = inspect.signature(eager).parameters.items()
    return tuple(n for n, p in names if n not in COMPUTED and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def register_dispatch() -> str:
    """Register the function that calls, for each module, the function its CHOICE attribute names (memplan's core
    for a patched layer, the original implementation for the rest); returns DISPATCH."""

    def attention(module, *args, **kwargs):
        return attention_function(module, getattr(module, CHOICE))(module, *args, **kwargs)

    return register_function(DISPATCH, attention)
