"""Transformer building blocks shared by the bundled BERT and GPT-2 (and their parallel variants).

Written so that what autograd keeps for backward matches Megatron's accounting (REFERENCE §1):
attention is spelled out (QKᵀ, softmax, dropout, ·V) and every dropout keeps a 1-byte mask
(`torch.native_dropout`), on the CPU too: the baseline blocks of planner/layers/baseline.py. The patcher swaps
`nn.GELU`, `nn.LayerNorm` and `AttentionCore` for memplan's memory-saving layers.
"""

from __future__ import annotations

import torch
from torch import nn

from memplan.errors import MemplanError
from memplan.planner.layers.baseline import AttentionCore, Dropout
from memplan.planner.layers.fused_loss import TokenLoss
from memplan.traces.fake.mode import module_to
from memplan.traces.inputs.workload import Workload


class WorkloadConfigError(MemplanError):
    """A workload was asked for a shape its configuration cannot build."""


class SelfAttention(nn.Module):
    """Multi-head self-attention: fused QKV projection, the attention core, output projection and its dropout."""

    def __init__(self, hidden: int, heads: int, attn_dropout: float, hidden_dropout: float):
        super().__init__()
        if hidden % heads:
            raise WorkloadConfigError(f"hidden size {hidden} is not a multiple of {heads} heads")
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.core = AttentionCore(attn_dropout)
        self.proj = nn.Linear(hidden, hidden)
        self.dropout = Dropout(hidden_dropout)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, seq, hidden) -> (batch, heads, seq, head_dim), contiguous.

        The copy is the one matmul would make anyway; made here, Q, K and V each own their storage
        for any batch size (with views, batch 1 would keep the whole fused QKV output alive).
        """
        b, s, h = x.shape
        return x.view(b, s, self.heads, h // self.heads).transpose(1, 2).contiguous()

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=2)
        context = self.core(self.split_heads(q), self.split_heads(k), self.split_heads(v), bias)
        return self.dropout(self.proj(context.transpose(1, 2).reshape(b, s, h)))


class MLP(nn.Module):
    """Feed-forward block: Linear(h, 4h), GELU (erf or tanh form), Linear(4h, h), dropout."""

    def __init__(self, hidden: int, ffn_hidden: int, dropout: float, gelu_approximate: str = "none"):
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn_hidden)
        self.act = nn.GELU(approximate=gelu_approximate)
        self.fc2 = nn.Linear(ffn_hidden, hidden)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(self.act(self.fc1(x))))


class PostLNLayer(nn.Module):
    """BERT's layer: x = LN(x + attention(x)); x = LN(x + mlp(x))."""

    def __init__(self, attention: nn.Module, mlp: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.attention = attention
        self.ln1 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = mlp
        self.ln2 = nn.LayerNorm(hidden, eps=eps)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x = self.ln1(x + self.attention(x, bias))
        return self.ln2(x + self.mlp(x))


class PreLNLayer(nn.Module):
    """GPT-2's layer: x = x + attention(LN(x)); x = x + mlp(LN(x))."""

    def __init__(self, attention: nn.Module, mlp: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden, eps=eps)
        self.attention = attention
        self.ln2 = nn.LayerNorm(hidden, eps=eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attention(self.ln1(x), bias)
        return x + self.mlp(self.ln2(x))


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """BERT/GPT-2 initialisation: normal(0, std) for linear and embedding weights, zero biases, LayerNorm (1, 0)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=std)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.LayerNorm) and module.elementwise_affine:
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def language_model_workload(
    make_model,
    vocab_size: int,
    batch_size: int,
    seq_len: int,
    dtype: torch.dtype,
    device,
    seed: int,
    lr: float,
    name: str,
) -> Workload:
    """A next-token training step: the model `make_model()` builds (weights seeded with `seed`) on `device`
    in `dtype`, random tokens from `seed`, cross-entropy on the shifted tokens, AdamW."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = make_model()
    model = module_to(model, device, dtype).train()
    tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=torch.Generator().manual_seed(seed))
    return Workload(
        model=model,
        inputs=(tokens[:, :-1].to(device),),
        optimizer=torch.optim.AdamW(model.parameters(), lr=lr),
        loss_fn=TokenLoss(tokens[:, 1:].to(device)),
        name=name,
    )
