"""Memory-saving Transformer layers (Tempo's in-place GELU, LayerNorm, RMSNorm and SiLU, gated MLPs that rebuild
their product, dropout and selective recomputation, whole-layer checkpointing) and the patcher that swaps
them into a model and reports what it changed."""

from memplan.planner.layers.patch import MODES, LayerMode, PatchError, PatchReport, Swap, patch, unpatch

__all__ = ["MODES", "LayerMode", "PatchError", "PatchReport", "Swap", "patch", "unpatch"]
