"""The baseline building blocks the layer modes start from, and the bundled workloads are built of: written so
that what autograd keeps for backward matches Megatron's accounting (REFERENCE §1). Every dropout keeps a 1-byte
mask (`torch.native_dropout`), on the CPU too; attention is spelled out (QKᵀ, softmax, dropout, ·V)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class Dropout(nn.Module):
    """Dropout that keeps a 1-byte bool mask for backward on every device (nn.Dropout on CPU keeps a noise tensor)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        return torch.native_dropout(x, self.p, True)[0]

    def extra_repr(self) -> str:
        return f"p={self.p}"


class AttentionCore(nn.Module):
    """softmax(q·kᵀ·scale + bias) with dropout on the probabilities, times v; q, k, v are
    (batch, heads, seq, head_dim)."""

    def __init__(self, dropout_p: float):
        super().__init__()
        self.dropout = Dropout(dropout_p)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
        if bias is not None:
            scores = scores + bias
        probs = F.softmax(scores, dim=-1)
        return torch.matmul(self.dropout(probs), v)


class SwiGLU(nn.Module):
    """Feed-forward block: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, ffn_hidden: int):
        super().__init__()
        self.gate = nn.Linear(hidden, ffn_hidden, bias=False)
        self.up = nn.Linear(hidden, ffn_hidden, bias=False)
        self.act = nn.SiLU()
        self.down = nn.Linear(ffn_hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x)) * self.up(x))
