"""Full recomputation: every Transformer layer of a model checkpointed as a whole (torch.utils.checkpoint,
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


def enable(model: nn.Module) -> tuple[list[nn.Module], list[tuple[nn.Module, dict]]]:
    """Checkpoint every layer of `model`'s layer lists; returns the layers, and what `restore` puts back."""
    layers = [layer for layers in layer_lists(model) for layer in layers]
    flagged = [m for m in model.modules() if has_hf_flag(m)]
    changed = {id(m): m for m in [*flagged, *layers]}.values()
    saved = [(m, {name: m.__dict__[name] for name in SET if name in m.__dict__}) for m in changed]
    for module in flagged:
        setattr(module, HF_FLAG, True)
        module._gradient_checkpointing_func = CHECKPOINT
    under_flag = {id(m) for flag in flagged for m in flag.modules()}  # HuggingFace checkpoints these itself
    for layer in layers:
        if id(layer) not in under_flag:
            layer.forward = functools.partial(checkpointed_forward, type(layer).forward.__get__(layer), layer)
    return layers, saved


def restore(saved: list[tuple[nn.Module, dict]]) -> None:
    """Undo `enable`: every module's instance attributes as they were."""
    for module, attributes in saved:
        for name in SET:
            module.__dict__.pop(name, None)
        module.__dict__.update(attributes)
