"""A Llama-style decoder in plain torch.nn (RMSNorm, SwiGLU, rotary positions, grouped-query attention
through scaled_dot_product_attention, no dropout, untied head) and its training-step workload."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from memplan.planner.layers.baseline import SwiGLU
from memplan.planner.workloads.blocks import WorkloadConfigError, language_model_workload
from memplan.traces.inputs.workload import Workload


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-style model; the default is a tiny model for tests."""

    vocab_size: int = 1024
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    layers: int = 2
    ffn_hidden: int = 176
    rope_theta: float = 10000.0
    eps: float = 1e-5


TINY = LlamaConfig()
LLAMA2_7B = LlamaConfig(vocab_size=32000, hidden=4096, heads=32, kv_heads=32, layers=32, ffn_hidden=11008)
LLAMA3_8B = LlamaConfig(
    vocab_size=128256, hidden=4096, heads=32, kv_heads=8, layers=32, ffn_hidden=14336, rope_theta=500000.0
)
LLAMA3_70B = LlamaConfig(
    vocab_size=128256, hidden=8192, heads=64, kv_heads=8, layers=80, ffn_hidden=28672, rope_theta=500000.0
)
PRESETS = {"tiny": TINY, "7b": LLAMA2_7B, "8b": LLAMA3_8B, "70b": LLAMA3_70B}


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x (batch, heads, seq, head_dim), halves rotated as in Llama."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class Attention(nn.Module):
    """Causal grouped-query self-attention: q, k, v projections, rotary positions, SDPA, output projection."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        if c.hidden % c.heads or c.heads % c.kv_heads:
            raise WorkloadConfigError(f"hidden {c.hidden}, heads {c.heads} and kv heads {c.kv_heads} do not divide")
        self.heads, self.kv_heads, self.head_dim = c.heads, c.kv_heads, c.hidden // c.heads
        self.q = nn.Linear(c.hidden, c.heads * self.head_dim, bias=False)
        self.k = nn.Linear(c.hidden, c.kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(c.hidden, c.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(c.heads * self.head_dim, c.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # heads read from the projections' widths: under tensor parallelism a rank's q, k, v hold its share of them
        b, s, _ = x.shape
        q = self.q(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class LlamaLayer(nn.Module):
    """x = x + attention(RMSNorm(x)); x = x + mlp(RMSNorm(x))."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.norm1 = nn.RMSNorm(c.hidden, eps=c.eps)
        self.attention = Attention(c)
        self.norm2 = nn.RMSNorm(c.hidden, eps=c.eps)
        self.mlp = SwiGLU(c.hidden, c.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class Llama(nn.Module):
    """Token embedding, the layers, a final RMSNorm and an untied language-model head."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab_size, c.hidden)
        self.layers = nn.ModuleList(LlamaLayer(c) for _ in range(c.layers))
        self.norm = nn.RMSNorm(c.hidden, eps=c.eps)
        self.head = nn.Linear(c.hidden, c.vocab_size, bias=False)
        head_dim = c.hidden // c.heads
        self.register_buffer(
            "inv_freq", c.rope_theta ** -(torch.arange(0, head_dim, 2).float() / head_dim), persistent=False
        )
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device, dtype=torch.float32)
        angles = torch.outer(positions, self.inv_freq.float())
        angles = torch.cat((angles, angles), dim=-1)
        h = self.embed(ids)
        cos, sin = angles.cos().to(h.dtype), angles.sin().to(h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.head(self.norm(h))

    def get_output_embeddings(self) -> nn.Linear:
        """The language-model head (HuggingFace's name for it)."""
        return self.head


def build_workload(
    batch_size: int = 2,
    seq_len: int = 32,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    config: LlamaConfig = TINY,
    seed: int = 0,
    lr: float = 1e-4,
) -> Workload:
    """A Llama-style language-model training step: random weights and tokens from `seed`, next-token loss, AdamW."""
    return language_model_workload(
        lambda: Llama(config),
        config.vocab_size,
        batch_size,
        seq_len,
        dtype,
        device,
        seed,
        lr,
        f"llama-{config.layers}x{config.hidden}",
    )
