"""Memory-saving Transformer layers (Tempo's in-place GELU and LayerNorm, dropout and selective recomputation) and the patcher."""
