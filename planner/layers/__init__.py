"""Memory-saving Transformer layers (Tempo's in-place GELU and LayerNorm, dropout and selective recomputation)
and the patcher that swaps them into a model."""

from memplan.planner.layers.patch import MODES, LayerMode, PatchError, PatchReport, patch, unpatch

__all__ = ["MODES", "LayerMode", "PatchError", "PatchReport", "patch", "unpatch"]
