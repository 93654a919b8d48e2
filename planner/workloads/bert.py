"""A BERT encoder with a masked-language-model head, in plain torch.nn, and its training-step workload."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from memplan.planner.workloads.blocks import (
    MLP,
    Dropout,
    PostLNLayer,
    SelfAttention,
    TokenLoss,
    WorkloadConfigError,
    init_weights,
)
from memplan.traces.fake.mode import module_to
from memplan.traces.inputs.workload import Workload


@dataclass(frozen=True)
class BertConfig:
    """Shape and regularisation of a BERT model; the default is a tiny model for tests."""

    vocab_size: int = 1024
    max_positions: int = 512
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    ffn_mult: int = 4
    dropout: float = 0.1
    attn_dropout: float = 0.1
    eps: float = 1e-12


TINY = BertConfig()
BASE = BertConfig(vocab_size=30522, hidden=768, heads=12, layers=12)
LARGE = BertConfig(vocab_size=30522, hidden=1024, heads=16, layers=24)
PRESETS = {"tiny": TINY, "base": BASE, "large": LARGE}


class BertLayer(PostLNLayer):
    """One BERT layer: self-attention and MLP, each followed by residual add and LayerNorm."""

    def __init__(self, c: BertConfig):
        super().__init__(
            SelfAttention(c.hidden, c.heads, c.attn_dropout, c.dropout),
            MLP(c.hidden, c.ffn_mult * c.hidden, c.dropout),
            c.hidden,
            c.eps,
        )


class Bert(nn.Module):
    """Embeddings (word + position), LayerNorm and dropout, the layers, then the MLM head tied to the word embedding.
    A variant (workloads.reversible) changes only `make_layers` and `run_layers`."""

    NAME = "bert"  # the workload's name begins with it

    def __init__(self, c: BertConfig):
        super().__init__()
        self.config = c
        self.word = nn.Embedding(c.vocab_size, c.hidden)
        self.position = nn.Embedding(c.max_positions, c.hidden)
        self.ln_embed = nn.LayerNorm(c.hidden, eps=c.eps)
        self.dropout = Dropout(c.dropout)
        self.layers = self.make_layers(c)
        self.head_dense = nn.Linear(c.hidden, c.hidden)
        self.head_act = nn.GELU()
        self.head_ln = nn.LayerNorm(c.hidden, eps=c.eps)
        self.decoder_bias = nn.Parameter(torch.zeros(c.vocab_size))
        self.apply(init_weights)

    def make_layers(self, c: BertConfig) -> nn.Module:
        return nn.ModuleList(BertLayer(c) for _ in range(c.layers))

    def run_layers(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, seq) -> vocabulary logits (batch, seq, vocab)."""
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.dropout(self.ln_embed(self.word(input_ids) + self.position(positions)))
        x = self.head_ln(self.head_act(self.head_dense(self.run_layers(x))))
        return nn.functional.linear(x, self.word.weight, self.decoder_bias)


def mlm_batch(batch_size: int, seq_len: int, vocab_size: int, generator: torch.Generator, mask_fraction: float = 0.15):
    """Synthetic MLM data: random token ids, a fraction of positions replaced by token 0 ([MASK]) and labelled."""
    tokens = torch.randint(1, vocab_size, (batch_size, seq_len), generator=generator)
    masked = torch.rand(batch_size, seq_len, generator=generator) < mask_fraction
    masked[:, 0] = True  # at least one labelled position per sequence
    input_ids = torch.where(masked, torch.zeros_like(tokens), tokens)
    labels = torch.where(masked, tokens, torch.full_like(tokens, -100))
    return input_ids, labels


def build_workload(
    batch_size: int = 2,
    seq_len: int = 32,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    config: BertConfig = TINY,
    seed: int = 0,
    lr: float = 1e-4,
    architecture: type[Bert] = Bert,
) -> Workload:
    """A BERT MLM training step: random weights and synthetic tokens from `seed`, cross-entropy loss, AdamW;
    `architecture` is Bert or a variant of it."""
    if seq_len > config.max_positions:
        raise WorkloadConfigError(f"seq_len {seq_len} exceeds the model's {config.max_positions} positions")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = architecture(config)
    model = module_to(model, device, dtype).train()
    input_ids, labels = mlm_batch(batch_size, seq_len, config.vocab_size, torch.Generator().manual_seed(seed))
    return Workload(
        model=model,
        inputs=(input_ids.to(device),),
        optimizer=torch.optim.AdamW(model.parameters(), lr=lr),
        loss_fn=TokenLoss(labels.to(device)),
        name=f"{architecture.NAME}-{config.layers}x{config.hidden}",
    )
