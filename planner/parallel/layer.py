"""Megatron's tensor- and sequence-parallel GPT-2 layer, built from the bundled blocks' own modules.

Tensors are sequence-first: [s, b, h] replicated (tensor parallel) or [s/t, b, h] per rank (sequence
parallel). The attention heads and the MLP's 4h features are split over the t ranks; LayerNorm, the
residual adds and the dropouts after each sub-layer run on the whole sequence (replicated) or on this
rank's sequence shard. The LayerNorm, GELU, attention core and dropout are the bundled blocks' modules,
so `planner.layers.patch` swaps in the Tempo and selective-recomputation layers here too.
"""

from __future__ import annotations

import torch
from torch import nn

from memplan.planner.parallel import comm
from memplan.planner.parallel.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    mark_sequence_parallel,
    sync_sequence_parallel_grads,
)
from memplan.planner.workloads.blocks import AttentionCore, Dropout, PreLNLayer


class ParallelSelfAttention(nn.Module):
    """Self-attention over this rank's heads: column-parallel QKV, the attention core, row-parallel output."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        attn_dropout: float,
        hidden_dropout: float,
        group=None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        t = comm.world(group)
        if hidden % heads or heads % t:
            raise comm.ParallelError(f"{heads} heads of hidden size {hidden} cannot be split over {t} ranks")
        self.heads, self.local_heads, self.hidden = heads, heads // t, hidden
        self.qkv = ColumnParallelLinear(hidden, 3 * hidden, group=group, sequence_parallel=sequence_parallel)
        self.core = AttentionCore(attn_dropout)
        self.proj = RowParallelLinear(hidden, hidden, group=group, sequence_parallel=sequence_parallel)
        self.dropout = Dropout(hidden_dropout)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[s, b, local hidden] -> [b, local heads, s, head_dim], a view."""
        s, b, n = x.shape
        return x.view(s, b, self.local_heads, n // self.local_heads).permute(1, 2, 0, 3)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=2)
        context = self.core(self._heads(q), self._heads(k), self._heads(v), bias)  # [b, a/t, s, d]
        b, a, s, d = context.shape
        return self.dropout(self.proj(context.permute(2, 0, 1, 3).reshape(s, b, a * d)))

    def load_full(self, full: nn.Module) -> None:
        """Copy this rank's share of a single-process SelfAttention (fused QKV rows q|k|v, heads contiguous)."""
        n, r = self.hidden // comm.world(self.qkv.group), comm.rank(self.qkv.group)
        rows = torch.cat(
            [torch.arange(part * self.hidden + r * n, part * self.hidden + (r + 1) * n) for part in range(3)]
        )
        self.qkv.load_full(full.qkv.weight, full.qkv.bias, rows)
        self.proj.load_full(full.proj.weight, full.proj.bias)


class ParallelMLP(nn.Module):
    """Feed-forward block over this rank's 1/t of the 4h features: column-parallel fc1, GELU, row-parallel fc2."""

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        dropout: float,
        gelu_approximate: str = "tanh",
        group=None,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden, ffn_hidden, group=group, sequence_parallel=sequence_parallel)
        self.act = nn.GELU(approximate=gelu_approximate)
        self.fc2 = RowParallelLinear(ffn_hidden, hidden, group=group, sequence_parallel=sequence_parallel)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(self.act(self.fc1(x))))

    def load_full(self, full: nn.Module) -> None:
        """Copy this rank's share of a single-process MLP."""
        self.fc1.load_full(full.fc1.weight, full.fc1.bias)
        self.fc2.load_full(full.fc2.weight, full.fc2.bias)


class ParallelGPT2Layer(PreLNLayer):
    """GPT-2's pre-LayerNorm layer with tensor parallelism, and sequence parallelism when asked.

    Input and output are [s, b, h] (tensor parallel) or this rank's [s/t, b, h] (sequence parallel).
    """

    def __init__(
        self,
        hidden: int,
        heads: int,
        ffn_hidden: int,
        dropout: float,
        attn_dropout: float,
        eps: float = 1e-5,
        group=None,
        sequence_parallel: bool = False,
    ):
        super().__init__(
            ParallelSelfAttention(hidden, heads, attn_dropout, dropout, group, sequence_parallel),
            ParallelMLP(hidden, ffn_hidden, dropout, "tanh", group, sequence_parallel),
            hidden,
            eps,
        )
        self.group, self.sequence_parallel = group, sequence_parallel
        if sequence_parallel:
            for p in (*self.ln1.parameters(), *self.ln2.parameters()):
                mark_sequence_parallel(p)
        sync_sequence_parallel_grads(self, group)

    @classmethod
    def from_layer(cls, full: PreLNLayer, group=None, sequence_parallel: bool = False) -> ParallelGPT2Layer:
        """This rank's share of a single-process GPT-2 layer (same weights, same dropout rates)."""
        attn, mlp = full.attention, full.mlp
        layer = cls(
            full.ln1.normalized_shape[0],
            attn.heads,
            mlp.fc1.out_features,
            mlp.dropout.p,
            attn.core.dropout.p,
            full.ln1.eps,
            group,
            sequence_parallel,
        )
        layer.to(dtype=full.ln1.weight.dtype, device=full.ln1.weight.device)
        layer.ln1.load_state_dict(full.ln1.state_dict())
        layer.ln2.load_state_dict(full.ln2.state_dict())
        layer.attention.load_full(attn)
        layer.mlp.load_full(mlp)
        return layer
