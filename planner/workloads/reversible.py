"""Reversible variants of the bundled GPT-2 and BERT (RevNet, Reformer): the same configs and blocks, each pair of
sublayers one reversible block (`layers.reversible`), so a training step holds two activation streams for backward
instead of every layer's activations.

The embeddings' output is both streams (x1 = x2, as in Reformer); after the stack they are averaged, (y1 + y2)/2,
before the final LayerNorm. Both use pre-LN branches, F = attention(LN(x)) and G = MLP(LN(x)): BERT's post-LN
residual LN(x + F(x)) cannot be inverted, so its reversible variant is a pre-LN encoder, with the final LayerNorm
pre-LN encoders have before its MLM head.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from memplan.planner.layers.reversible import ReversibleBlock, ReversibleStack
from memplan.planner.workloads import bert, gpt2
from memplan.planner.workloads.blocks import MLP, SelfAttention


class PreNorm(nn.Module):
    """A reversible block's branch: x -> sublayer(LayerNorm(x), *extra)."""

    def __init__(self, hidden: int, eps: float, sublayer: nn.Module):
        super().__init__()
        self.norm = nn.LayerNorm(hidden, eps=eps)
        self.sublayer = sublayer

    def forward(self, x: torch.Tensor, *extra) -> torch.Tensor:
        return self.sublayer(self.norm(x), *extra)


class TwoStreams(nn.Module):
    """The layers of a reversible variant: the input as both streams, `c.layers` reversible blocks of `c`'s shape
    (F = attention(LN(x), *extra), G = MLP(LN(x))), the streams' mean, then `norm` (a final LayerNorm, or none)."""

    def __init__(self, c: gpt2.GPT2Config | bert.BertConfig, gelu_approximate: str, norm: nn.Module | None = None):
        super().__init__()
        self.stack = ReversibleStack(
            ReversibleBlock(
                PreNorm(c.hidden, c.eps, SelfAttention(c.hidden, c.heads, c.attn_dropout, c.dropout)),
                PreNorm(c.hidden, c.eps, MLP(c.hidden, c.ffn_mult * c.hidden, c.dropout, gelu_approximate)),
            )
            for _ in range(c.layers)
        )
        self.norm = norm or nn.Identity()

    def forward(self, x: torch.Tensor, *extra) -> torch.Tensor:
        y1, y2 = self.stack(x, x, *extra)
        return self.norm((y1 + y2) / 2)


class ReversibleGPT2(gpt2.GPT2):
    """GPT-2 (`workloads.gpt2.GPT2`) with its layers as a reversible stack; the embeddings, the final LayerNorm and
    the tied LM head as GPT-2's."""

    NAME = "gpt2-rev"

    def make_layers(self, c: gpt2.GPT2Config) -> nn.Module:
        return TwoStreams(c, "tanh")

    def run_layers(self, x: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        return self.layers(x, causal)


class ReversibleBert(bert.Bert):
    """BERT (`workloads.bert.Bert`) with its layers as a reversible pre-LN stack and the final LayerNorm pre-LN
    encoders have; the embeddings and the MLM head as BERT's."""

    NAME = "bert-rev"

    def make_layers(self, c: bert.BertConfig) -> nn.Module:
        return TwoStreams(c, "none", nn.LayerNorm(c.hidden, eps=c.eps))

    def run_layers(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


build_gpt2_workload = functools.partial(gpt2.build_workload, architecture=ReversibleGPT2)
build_bert_workload = functools.partial(bert.build_workload, architecture=ReversibleBert)
