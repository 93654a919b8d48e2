"""scaled_dot_product_attention on fake CUDA tensors runs the kernel a GPU would, with that kernel's buffers.

A torch built without CUDA sends every `F.scaled_dot_product_attention` to the math composite, which allocates
the (B, H, L, S) attention matrix (and, in fp16/bf16, fp32 copies of query, key and value). `cuda_attention`
is a TorchFunctionMode for a fake CUDA step: it picks the kernel as CUDA's rules do (traces/sdpa_cuda.py) for
the planned GPU and calls it as aten's composite does (aten/src/ATen/native/transformers/attention.cpp,
`scaled_dot_product_attention`): flash with query, key and value padded to a head dim multiple of 8 and the
scale of the unpadded one, memory-efficient and cuDNN with a boolean mask made additive (memory-efficient's
padded to a last-dim stride multiple of 8 and expanded to (B, H, L, S)), the logsumexp computed when an input
needs a gradient, autocast's casts made first. Autograd then records that kernel's backward node, which saves
the output, the logsumexp (fp32) and the RNG state, and its backward allocates the kernel's gradients; the
math path is left to the composite. The kernels' meta functions (torch/_meta_registrations.py) give the
buffers: what a real kernel allocates beyond them (flash backward's fp32 dq accumulator and softmax sums,
GQA's expanded dk/dv, split-KV partial sums, memory-efficient's fp32 output accumulator and backward delta,
cuDNN's workspace) is not modelled, and memory-efficient attention's philox seed and offset, two 8-byte CPU
tensors on a GPU outside graph capture, are device tensors here.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend
from torch.overrides import TorchFunctionMode

from memplan.traces.sdpa_cuda import CUDNN_VERSION, NoAttentionKernel, Operand, SdpaCall, select_backend

aten = torch.ops.aten
SDPA = F.scaled_dot_product_attention  # torch._C._nn.scaled_dot_product_attention
FLASH_HEAD_DIM_MULTIPLE = 8  # pad_last_dim<8, false> before the flash kernel
MEM_EFF_MASK_ALIGNMENT = 8  # preprocess_mask's mem_eff_alignment


def _autocast_dtype() -> torch.dtype | None:
    """The dtype CUDA autocast casts scaled_dot_product_attention's inputs to (its lower_precision_fp
    policy), or None when autocast is off."""
    return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None


def _eligible(tensor: torch.Tensor) -> bool:
    """autocast's is_eligible for a CUDA tensor: floating point, not fp64."""
    return tensor.is_floating_point() and tensor.dtype != torch.float64


def _cast_all(tensors: list, dtype: torch.dtype | None) -> list:
    """autocast's cached_cast of each argument: an eligible tensor in `dtype` (a copy when its dtype differs),
    an fp32 leaf that needs a gradient copied once however often it is passed (autocast's cache; the cache
    across calls is not modelled)."""
    if dtype is None:
        return tensors
    cache: dict[int, torch.Tensor] = {}
    out = []
    for t in tensors:
        if t is None or not _eligible(t) or t.dtype == dtype:
            out.append(t)
            continue
        cacheable = torch.is_autocast_cache_enabled() and t.dtype == torch.float32 and t.requires_grad
        cacheable = cacheable and t.is_leaf and not t._is_view()
        if not (cacheable and id(t) in cache):
            cache[id(t)] = t.to(dtype)
        out.append(cache[id(t)])
    return out


def _operand(tensor: torch.Tensor | None, dtype: torch.dtype | None) -> Operand | None:
    """The operand the rules see once autocast has cast `tensor` (read without casting: nothing allocated)."""
    if tensor is None:
        return None
    return Operand.of(tensor, dtype if dtype is not None and _eligible(tensor) else None)


def _routable(query, key, value, attn_mask) -> bool:
    """Whether the call is one a CUDA build would dispatch to its kernel choice: dense strided CUDA tensors."""
    tensors = [query, key, value] + ([] if attn_mask is None else [attn_mask])
    return all(
        isinstance(t, torch.Tensor) and t.device.type == "cuda" and t.layout == torch.strided and not t.is_nested
        for t in tensors
    )


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


def attend(
    capability: tuple[int, int],
    cudnn_version: int,
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
):
    """F.scaled_dot_product_attention as a CUDA build runs it on a GPU of `capability`: the chosen fused kernel,
    or the composite (math, and any call a CUDA build would not dispatch: nested, non-CUDA)."""
    args, kwargs = (query, key, value, attn_mask, dropout_p, is_causal), {"scale": scale, "enable_gqa": enable_gqa}
    if not _routable(query, key, value, attn_mask):
        return SDPA(*args, **kwargs)
    dtype = _autocast_dtype()
    call = SdpaCall(
        *(_operand(t, dtype) for t in (query, key, value, attn_mask)),
        dropout=float(dropout_p),
        is_causal=bool(is_causal),
        enable_gqa=bool(enable_gqa),
        grad_enabled=torch.is_grad_enabled(),
    )
    backend = select_backend(call, capability, cudnn_version)
    if backend == SDPBackend.ERROR:
        raise NoAttentionKernel(
            "No viable backend for scaled_dot_product_attention was found. "
            "This is likely due to turning off both the math kernel and the fused kernels."
        )
    if backend == SDPBackend.MATH:
        return SDPA(*args, **kwargs)  # the composite's math path, autocast applied by the dispatcher as on a GPU
    query, key, value, attn_mask = _cast_all([query, key, value, attn_mask], dtype)
    with torch.autocast("cuda", enabled=False) if dtype is not None else contextlib.nullcontext():
        return KERNELS[backend](query, key, value, attn_mask, dropout_p, is_causal, scale)


class _CudaAttention(TorchFunctionMode):
    """Sends F.scaled_dot_product_attention to `attend`; every other function runs as called."""

    def __init__(self, capability: tuple[int, int], cudnn_version: int):
        super().__init__()
        self._gpu = (tuple(capability), cudnn_version)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is SDPA:
            return attend(*self._gpu, *args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def cuda_attention(capability: tuple[int, int], cudnn_version: int = CUDNN_VERSION) -> Iterator[None]:
    """While the block runs, scaled_dot_product_attention on CUDA tensors takes the kernel a GPU of `capability`
    with cuDNN `cudnn_version` would; the mode is gone after the block."""
    with _CudaAttention(capability, cudnn_version):
        yield
