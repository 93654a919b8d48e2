"""`memplan.apply`: put a choice file's actions on the user's own model, as the traced step had them, so the
user's loop runs the step `memplan optimize` verified."""

from __future__ import annotations

from torch import nn

from memplan.errors import PatchError
from memplan.modes import AS_BUILT
from memplan.planner.layers import choose_optimizer, patch, patch_loss, transformer_layers
from memplan.planner.layers.loss_patch import why_not_fused
from memplan.planner.optimize.choice_file import ChoiceError, StepChoice


def apply_choice(model: nn.Module, optimizer: object, choice: StepChoice, loss_fn: object = None) -> tuple:
    """Patch `model` in place with `choice`'s mode per Transformer layer and its loss (`loss_fn`: the loss the
    model is trained on where it is not the model's own, as a model file's `loss`), and rebuild `optimizer` as its
    optimizer choice; returns (model, optimizer), the pair to train with. ChoiceError, the model unchanged, where the
    choice is not the model's or cannot apply."""
    # 1. The choice names exactly the model's Transformer layers, in order: any other model is not the one measured.
    layers, chosen = transformer_layers(model), [path for path, _ in choice.layers]
    if layers != chosen:
        raise ChoiceError(
            f"the choice is for the Transformer layers {_few(chosen)} of {choice.model_file}; this model has "
            f"{_few(layers)}"
        )
    # 2. The loss must apply as it did in the traced step, or the step is not the one verified.
    reason = None if choice.loss == AS_BUILT else why_not_fused(model, loss_fn)
    if reason is not None:
        raise ChoiceError(f"the choice's loss {choice.loss!r} cannot apply to this model: {reason}")
    # 3. The optimizer rebuilt (before anything changes: it may refuse), then the layer modes and the loss.
    try:
        optimizer, _ = choose_optimizer(optimizer, choice.optimizer)
    except PatchError as e:
        raise ChoiceError(f"the choice's optimizer cannot apply: {e}") from None
    patch(model, dict(choice.layers))
    patch_loss(model, choice.loss, loss_fn)
    return model, optimizer


def _few(paths: list[str]) -> str:
    """Layer paths for a message: the first, the last and how many."""
    if not paths:
        return "none"
    return f"{paths[0]} ... {paths[-1]} ({len(paths)})" if len(paths) > 2 else ", ".join(paths)
