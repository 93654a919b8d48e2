"""Attention cores with less held for backward: Tempo's sub-layer dropout recomputation and Megatron's
selective recomputation.

Both compute softmax(q·kᵀ·scale + bias), dropout (1-byte mask), times v, exactly like
`planner.layers.baseline.AttentionCore`; q, k, v are (batch, heads, seq, head_dim).
"""

from __future__ import annotations

import math
import struct

import torch
from torch import nn
from torch.nn import functional as F

from memplan.modes import BASELINE, SELECTIVE, TEMPO
from memplan.planner.layers import fusion


def attention_scores(q, k, scale: float, bias):
    """q·kᵀ·scale (+ bias), before the softmax."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    return scores if bias is None else scores + bias


def baseline_attention(q, k, v, bias, scale: float, dropout_p: float, training: bool):
    """The reference core: autograd keeps Megatron's baseline (Q, K, softmax out, 1-byte mask, dropout out, V)."""
    probs = F.softmax(attention_scores(q, k, scale, bias), dim=-1)
    if training and dropout_p > 0.0:
        probs = torch.native_dropout(probs, dropout_p, True)[0]
    return torch.matmul(probs, v)


def autocast_state(device_type: str) -> dict:
    """The autocast setting in force for `device_type`, to re-enter in backward (as torch.utils.checkpoint does)."""
    return {
        "device_type": device_type,
        "enabled": torch.is_autocast_enabled(device_type),
        "dtype": torch.get_autocast_dtype(device_type),
        "cache_enabled": torch.is_autocast_cache_enabled(),
    }


class DropoutMatmulFunction(torch.autograd.Function):
    """dropout(probs)·v holding probs (the softmax keeps it anyway), the 1-byte mask and v; the dropout output
    is rebuilt.

    Backward runs under the forward's autocast setting, so under mixed precision both matmuls see the
    dtypes they saw in forward and the gradients round as the baseline's do."""

    @staticmethod
    def forward(ctx, probs, v, p: float):
        dropped, mask = torch.native_dropout(probs, p, True)
        v = v.contiguous()
        ctx.scale = 1.0 / (1.0 - p)
        ctx.autocast = autocast_state(probs.device.type)
        ctx.save_for_backward(probs, mask, v)
        return torch.matmul(dropped, v)

    @staticmethod
    def backward(ctx, grad):
        probs, mask, v = ctx.saved_tensors
        with torch.autocast(**ctx.autocast):
            # as native_dropout rounds it (bf16 too); the scales rounded as torch would, so a fused kernel's bits agree
            dropped = DROPOUT_AGAIN(probs, mask, rounded(ctx.scale, probs.dtype))
            grad_v = torch.matmul(dropped.transpose(-2, -1), grad) if ctx.needs_input_grad[1] else None
            grad_dropped = torch.matmul(grad, v.transpose(-2, -1)).to(probs.dtype)
        scale = rounded(ctx.scale, torch.promote_types(grad_dropped.dtype, torch.float32))  # as a number times a tensor
        return DROPOUT_GRADIENT(grad_dropped, mask, scale), grad_v, None


def dropout_again(probs: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """The dropout output rebuilt from its 1-byte mask: probs·(mask·scale) in probs' dtype; pure, so it fuses."""
    return probs * (mask.to(probs.dtype) * scale)


def dropout_gradient(grad: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """The gradient through the dropout: grad·mask·scale; pure, so it fuses."""
    return grad * mask * scale


DROPOUT_AGAIN = fusion.fused(dropout_again)
DROPOUT_GRADIENT = fusion.fused(dropout_gradient)


def rounded(value: float, dtype: torch.dtype) -> float:
    """`value` as torch rounds a Python number for an op on `dtype`: to fp32, then to bf16 or fp16 (to nearest,
    ties to even), without a tensor (a backward's allocations stay those of its ops)."""
    if dtype == torch.float64:
        return value
    as_fp32 = struct.unpack("<f", struct.pack("<f", value))[0]
    if dtype == torch.float16:
        return struct.unpack("<e", struct.pack("<e", as_fp32))[0]
    if dtype == torch.bfloat16:
        bits = struct.unpack("<I", struct.pack("<f", as_fp32))[0]
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return struct.unpack("<f", struct.pack("<I", bits))[0]
    return as_fp32


def tempo_attention(q, k, v, bias, scale: float, dropout_p: float, training: bool):
    """The core with sub-layer dropout recomputation: saves p·as²b bytes per layer against the baseline."""
    probs = F.softmax(attention_scores(q, k, scale, bias), dim=-1)
    if not training or dropout_p == 0.0:
        return torch.matmul(probs, v)
    return DropoutMatmulFunction.apply(probs, v, dropout_p)


class RecomputedAttentionFunction(torch.autograd.Function):
    """The whole core recomputed in backward from q, k, v and the RNG state saved before the dropout (same mask)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, scale: float, dropout_p: float, training: bool):
        ctx.device = q.device
        # Only dropout draws random numbers; its generator state (5,056 B for the CPU's MT19937, 16 B on CUDA) is kept.
        ctx.rng = rng_state(q.device) if training and dropout_p > 0.0 else None
        ctx.args = (scale, dropout_p, training)
        ctx.autocast = autocast_state(q.device.type)  # recomputed under the same mixed precision
        ctx.save_for_backward(q, k, v, bias)
        with torch.no_grad():
            return baseline_attention(q, k, v, bias, scale, dropout_p, training)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, bias = ctx.saved_tensors
        inputs = [
            t.detach().requires_grad_(need) if t is not None else None
            for t, need in zip((q, k, v, bias), ctx.needs_input_grad[:4])
        ]
        devices = [ctx.device] if ctx.device.type == "cuda" else []
        with (
            torch.random.fork_rng(devices=devices, device_type=ctx.device.type),
            torch.enable_grad(),
            torch.autocast(**ctx.autocast),
        ):
            if ctx.rng is not None:
                set_rng_state(ctx.device, ctx.rng)
            out = baseline_attention(*inputs, *ctx.args)
        wanted = [t for t in inputs if t is not None and t.requires_grad]  # a learned bias gets its gradient too
        grads = iter(torch.autograd.grad(out, wanted, grad)) if wanted else iter(())
        return (*(next(grads) if t is not None and t.requires_grad else None for t in inputs), None, None, None)


def rng_state(device: torch.device) -> torch.Tensor:
    """The generator state dropout on `device` will draw from next."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    """Restore the generator state of `device` (inside a fork_rng block)."""
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def selective_attention(q, k, v, bias, scale: float, dropout_p: float, training: bool):
    """The core under selective recomputation: holds only q, k and v (the layer's QKV output)."""
    if not torch.is_grad_enabled():
        return baseline_attention(q, k, v, bias, scale, dropout_p, training)
    return RecomputedAttentionFunction.apply(q, k, v, bias, scale, dropout_p, training)


CORES = {BASELINE: baseline_attention, TEMPO: tempo_attention, SELECTIVE: selective_attention}  # by modes.Mode.core


class PatchedAttentionCore(nn.Module):
    """Drop-in for `blocks.AttentionCore` computing the core with one of CORES (tempo or selective)."""

    def __init__(self, dropout_p: float, kind: str):
        super().__init__()
        self.dropout_p = dropout_p
        self.kind = kind

    def forward(self, q, k, v, bias=None):
        return CORES[self.kind](q, k, v, bias, 1.0 / math.sqrt(q.size(-1)), self.dropout_p, self.training)

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, dropout_p={self.dropout_p}"
