"""scaled_dot_product_attention on fake CUDA tensors runs the kernel a GPU would, with that kernel's buffers.

A torch built without CUDA sends every aten::scaled_dot_product_attention to the math branch of its composite,
which allocates the (B, H, L, S) attention matrix (and, in fp16/bf16, fp32 copies of query, key and value).
`cuda_attention` registers, for a fake CUDA step, a kernel of that op for CUDA tensors (`attend`) that does
what the composite (aten/src/ATen/native/transformers/attention.cpp, `scaled_dot_product_attention`) does on a
CUDA build: it picks the kernel as CUDA's rules do (traces/cuda/sdpa_choice.py) for the planned GPU and calls it as
the composite does: flash with query, key and value padded to a head dim multiple of 8 and the scale of the
unpadded one, memory-efficient and cuDNN with a boolean mask made additive (memory-efficient's padded to a
last-dim stride multiple of 8 and expanded to (B, H, L, S)), the logsumexp computed when an input needs a
gradient; the math branch as the composite's. Registered at AutogradCUDA, it runs after autocast's casts (as
on a GPU, the kernel is chosen for the cast dtype) and for every caller of the op, a checkpoint's
recomputation in backward on the autograd engine's thread included. Autograd then records the chosen kernel's
backward node, which saves the output, the logsumexp (fp32) and the RNG state, and its backward allocates the
kernel's gradients. The kernels' meta functions (torch/_meta_registrations.py) give the buffers: what a real
kernel allocates beyond them (flash backward's fp32 dq accumulator and softmax sums, GQA's expanded dk/dv,
split-KV partial sums, memory-efficient's fp32 output accumulator and backward delta, cuDNN's workspace) is
not modelled; memory-efficient attention's philox seed and offset, two 8-byte CPU tensors on a GPU outside
graph capture, are left out of the trace (traces/fake/mode.py's HOST_OUTPUTS); cuDNN's meta function allocates the
logsumexp even when no input needs a gradient. Under torch.inference_mode (no autograd keys) the op skips the
registration: the math path.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend

from memplan.torch_versions import INSTALLED, TorchRules
from memplan.traces.cuda.sdpa_choice import Capability, NoAttentionKernel, Operand, SdpaCall, select_backend

aten = torch.ops.aten
KEY = "AutogradCUDA"  # below Autocast, above the composite (CompositeImplicitAutograd) for CUDA tensors
FLASH_HEAD_DIM_MULTIPLE = 8  # pad_last_dim<8, false> before the flash kernel
MEM_EFF_MASK_ALIGNMENT = 8  # preprocess_mask's mem_eff_alignment


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """convert_boolean_attn_mask: a boolean mask as an additive one in the query's dtype (0 where attended,
    -inf elsewhere; cuDNN's variant fills another value, the same buffers)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    return torch.where(mask.logical_not(), -math.inf, zero)


def _aligned(tensor: torch.Tensor, alignment: int) -> bool:
    """aligned_tensor<alignment>: every stride but the last a multiple of `alignment`, the last 1."""
    return all(s % alignment == 0 for s in tensor.stride()[:-1]) and tensor.stride(-1) == 1


def _memory_efficient_mask(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """preprocess_mask: pad the bias's last dim (then slice it back) unless aligned, expand to (B, H, L, S)."""
    if not _aligned(mask, MEM_EFF_MASK_ALIGNMENT):
        last = mask.shape[-1]
        mask = F.pad(mask, (0, MEM_EFF_MASK_ALIGNMENT - last % MEM_EFF_MASK_ALIGNMENT))[..., :last]
    return mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])


def _pad_head_dim(tensor: torch.Tensor) -> torch.Tensor:
    """pad_last_dim<8, false>: the head dim zero-padded up to a multiple of 8 (unchanged when it is one)."""
    rest = tensor.shape[-1] % FLASH_HEAD_DIM_MULTIPLE
    return tensor if rest == 0 else F.pad(tensor, (0, FLASH_HEAD_DIM_MULTIPLE - rest))


def _logsumexp_wanted(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """should_compute_logsumexp: an input needs a gradient and grad mode is on."""
    return torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)


def _flash(query, key, value, attn_mask, dropout_p, is_causal, scale):
    """The composite's flash branch: padded head dims, the unpadded head dim's scale, the output sliced back."""
    head_dim = query.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = aten._scaled_dot_product_flash_attention(
        _pad_head_dim(query), _pad_head_dim(key), _pad_head_dim(value), dropout_p, is_causal, False, scale=scale
    )[0]
    return out if out.shape[-1] == head_dim else out[..., :head_dim]


def _efficient(query, key, value, attn_mask, dropout_p, is_causal, scale):
    """The composite's memory-efficient branch."""
    mask = _additive_mask(attn_mask, query.dtype)
    mask = None if mask is None else _memory_efficient_mask(mask, query, key)
    lse = _logsumexp_wanted(query, key, value)
    out = aten._scaled_dot_product_efficient_attention(query, key, value, mask, lse, dropout_p, is_causal, scale=scale)
    return out[0]


def _cudnn(query, key, value, attn_mask, dropout_p, is_causal, scale):
    """The composite's cuDNN branch."""
    mask = _additive_mask(attn_mask, query.dtype)
    lse = _logsumexp_wanted(query, key, value)
    return aten._scaled_dot_product_cudnn_attention(
        query, key, value, mask, lse, dropout_p, is_causal, False, scale=scale
    )[0]


KERNELS = {
    SDPBackend.FLASH_ATTENTION: _flash,
    SDPBackend.EFFICIENT_ATTENTION: _efficient,
    SDPBackend.CUDNN_ATTENTION: _cudnn,
}


def _validate(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None) -> None:
    """validate_sdpa_input: what the composite checks before it chooses (torch's messages)."""
    if not query.dtype == key.dtype == value.dtype:
        raise RuntimeError(
            "Expected query, key, and value to have the same dtype, but got query.dtype: "
            f"{query.dtype} key.dtype: {key.dtype} and value.dtype: {value.dtype} instead."
        )
    if not query.device == key.device == value.device:
        raise RuntimeError(
            "Expected query, key, and value to have the same device type, but got query.device: "
            f"{query.device} key.device: {key.device} and value.device: {value.device} instead."
        )
    if min(query.dim(), key.dim(), value.dim()) < 2:
        raise RuntimeError(
            "Expected query, key, and value to all be  at least 2 dimensional, but got query.dim: "
            f"{query.dim()} key.dim: {key.dim()} and value.dim: {value.dim()} instead."
        )
    if attn_mask is not None and attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
        raise RuntimeError(
            "Expected attn_mask dtype to be bool or float or to match query dtype, but got attn_mask.dtype: "
            f"{attn_mask.dtype} and  query.dtype: {query.dtype} instead."
        )


def attend(
    capability: Capability,
    rules: TorchRules,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """aten::scaled_dot_product_attention on CUDA tensors as a CUDA build of torch `rules`'s release runs it on a
    GPU of `capability` (attention.cpp's composite): validate, choose the kernel, call it; the math branch as the
    composite's."""
    _validate(query, key, value, attn_mask)
    call = SdpaCall(
        *(None if t is None else Operand.of(t) for t in (query, key, value, attn_mask)),
        dropout=float(dropout_p),
        is_causal=bool(is_causal),
        enable_gqa=bool(enable_gqa),
        grad_enabled=torch.is_grad_enabled(),
    )
    backend = select_backend(call, capability, rules=rules)
    if backend == SDPBackend.ERROR:
        raise NoAttentionKernel(
            "No viable backend for scaled_dot_product_attention was found. "
            "This is likely due to turning off both the math kernel and the fused kernels."
        )
    if backend == SDPBackend.MATH:
        mask, composite = _additive_mask(attn_mask, query.dtype), aten._scaled_dot_product_attention_math
        return composite(query, key, value, mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa)[0]
    return KERNELS[backend](query, key, value, attn_mask, dropout_p, is_causal, scale)


@contextlib.contextmanager
def cuda_attention(capability: Capability, rules: TorchRules = INSTALLED) -> Iterator[None]:
    """While the block runs, aten::scaled_dot_product_attention on CUDA tensors runs `attend` for a GPU of
    `capability` and torch `rules`'s release (its cuDNN included): a kernel registered for AutogradCUDA, below
    autocast (whose casts come first, as on a GPU) and above the composite, for every caller and thread (a
    checkpoint's recomputation in backward too); deregistered after the block."""
    library = torch.library.Library("aten", "IMPL")
    try:
        library.impl("scaled_dot_product_attention", functools.partial(attend, tuple(capability), rules), KEY)
        yield
    finally:
        library._destroy()  # as torch.library's own scoped libraries end
