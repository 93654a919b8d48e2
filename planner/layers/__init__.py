"""Memory-saving Transformer layers (Tempo's in-place GELU, LayerNorm, RMSNorm and SiLU, gated MLPs that rebuild
their product, dropout and selective recomputation, whole-layer checkpointing) and the patcher that swaps
them into a model, for the whole model or per Transformer layer, and reports what it changed."""

from memplan.errors import PatchError
from memplan.modes import MODES, PER_LAYER_MODES
from memplan.planner.layers.patch import (
    LayerModesReport,
    PatchReport,
    Swap,
    patch,
    transformer_layers,
    unpatch,
)

__all__ = [
    "MODES",
    "PER_LAYER_MODES",
    "LayerModesReport",
    "PatchError",
    "PatchReport",
    "Swap",
    "patch",
    "transformer_layers",
    "unpatch",
]
