"""Memory-saving Transformer layers (Tempo's in-place GELU, LayerNorm, RMSNorm and SiLU, gated MLPs that rebuild
their product, dropout and selective recomputation, whole-layer checkpointing, activation offload to the host) and
the patcher that swaps them into a model, for the whole model or per Transformer layer, and reports what it changed;
the fused linear cross-entropy a step's loss can be (`patch_loss`); and the optimizers with smaller state a step's
optimizer can be rebuilt as (`choose_optimizer`)."""

from memplan.errors import PatchError
from memplan.modes import LOSSES, MODES, PER_LAYER_MODES
from memplan.planner.layers.fused_loss import linear_cross_entropy
from memplan.planner.layers.loss_patch import LossPatch, patch_loss, unpatch_loss
from memplan.planner.layers.optimizer_choice import OptimizerChoice, choose_optimizer
from memplan.planner.layers.patch import (
    LayerModesReport,
    PatchReport,
    Swap,
    patch,
    transformer_layers,
    unpatch,
)

__all__ = [
    "LOSSES",
    "MODES",
    "PER_LAYER_MODES",
    "LayerModesReport",
    "LossPatch",
    "OptimizerChoice",
    "PatchError",
    "PatchReport",
    "Swap",
    "choose_optimizer",
    "linear_cross_entropy",
    "patch",
    "patch_loss",
    "transformer_layers",
    "unpatch",
    "unpatch_loss",
]
