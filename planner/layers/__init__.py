"""Memory-saving Transformer layers (Tempo's in-place GELU and LayerNorm, dropout and selective recomputation) and the patcher."""

from planner.layers.patch import MODES, PatchError, PatchReport, patch, unpatch

__all__ = ["MODES", "PatchError", "PatchReport", "patch", "unpatch"]
