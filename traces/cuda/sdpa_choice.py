"""Which kernel `scaled_dot_product_attention` runs on a CUDA GPU: PyTorch's CUDA backend choice, in Python.

On a CUDA build, aten::scaled_dot_product_attention asks `select_sdp_backend` (sdp_utils.cpp) for a kernel:
flash, memory-efficient, cuDNN or the math composite, each with its own buffers. A torch built without CUDA
never asks (its composite takes the math path), so a fake CUDA step needs the choice made here, for the GPU
it is planned for (its compute capability) and the cuDNN its torch wheel loads. traces/cuda/sdpa_dispatch.py calls
the kernel chosen.

Source. The rules follow aten/src/ATen/native/transformers/cuda/sdp_utils.cpp as it stood on PyTorch's main
after pytorch/pytorch#174245 (merged 2026-02-26: cuDNN takes dropout only in steps of 1/16) and before the
filters that postdate the 2.13 release (a storage-offset alignment check and grouped-query attention for
memory-efficient attention, which need the three-parameter `check_batch_size_and_num_heads_dense`; cuDNN head
dim 256 on sm90/sm10x only with cuDNN > 9.22 and cudnn-frontend 1.24). No copy of the file at v2.13.0 was at
hand: the version is bounded by the header torch 2.13.0's wheel ships, torch/include/ATen/native/transformers/
sdp_utils_cpp.h, whose shape, mask, GQA, stride and sequence-length checks are ported from it exactly. Line
numbers below are that sdp_utils.cpp's (L...) or the header's (H...).

The cuDNN version: torch 2.13.0's CUDA 13.0 and 12.9 wheels require nvidia-cudnn-cu13/-cu12 == 9.20.0.48 (as
lock files that install them show; pytorch/pytorch#177321 moved the 12.8, 12.9 and 13.0 wheels to 9.20.0.48 in
March 2026, and the move to 9.23.1 in June did not reach 2.13.0), so CUDNN_VERSION is 92000, as
`versionRuntimeCuDNN()` reports 9.20.0. The CUDA 12.6 wheels' 9.10.2 (91002, not checked for 2.13) is not newer
than 9.15: there flash keeps the lead on an H100.

Other releases. A step runs on the torch the user has (memplan's --torch, torch_versions.py): torch 2.11's
rules (`TorchRules` TORCH_2_11) lack the dropout check of #174245 and the batch and head limit of #180718, and its
CUDA 13.0 wheels load cuDNN 9.19.0 (91900); everything else here is the same for it. Each function that reads a
release's rules takes `rules` (default: the installed torch's) and the cuDNN version from them unless given.

Not modelled: nested tensors (left to the composite), ROCm, builds without flash/memory-efficient/cuDNN
attention, FA3/FA4 kernels registered at run time (only FA3's dtype rule is), the per-process `static` reads of
the environment and of the cuDNN version (read at each call here), and the priority order's one-time cuDNN
preference: it is applied whenever the order is torch's default (a user who sets the default order explicitly
before the first call gets the cuDNN preference here, not on a GPU).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend

from memplan.torch_versions import INSTALLED, TorchRules

# torch 2.13.0's CUDA 12.9/13.0 wheels: nvidia-cudnn 9.20.0.48 -> major * 10000 + minor * 100 + patch.
CUDNN_VERSION = INSTALLED.cudnn_version
# at::Context's sdp_priority_order before check_prefer_cudnn_attention changes it (ATen/Context.h).
DEFAULT_ORDER = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.OVERRIDEABLE,
)
# priority_order (L103-116): the first four entries set to cuDNN, flash, efficient, math.
CUDNN_ORDER = (
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
    SDPBackend.OVERRIDEABLE,
)
HALF = (torch.float16, torch.bfloat16)
Capability = tuple[int, int]  # a GPU's compute capability (major, minor): (9, 0) for an H100
TRUE_ENV = {"1", "ON", "YES", "TRUE", "Y"}  # c10::utils::check_env's true values


class NoAttentionKernel(RuntimeError):
    """No kernel may run the call (as on a GPU: the user disabled the math kernel and no fused one fits)."""


@dataclass(frozen=True)
class Operand:
    """What the rules read of one tensor argument."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False

    @classmethod
    def of(cls, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> Operand:
        """The operand `tensor` is, with `dtype` instead of its own where autocast casts it."""
        return cls(tuple(tensor.shape), tuple(tensor.stride()), dtype or tensor.dtype, tensor.requires_grad)

    @classmethod
    def dense(cls, shape: tuple[int, ...], dtype: torch.dtype, requires_grad: bool = False) -> Operand:
        """A contiguous tensor of `shape`."""
        stride, step = [], 1
        for size in reversed(shape):
            stride.append(step)
            step *= max(size, 1)
        return cls(tuple(shape), tuple(reversed(stride)), dtype, requires_grad)


@dataclass(frozen=True)
class SdpaCall:
    """One scaled_dot_product_attention call as sdp_params holds it (H38-46), the grad mode included."""

    query: Operand
    key: Operand
    value: Operand
    mask: Operand | None = None
    dropout: float = 0.0
    is_causal: bool = False
    enable_gqa: bool = False
    grad_enabled: bool = True

    def requires_grad(self) -> bool:
        """input_requires_grad (H59-64): an input needs a gradient and grad mode is on."""
        return self.grad_enabled and any(t.requires_grad for t in (self.query, self.key, self.value))


@dataclass(frozen=True)
class SdpaFlags:
    """The user's switches the rules read: torch.backends.cuda.enable_*_sdp (and sdpa_kernel, which sets
    them), the priority order, deterministic algorithms, TORCH_CUDNN_SDPA_DEPRIORITIZED."""

    flash: bool = True
    mem_efficient: bool = True
    math: bool = True
    cudnn: bool = True
    fa3: bool = False
    overrideable: bool = True  # torch's default; no CUDA kernel overrides, so reaching it is an error
    deterministic: bool = False
    deterministic_warn_only: bool = False
    cudnn_deprioritized: bool = False
    order: tuple[SDPBackend, ...] = DEFAULT_ORDER

    @classmethod
    def current(cls) -> SdpaFlags:
        """The switches as this process has them now (at::globalContext()'s, readable on any build)."""
        c = torch._C
        return cls(
            flash=c._get_flash_sdp_enabled(),
            mem_efficient=c._get_mem_efficient_sdp_enabled(),
            math=c._get_math_sdp_enabled(),
            cudnn=c._get_cudnn_sdp_enabled(),
            fa3=c._get_fa3_sdp_enabled(),
            overrideable=c._get_overrideable_sdp_enabled(),
            deterministic=torch.are_deterministic_algorithms_enabled(),
            deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            cudnn_deprioritized=os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").upper() in TRUE_ENV,
            order=tuple(SDPBackend(int(b)) for b in c._get_sdp_priority_order()),
        )


def _sm_in(capability: Capability, low: Capability, high: Capability) -> bool:
    """check_sm_version (L287-296): low <= capability <= high."""
    return low <= tuple(capability) <= high


def prefers_cudnn(capability: Capability, cudnn_version: int = CUDNN_VERSION, flags: SdpaFlags = SdpaFlags()):
    """check_prefer_cudnn_attention (L78-101): cuDNN first on sm90/sm100/sm103 with a cuDNN newer than 9.15."""
    major, minor = capability
    return not flags.cudnn_deprioritized and cudnn_version > 91500 and major in (9, 10) and minor in (0, 3)


def priority_order(capability: Capability, cudnn_version: int = CUDNN_VERSION, flags: SdpaFlags = SdpaFlags()):
    """The order backends are tried (L103-116): the user's, else the default with cuDNN's preference."""
    if flags.order == DEFAULT_ORDER and prefers_cudnn(capability, cudnn_version, flags):
        return CUDNN_ORDER
    return flags.order


# The filters every backend shares (sdp_utils_cpp.h), each True when the call passes.


def _four_dims(c: SdpaCall) -> bool:
    """check_tensor_shapes (H323-340): query, key and value are 4-D."""
    return len(c.query.shape) == len(c.key.shape) == len(c.value.shape) == 4


def _nonzero_sequences(c: SdpaCall) -> bool:
    """check_nonzero_sequence_lengths_dense (H496-509)."""
    return c.query.shape[-2] != 0 and c.key.shape[-2] != 0


def _last_dim_stride_one(c: SdpaCall, ignore_singleton_dim: bool) -> bool:
    """check_last_dim_stride_equals_1_dense (H511-553), on a CUDA device (the mask's last stride counts)."""
    unit = all(t.stride[-1] == 1 for t in (c.query, c.key, c.value))
    if ignore_singleton_dim:
        unit = unit or c.query.shape[-1] == 1
    return unit and (c.mask is None or c.mask.stride[-1] == 1)


def _grouped_query(c: SdpaCall, requires_same_num_heads: bool) -> bool:
    """check_grouped_query_attention (H357-395)."""
    q, k, v = c.query.shape[-3], c.key.shape[-3], c.value.shape[-3]
    if requires_same_num_heads and k != v:
        return False
    return q % k == 0 and (requires_same_num_heads or q % v == 0)


def _batch_and_heads(c: SdpaCall, supports_gqa: bool, requires_same_num_heads: bool = True) -> bool:
    """check_batch_size_and_num_heads_dense (H397-452): one batch size; one head count, or GQA's grouping."""
    if not c.query.shape[0] == c.key.shape[0] == c.value.shape[0]:
        return False
    if c.enable_gqa and supports_gqa:
        return _grouped_query(c, requires_same_num_heads)
    return c.query.shape[-3] == c.key.shape[-3] == c.value.shape[-3]


def _mask_shape(c: SdpaCall) -> bool:
    """check_attn_mask_shape (H270-321): a mask without gradient, 2-D or 4-D, broadcastable to (B, H, L, S)."""
    if c.mask is None:
        return True
    m = c.mask
    if m.requires_grad or len(m.shape) < 2:
        return False
    batch, heads, q_len = c.query.shape[0], c.query.shape[1], c.query.shape[2]
    fits = lambda size, target: size in (target, 1)  # noqa: E731
    if not (fits(m.shape[-2], q_len) and fits(m.shape[-1], c.key.shape[2])):
        return False
    return len(m.shape) == 2 or (len(m.shape) == 4 and fits(m.shape[0], batch) and fits(m.shape[1], heads))


def _dtypes(c: SdpaCall, allowed: tuple[torch.dtype, ...]) -> bool:
    """check_tensor_dtype (H81-107): query, key and value share one of the allowed dtypes."""
    return c.query.dtype == c.key.dtype == c.value.dtype and c.query.dtype in allowed


def _low_precision(c: SdpaCall, capability: Capability) -> bool:
    """check_dtypes_low_precision (L702-712): fp16 and bf16 from sm80, fp16 before."""
    return _dtypes(c, HALF if capability[0] >= 8 else (torch.float16,))


def _first_failing(checks) -> str | None:
    """The name of the first check that fails, or None when all pass (checks: (name, thunk) pairs)."""
    return next((name for name, check in checks if not check()), None)


def flash_rejection(c: SdpaCall, capability: Capability, flags: SdpaFlags = SdpaFlags()) -> str | None:
    """Why flash attention may not run the call (the failing check's C++ name), or None: can_use_flash_attention
    (L819-869)."""
    e = c.query.shape[-1] if c.query.shape else 0

    def head_dims() -> bool:  # check_head_dim_size_flash (L146-216): equal and <= 256
        return c.query.shape[-1] == c.key.shape[-1] == c.value.shape[-1] and e <= 256

    def training_head_dim() -> bool:  # L415-447: no backward for these head dims on sm86-89 and sm120-121
        if not (c.requires_grad() and (_sm_in(capability, (8, 6), (8, 9)) or _sm_in(capability, (12, 0), (12, 1)))):
            return True
        return not (192 < e <= 224 or (e > 224 and c.dropout > 0.0))

    def dtypes() -> bool:  # check_dtypes_flash_attention (L714-723)
        if capability[0] >= 9 and flags.fa3:
            return _dtypes(c, (torch.float8_e4m3fn, *HALF))
        return _low_precision(c, capability)

    return _first_failing(
        [
            ("check_runtime_disabled_flash", lambda: flags.flash),
            ("check_tensor_shapes", lambda: _four_dims(c)),
            ("check_for_attn_mask", lambda: c.mask is None),
            ("check_head_dim_size_flash", head_dims),
            ("check_flash_attention_hardware_support", lambda: _sm_in(capability, (8, 0), (12, 1))),
            ("check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120", training_head_dim),
            ("check_flash_causal_non_square_seqlens", lambda: not c.is_causal or c.query.shape[-2] == c.key.shape[-2]),
            ("check_dtypes_flash_attention", dtypes),
            ("check_batch_size_and_num_heads_dense", lambda: _batch_and_heads(c, supports_gqa=True)),
            ("check_nonzero_sequence_lengths_dense", lambda: _nonzero_sequences(c)),
            ("check_last_dim_stride_equals_1_dense", lambda: _last_dim_stride_one(c, ignore_singleton_dim=True)),
        ]
    )


def gemm_alignment(dtype: torch.dtype, capability: Capability) -> int:
    """minimum_gemm_alignment (L118-141): the head dim multiple memory-efficient attention's GEMMs need."""
    is_half = dtype in HALF
    tensor_cores = capability[0] >= 8 or (capability[0] >= 7 and is_half)
    alignment = 4 if capability[0] >= 8 else 1
    return max(alignment, 128 // (16 if is_half else 32)) if tensor_cores else alignment


def efficient_rejection(c: SdpaCall, capability: Capability, flags: SdpaFlags = SdpaFlags()) -> str | None:
    """Why memory-efficient attention may not run the call, or None: can_use_mem_efficient_attention (L871-954)."""

    def head_dims() -> bool:  # check_head_dim_size_mem_efficient (L247-270)
        e, ev, align = c.query.shape[-1], c.value.shape[-1], gemm_alignment(c.query.dtype, capability)
        return e == c.key.shape[-1] and e % align == 0 and e > 0 and ev % align == 0 and ev > 0

    dtypes = (torch.float16, torch.float32, torch.bfloat16) if capability[0] >= 8 else (torch.float16, torch.float32)
    return _first_failing(
        [
            ("check_runtime_disabled_mem_efficient", lambda: flags.mem_efficient),
            ("check_mem_efficient_hardware_support", lambda: _sm_in(capability, (5, 0), (12, 1))),
            ("check_tensor_shapes", lambda: _four_dims(c)),
            ("check_head_dim_size_mem_efficient", head_dims),
            ("check_nonzero_sequence_lengths_dense", lambda: _nonzero_sequences(c)),
            ("check_last_dim_stride_equals_1_dense", lambda: _last_dim_stride_one(c, ignore_singleton_dim=False)),
            ("check_batch_size_and_num_heads_dense", lambda: _batch_and_heads(c, supports_gqa=False)),
            ("check_tensor_dtype", lambda: _dtypes(c, dtypes)),  # L947-952
        ]
    )


def cudnn_head_dim_limit(capability: Capability, cudnn_version: int, d_qk: int, d_v: int) -> int:
    """The largest head dim cuDNN attention takes (L528-543): 256 on sm90 from cuDNN 9.10, 192 for DeepSeek's
    (192, 128) on sm10x from 9.11, else 128."""
    if cudnn_version >= 91000 and tuple(capability) == (9, 0):
        return 256
    if cudnn_version >= 91100 and capability[0] == 10 and (d_qk, d_v) == (192, 128):
        return 192
    return 128


def cudnn_rejection(
    c: SdpaCall,
    capability: Capability,
    cudnn_version: int | None = None,
    flags: SdpaFlags = SdpaFlags(),
    rules: TorchRules = INSTALLED,
) -> str | None:
    """Why cuDNN attention may not run the call, or None: can_use_cudnn_attention (L752-809) of torch `rules`'s
    release, with cuDNN `cudnn_version` (default: the one its wheels load)."""
    cudnn_version = rules.cudnn_version if cudnn_version is None else cudnn_version

    def tensor_shapes() -> bool:  # check_cudnn_tensor_shapes (L498-590)
        (b, h, s_q, d_qk), s_k, d_v = c.query.shape, c.key.shape[2], c.value.shape[3]
        if rules.cudnn_batch_heads_limit and (b > 65535 or h > 65535):  # #180718
            return False
        if cudnn_version < 8903 or (cudnn_version < 8906 and c.dropout != 0.0):
            return False
        limit = cudnn_head_dim_limit(capability, cudnn_version, d_qk, d_v)
        if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8 or (cudnn_version < 8906 and s_k % 64):
            return False
        if cudnn_version < 90000 and (s_q < 64 or (c.dropout != 0.0 and (s_q % 64 or s_k % 64))):
            return False
        return s_k != 1 and not (s_q == 1 and c.dropout != 0.0)

    return _first_failing(
        [
            ("cudnn dropout in 9.11-9.13", lambda: not (c.dropout > 0.0 and 91100 < cudnn_version < 91400)),
            ("check_runtime_disabled_cudnn", lambda: flags.cudnn),
            ("check_tensor_shapes", lambda: _four_dims(c)),
            ("check_cudnn_deterministic", lambda: not flags.deterministic or flags.deterministic_warn_only),
            ("check_dtypes_low_precision", lambda: _low_precision(c, capability)),
            ("check_attn_mask_shape", lambda: _mask_shape(c)),
            ("check_cudnn_hardware_support", lambda: _sm_in(capability, (8, 0), (12, 1))),
            ("check_cudnn_dropout", lambda: not rules.cudnn_dropout_sixteenths or sixteenths(c.dropout)),
            ("check_nonzero_sequence_lengths_dense", lambda: _nonzero_sequences(c)),
            ("check_last_dim_stride_equals_1_dense", lambda: _last_dim_stride_one(c, ignore_singleton_dim=True)),
            ("check_batch_size_and_num_heads_dense", lambda: _batch_and_heads(c, True, requires_same_num_heads=False)),
            ("check_cudnn_tensor_shapes", tensor_shapes),
        ]
    )


def sixteenths(dropout: float) -> bool:
    """check_cudnn_dropout (L486-496, from #174245): the dropout a multiple of 1/16, the resolution of cuDNN's."""
    return dropout * 16.0 == math.floor(dropout * 16.0)


def select_backend(
    c: SdpaCall,
    capability: Capability,
    cudnn_version: int | None = None,
    flags: SdpaFlags | None = None,
    rules: TorchRules = INSTALLED,
) -> SDPBackend:
    """The kernel CUDA's select_sdp_backend (L956-1019) of torch `rules`'s release (default: the installed one)
    picks for the call on a GPU of `capability` with cuDNN `cudnn_version` (default: the one that release's wheels
    load): SDPBackend.ERROR when every backend is switched off; NoAttentionKernel when none that is on fits."""
    flags = SdpaFlags.current() if flags is None else flags
    cudnn_version = rules.cudnn_version if cudnn_version is None else cudnn_version
    if not (flags.math or flags.flash or flags.mem_efficient or flags.cudnn):
        return SDPBackend.ERROR
    for backend in priority_order(capability, cudnn_version, flags):
        cudnn = backend == SDPBackend.CUDNN_ATTENTION
        if cudnn and cudnn_rejection(c, capability, cudnn_version, flags, rules) is None:
            return backend
        if backend == SDPBackend.FLASH_ATTENTION and flash_rejection(c, capability, flags) is None:
            return backend
        if backend == SDPBackend.EFFICIENT_ATTENTION and efficient_rejection(c, capability, flags) is None:
            return backend
        if backend == SDPBackend.MATH and flags.math:
            return backend
        if backend == SDPBackend.OVERRIDEABLE and flags.overrideable:
            raise NoAttentionKernel("Invalid backend")  # select_sdp_backend's TORCH_CHECK when it gets this far
    reasons = {
        "memory efficient": efficient_rejection(c, capability, flags),
        "flash": flash_rejection(c, capability, flags),
        "cuDNN": cudnn_rejection(c, capability, cudnn_version, flags, rules),
    }
    why = "; ".join(f"{name}: {reason}" for name, reason in reasons.items())
    raise NoAttentionKernel(f"No available kernel. Aborting execution. (on sm{capability[0]}{capability[1]}: {why})")
