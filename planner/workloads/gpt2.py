"""A GPT-2 decoder with a tied language-model head, in plain torch.nn, and its training-step workload."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from memplan.planner.workloads.blocks import (
    MLP,
    Dropout,
    PreLNLayer,
    SelfAttention,
    WorkloadConfigError,
    init_weights,
    language_model_workload,
)
from memplan.traces.inputs.workload import Workload


@dataclass(frozen=True)
class GPT2Config:
    """Shape and regularisation of a GPT-2 model; the default is a tiny model for tests."""

    vocab_size: int = 1024
    max_positions: int = 1024
    hidden: int = 64
    heads: int = 4
    layers: int = 2
    ffn_mult: int = 4
    dropout: float = 0.1
    attn_dropout: float = 0.1
    eps: float = 1e-5


TINY = GPT2Config()
SMALL = GPT2Config(vocab_size=50257, hidden=768, heads=12, layers=12)
MEDIUM = GPT2Config(vocab_size=50257, hidden=1024, heads=16, layers=24)
PRESETS = {"tiny": TINY, "small": SMALL, "medium": MEDIUM}


class GPT2Layer(PreLNLayer):
    """One GPT-2 layer: pre-LayerNorm causal self-attention and MLP (tanh GELU), each with a residual add."""

    def __init__(self, c: GPT2Config):
        super().__init__(
            SelfAttention(c.hidden, c.heads, c.attn_dropout, c.dropout),
            MLP(c.hidden, c.ffn_mult * c.hidden, c.dropout, gelu_approximate="tanh"),
            c.hidden,
            c.eps,
        )


class GPT2(nn.Module):
    """Token and position embeddings with dropout, the causal layers, a final LayerNorm and the LM head tied to the
    token embedding.
    A variant (workloads.reversible) changes only `make_layers` and `run_layers`."""

    NAME = "gpt2"  # the workload's name begins with it

    def __init__(self, c: GPT2Config):
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab_size, c.hidden)
        self.wpe = nn.Embedding(c.max_positions, c.hidden)
        self.dropout = Dropout(c.dropout)
        self.layers = self.make_layers(c)
        self.ln_f = nn.LayerNorm(c.hidden, eps=c.eps)
        self.apply(init_weights)
        self.head = nn.Linear(c.hidden, c.vocab_size, bias=False, device="meta")  # tied: the token embedding's weight
        self.head.weight = self.wte.weight

    def make_layers(self, c: GPT2Config) -> nn.Module:
        return nn.ModuleList(GPT2Layer(c) for _ in range(c.layers))

    def run_layers(self, x: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, causal)
        return x

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, seq) -> next-token logits (batch, seq, vocab)."""
        s = input_ids.size(1)
        positions = torch.arange(s, device=input_ids.device)
        x = self.dropout(self.wte(input_ids) + self.wpe(positions))
        causal = torch.full((s, s), float("-inf"), device=x.device, dtype=x.dtype).triu(1)
        return self.head(self.ln_f(self.run_layers(x, causal)))

    def get_output_embeddings(self) -> nn.Linear:
        """The language-model head (HuggingFace's name for it), tied to the token embedding."""
        return self.head


def build_workload(
    batch_size: int = 2,
    seq_len: int = 32,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    config: GPT2Config = TINY,
    seed: int = 0,
    lr: float = 1e-4,
    architecture: type[GPT2] = GPT2,
) -> Workload:
    """A GPT-2 language-model training step: random weights and tokens from `seed`, next-token loss, AdamW;
    `architecture` is GPT2 or a variant of it."""
    if seq_len > config.max_positions:
        raise WorkloadConfigError(f"seq_len {seq_len} exceeds the model's {config.max_positions} positions")
    return language_model_workload(
        lambda: architecture(config),
        config.vocab_size,
        batch_size,
        seq_len,
        dtype,
        device,
        seed,
        lr,
        f"{architecture.NAME}-{config.layers}x{config.hidden}",
    )
