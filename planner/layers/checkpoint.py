"""Full recomputation: Transformer layers of a model checkpointed as a whole (torch.utils.checkpoint,
non-reentrant), so a layer keeps only its input for backward and recomputes the rest there.

The layers are the modules of the model's layer lists: an nn.ModuleList whose entries share one class
and hold parameters (BERT's `encoder.layer`, GPT-2's `h`, Llama's `layers`, T5's `block` lists).
HuggingFace models are switched with their own flags, as `activation_checkpointing_enable` sets them
(the model then also turns its key/value cache off, which a recomputed layer would update twice);
other layers get a checkpointed `forward` on the instance, so module paths, hooks and state dicts stay.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

CHECKPOINT = functools.partial(checkpoint, use_reentrant=False)
HF_FLAG = "gradient_checkpointing"  # HuggingFace's switch, on its models and on each checkpointable layer
SET = (HF_FLAG, "_gradient_checkpointing_func", "forward")  # the instance attributes enabling checkpointing sets


def layer_lists(model: nn.Module) -> list[nn.ModuleList]:
    """The model's lists of Transformer layers, outermost first; a list inside a chosen layer is not one."""
    chosen: list[nn.ModuleList] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        kinds = {type(layer) for layer in module}
        if len(kinds) == 1 and any(True for _ in module[0].parameters()) and any(True for _ in module[0].children()):
            chosen.append(module)
            inside.update(id(m) for m in module.modules())
    return chosen


def has_hf_flag(module: nn.Module) -> bool:
    """Whether `module` is a HuggingFace module that checkpoints (or turns its cache off) when its flag is set."""
    return type(module).__module__.startswith("transformers.") and hasattr(module, HF_FLAG)


def checkpointed_forward(forward, module: nn.Module, *args, **kwargs):
    """`forward` under activation checkpointing while training with gradients, plain otherwise."""
    if module.training and torch.is_grad_enabled():
        return CHECKPOINT(forward, *args, **kwargs)
    return forward(*args, **kwargs)


def holds_or_inside(model: nn.Module, layers: list[nn.Module]) -> list[nn.Module]:
    """The modules of `model` inside one of `layers` (the layers too) or holding one of them."""
    chosen = {id(layer) for layer in layers}
    inside = {id(m) for layer in layers for m in layer.modules()}
    return [m for m in model.modules() if id(m) in inside or any(id(held) in chosen for held in m.modules())]


def enable(model: nn.Module, layers: list[nn.Module]) -> list[tuple[nn.Module, dict]]:
    """Checkpoint `layers` (of `model`'s layer lists); returns what `restore` puts back. HuggingFace's flag is set
    on the layers, the modules inside them and the modules holding them (which turn the key/value cache off), not
    on the other layers, which stay as they are."""
    flagged = [m for m in holds_or_inside(model, layers) if has_hf_flag(m)]
    changed = {id(m): m for m in [*flagged, *layers]}.values()
    saved = [(m, {name: m.__dict__[name] for name in SET if name in m.__dict__}) for m in changed]
    for module in flagged:
        setattr(module, HF_FLAG, True)
        module._gradient_checkpointing_func = CHECKPOINT
    for layer in layers:
        if not has_hf_flag(layer):  # a HuggingFace layer checkpoints itself when its flag is set
            layer.forward = functools.partial(checkpointed_forward, type(layer).forward.__get__(layer), layer)
    return saved


def restore(saved: list[tuple[nn.Module, dict]]) -> None:
    """Undo `enable`: every module's instance attributes as they were."""
    for module, attributes in saved:
        for name in SET:
            module.__dict__.pop(name, None)
        module.__dict__.update(attributes)
