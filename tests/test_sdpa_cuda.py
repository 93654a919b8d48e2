"""scaled_dot_product_attention under --fake --device cuda takes the kernel CUDA's rules choose for the planned GPU
(traces/cuda/sdpa_choice.py), and the trace holds that kernel's buffers (traces/cuda/sdpa_dispatch.py).

The expected backends below are read from PyTorch's sdp_utils.cpp (the version traces/cuda/sdpa_choice.py names; L...
are its lines) and the sdp_utils_cpp.h torch 2.13.0 ships (H...), not from running the port:
- order (L78-116, ATen/Context.h): cuDNN first on sm90 and sm100 (minor 0 or 3) with cuDNN > 9.15 (the wheels'
  9.20); else flash, memory-efficient, math, cuDNN, so math takes whatever flash and memory-efficient refuse.
- cuDNN (L752-809): fp16/bf16 on sm80-sm121 (L702-712); dropout a multiple of 1/16 (L486-496), so 0.1 is
  refused; head dim <= 256 on sm90 from cuDNN 9.10, else <= 128 (L528-549); a 2-D mask is fine (H270-321).
- flash (L819-869): fp16/bf16 on sm80-sm121, no mask, head dim <= 256; training with head dim 256 and dropout is
  refused on sm86-sm89 (L415-447).
- memory-efficient (L871-954): sm50-sm121; head dim a multiple of 4 (fp32 from sm80), 8 (fp16/bf16 with tensor
  cores) or 1 (fp32 before sm80) (L118-141, L247-270); fp16/fp32/bf16 from sm80, fp16/fp32 before (L947-952).
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from memplan.gpus import GPU, gpu
from memplan.step import StepSpec
from memplan.traces.capture import capture_step
from memplan.traces.cuda.fake_device import fake_cuda_runtime
from memplan.traces.cuda.sdpa_choice import (
    CUDNN_VERSION,
    NoAttentionKernel,
    Operand,
    SdpaCall,
    SdpaFlags,
    select_backend,
)
from memplan.traces.cuda.sdpa_dispatch import KEY
from memplan.traces.fake.mode import FakeCapture
from memplan.traces.inputs.trace_model import trace_step
from memplan.traces.inputs.workload import Workload
from memplan.traces.recorder import recording

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GPUS = {"H100": (9, 0), "A100": (8, 0), "L40S": (8, 9), "B200": (10, 0), "T4": (7, 5)}  # L4, RTX 4090: sm89 too
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HEAD_DIMS = (64, 128, 256)
NAMES = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
         "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}  # fmt: skip
# Training (inputs need gradients), batch 2, 4 heads, 128 queries and keys. "causal": is_causal, no mask;
# "mask": a contiguous boolean (128, 128) mask. One column per head dim 64, 128, 256.
TABLE = """
H100 fp32 causal 0   efficient efficient efficient
H100 fp32 causal 0.1 efficient efficient efficient
H100 fp32 mask   0   efficient efficient efficient
H100 fp32 mask   0.1 efficient efficient efficient
H100 bf16 causal 0   cudnn     cudnn     cudnn
H100 bf16 causal 0.1 flash     flash     flash
H100 bf16 mask   0   cudnn     cudnn     cudnn
H100 bf16 mask   0.1 efficient efficient efficient
H100 fp16 causal 0   cudnn     cudnn     cudnn
H100 fp16 causal 0.1 flash     flash     flash
H100 fp16 mask   0   cudnn     cudnn     cudnn
H100 fp16 mask   0.1 efficient efficient efficient
A100 fp32 causal 0   efficient efficient efficient
A100 fp32 causal 0.1 efficient efficient efficient
A100 fp32 mask   0   efficient efficient efficient
A100 fp32 mask   0.1 efficient efficient efficient
A100 bf16 causal 0   flash     flash     flash
A100 bf16 causal 0.1 flash     flash     flash
A100 bf16 mask   0   efficient efficient efficient
A100 bf16 mask   0.1 efficient efficient efficient
A100 fp16 causal 0   flash     flash     flash
A100 fp16 causal 0.1 flash     flash     flash
A100 fp16 mask   0   efficient efficient efficient
A100 fp16 mask   0.1 efficient efficient efficient
L40S fp32 causal 0   efficient efficient efficient
L40S fp32 causal 0.1 efficient efficient efficient
L40S fp32 mask   0   efficient efficient efficient
L40S fp32 mask   0.1 efficient efficient efficient
L40S bf16 causal 0   flash     flash     flash
L40S bf16 causal 0.1 flash     flash     efficient
L40S bf16 mask   0   efficient efficient efficient
L40S bf16 mask   0.1 efficient efficient efficient
L40S fp16 causal 0   flash     flash     flash
L40S fp16 causal 0.1 flash     flash     efficient
L40S fp16 mask   0   efficient efficient efficient
L40S fp16 mask   0.1 efficient efficient efficient
B200 fp32 causal 0   efficient efficient efficient
B200 fp32 causal 0.1 efficient efficient efficient
B200 fp32 mask   0   efficient efficient efficient
B200 fp32 mask   0.1 efficient efficient efficient
B200 bf16 causal 0   cudnn     cudnn     flash
B200 bf16 causal 0.1 flash     flash     flash
B200 bf16 mask   0   cudnn     cudnn     efficient
B200 bf16 mask   0.1 efficient efficient efficient
B200 fp16 causal 0   cudnn     cudnn     flash
B200 fp16 causal 0.1 flash     flash     flash
B200 fp16 mask   0   cudnn     cudnn     efficient
B200 fp16 mask   0.1 efficient efficient efficient
T4   fp32 causal 0   efficient efficient efficient
T4   fp32 causal 0.1 efficient efficient efficient
T4   fp32 mask   0   efficient efficient efficient
T4   fp32 mask   0.1 efficient efficient efficient
T4   bf16 causal 0   math      math      math
T4   bf16 causal 0.1 math      math      math
T4   bf16 mask   0   math      math      math
T4   bf16 mask   0.1 math      math      math
T4   fp16 causal 0   efficient efficient efficient
T4   fp16 causal 0.1 efficient efficient efficient
T4   fp16 mask   0   efficient efficient efficient
T4   fp16 mask   0.1 efficient efficient efficient
"""
CASES = [
    (gpu, dtype, masking, float(p), head_dim, backend)
    for gpu, dtype, masking, p, *backends in (line.split() for line in TABLE.strip().splitlines())
    for head_dim, backend in zip(HEAD_DIMS, backends)
]


def call(dtype=torch.bfloat16, head_dim=64, masked=False, dropout=0.0, heads=4, kv_heads=None, queries=128, **kw):
    """A training call: batch 2, `heads` query heads (`kv_heads` key/value heads), `queries` queries, 128 keys."""
    kv_heads = kv_heads or heads
    q = Operand.dense((2, heads, queries, head_dim), dtype, requires_grad=True)
    kv = Operand.dense((2, kv_heads, 128, head_dim), dtype, requires_grad=True)
    mask = Operand.dense((queries, 128), torch.bool) if masked else None
    return SdpaCall(q, kv, kv, mask, dropout=dropout, is_causal=not masked, **kw)


def test_the_table_covers_every_gpu_dtype_head_dim_dropout_and_mask():
    assert len(CASES) == len(GPUS) * len(DTYPES) * 2 * 2 * len(HEAD_DIMS)
    assert {c[:5] for c in CASES} == {
        (g, d, m, p, e) for g in GPUS for d in DTYPES for m in ("causal", "mask") for p in (0.0, 0.1) for e in HEAD_DIMS
    }


@pytest.mark.parametrize("gpu, dtype, masking, dropout, head_dim, backend", CASES)
def test_backend_is_the_one_cudas_rules_choose(gpu, dtype, masking, dropout, head_dim, backend):
    c = call(DTYPES[dtype], head_dim, masked=masking == "mask", dropout=dropout)
    assert select_backend(c, GPUS[gpu], CUDNN_VERSION, SdpaFlags()) == NAMES[backend]


@pytest.mark.parametrize(
    "gpu, dtype, expected",
    [
        ("H100", torch.bfloat16, "cudnn"),  # cuDNN groups heads without needing key heads == value heads
        ("A100", torch.bfloat16, "flash"),  # flash supports GQA (L855-858)
        ("A100", torch.float32, "math"),  # memory-efficient needs one head count (L926): the math composite
    ],
)
def test_grouped_query_attention(gpu, dtype, expected):
    c = call(dtype, heads=8, kv_heads=2, enable_gqa=True)
    assert select_backend(c, GPUS[gpu], CUDNN_VERSION, SdpaFlags()) == NAMES[expected]


def test_flash_refuses_training_head_dims_sm86_to_sm89_cannot_backpropagate():
    training, inference = call(head_dim=200), call(head_dim=200, grad_enabled=False)  # 192 < 200 <= 224 (L431)
    assert select_backend(training, GPUS["L40S"], flags=SdpaFlags()) == SDPBackend.EFFICIENT_ATTENTION
    assert select_backend(inference, GPUS["L40S"], flags=SdpaFlags()) == SDPBackend.FLASH_ATTENTION
    assert select_backend(training, GPUS["A100"], flags=SdpaFlags()) == SDPBackend.FLASH_ATTENTION


def test_causal_with_fewer_queries_than_keys_is_not_flash():
    """FlashAttention 2 aligns a non-square causal mask bottom-right: PyTorch refuses it (L449-465)."""
    assert select_backend(call(queries=64), GPUS["A100"], flags=SdpaFlags()) == SDPBackend.EFFICIENT_ATTENTION


def test_the_cudnn_version_decides_cudnns_priority():
    """cu126 wheels ship cuDNN 9.10.2: not newer than 9.15, so flash keeps the lead on an H100 (L91)."""
    assert select_backend(call(), GPUS["H100"], 91002, SdpaFlags()) == SDPBackend.FLASH_ATTENTION
    assert select_backend(call(), GPUS["H100"], CUDNN_VERSION, SdpaFlags()) == SDPBackend.CUDNN_ATTENTION


@pytest.mark.parametrize(
    "flags, expected",
    [
        (SdpaFlags(cudnn=False), SDPBackend.FLASH_ATTENTION),
        (SdpaFlags(cudnn=False, flash=False), SDPBackend.EFFICIENT_ATTENTION),
        (SdpaFlags(cudnn=False, flash=False, mem_efficient=False), SDPBackend.MATH),
        (SdpaFlags(deterministic=True), SDPBackend.FLASH_ATTENTION),  # cuDNN SDPA is not deterministic (L737)
        (SdpaFlags(deterministic=True, deterministic_warn_only=True), SDPBackend.CUDNN_ATTENTION),
        (SdpaFlags(cudnn_deprioritized=True), SDPBackend.FLASH_ATTENTION),  # TORCH_CUDNN_SDPA_DEPRIORITIZED
        (SdpaFlags(flash=False, mem_efficient=False, math=False, cudnn=False), SDPBackend.ERROR),
    ],
)
def test_the_users_switches(flags, expected):
    assert select_backend(call(), GPUS["H100"], CUDNN_VERSION, flags) == expected


def test_no_kernel_that_is_on_fits_is_an_error_as_on_a_gpu():
    """The loop reaches the overrideable backend (on by default: TORCH_CHECK "Invalid backend", L994-998), or
    ends and fails with the reasons (L1003-1017)."""
    fp32 = call(torch.float32)
    with pytest.raises(NoAttentionKernel, match="Invalid backend"):
        select_backend(fp32, GPUS["H100"], flags=SdpaFlags(math=False, mem_efficient=False))
    with pytest.raises(NoAttentionKernel, match="No available kernel.*check_dtypes_low_precision"):
        select_backend(fp32, GPUS["H100"], flags=SdpaFlags(math=False, mem_efficient=False, overrideable=False))


def test_the_switches_are_read_from_torch_where_sdpa_kernel_sets_them():
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        assert select_backend(call(), GPUS["H100"]) == SDPBackend.EFFICIENT_ATTENTION
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION], set_priority=True):
        assert select_backend(call(), GPUS["H100"]) == SDPBackend.FLASH_ATTENTION  # the user's order wins
    assert select_backend(call(), GPUS["H100"]) == SDPBackend.CUDNN_ATTENTION


# --- the kernel's buffers in a fake CUDA trace ----------------------------------------------------------------

B, H, T, E = 2, 4, 256, 32  # the attention matrix (B, H, T, T) dwarfs every other buffer


class Attention(nn.Module):
    """Self-attention through F.scaled_dot_product_attention: fused qkv projection, SDPA, output projection."""

    def __init__(self, dropout: float = 0.0, masked: bool = False):
        super().__init__()
        self.qkv, self.out = nn.Linear(H * E, 3 * H * E), nn.Linear(H * E, H * E)
        self.dropout, self.masked = dropout, masked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(B, T, 3, H, E).permute(2, 0, 3, 1, 4)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril() if self.masked else None
        y = F.scaled_dot_product_attention(q, k, v, mask, self.dropout, is_causal=not self.masked)
        return self.out(y.transpose(1, 2).reshape(B, T, H * E))


@contextlib.contextmanager
def fake_cuda(device: GPU):
    """Fake CUDA tensors for `device`, their storages recorded: the recorder."""
    with fake_cuda_runtime(device), recording(torch.device("cuda"), fake=True) as recorder:
        with FakeCapture(recorder, "cuda"):
            yield recorder


def attention_step(device: GPU, dtype: torch.dtype, dropout: float = 0.0, masked: bool = False):
    """One forward and backward of Attention on fake CUDA tensors for `device`: the step's allocations as
    (bytes, op) and the loss's and the parameters' gradient shapes."""
    with fake_cuda(device) as recorder:
        model = Attention(dropout, masked).to("cuda", dtype)
        x = torch.randn(B, T, H * E, device="cuda", dtype=dtype)
        recorder.begin_step()
        loss = model(x).float().square().mean()
        loss.backward()
        events, names = recorder.end_step(), recorder.names()
        shapes = [tuple(loss.shape)] + [tuple(p.grad.shape) for p in model.parameters()]
    allocations = [(int(size), names[op]) for size, op in zip(events.size, events.op) if size > 0]
    return allocations, shapes


H100 = gpu("H100-80GB")
T4 = dataclasses.replace(gpu("L4"), name="T4", aliases=("NVIDIA Tesla T4",), capability=(7, 5))  # not catalogued
SHAPES = [(), (3 * H * E, H * E), (3 * H * E,), (H * E, H * E), (H * E,)]


@pytest.mark.parametrize(
    "dropout, kernel, logsumexp",
    [
        (0.1, "aten::_scaled_dot_product_flash_attention", B * H * T * 4),  # (B, H, T) fp32
        (0.0, "aten::_scaled_dot_product_cudnn_attention", B * H * T * 1 * 4),  # (B, H, T, 1) fp32
    ],
)
def test_fused_attention_on_an_h100_keeps_its_logsumexp_and_no_attention_matrix(dropout, kernel, logsumexp):
    allocations, shapes = attention_step(H100, torch.bfloat16, dropout)
    forward = [size for size, op in allocations if op == kernel]
    assert forward[:2] == [B * H * T * E * 2, logsumexp]  # the bf16 output, then the fp32 logsumexp
    assert kernel + "_backward" in {op for _, op in allocations}
    assert max(size for size, _ in allocations) < B * H * T * T * 2  # no (B, H, T, T) buffer, bf16 or fp32
    assert shapes == SHAPES


def test_math_attention_on_a_t4_keeps_the_attention_matrix():
    """bf16 on sm75: flash needs sm80, memory-efficient takes fp16/fp32 only there, cuDNN sm80: the math
    composite, which computes in fp32 (B, H, T, T) matrices (fp32 on a T4 takes memory-efficient attention)."""
    allocations, shapes = attention_step(T4, torch.bfloat16)
    ops = {op for _, op in allocations}
    assert not any("_scaled_dot_product" in op for op in ops)
    assert [op for size, op in allocations if size == B * H * T * T * 4][:2] == ["aten::bmm", "aten::_safe_softmax"]
    assert shapes == SHAPES


def test_memory_efficient_attention_takes_the_mask_as_an_additive_bias():
    allocations, _ = attention_step(H100, torch.float32, masked=True)
    ops = [op for _, op in allocations]
    assert ops.index("aten::where") < ops.index("aten::_scaled_dot_product_efficient_attention")
    assert (T * T * 4, "aten::where") in allocations  # the fp32 bias of the (T, T) boolean mask
    assert "aten::_scaled_dot_product_efficient_attention_backward" in ops


def test_a_checkpoints_recomputation_in_backward_runs_the_same_kernel():
    """torch.utils.checkpoint recomputes the forward inside backward (on the autograd engine's thread when it has
    one): the recomputed SDPA saves what the first one saved, the cuDNN kernel's tensors."""
    with fake_cuda(H100) as recorder:
        model = Attention().to("cuda", torch.bfloat16)
        x = torch.randn(B, T, H * E, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        recorder.begin_step()
        checkpoint(model, x, use_reentrant=False).float().mean().backward()
        events, names = recorder.end_step(), recorder.names()
    ops = [names[op] for size, op in zip(events.size, events.op) if size > 0]
    assert ops.count("aten::_scaled_dot_product_cudnn_attention") == 4 * 2  # output, logsumexp, seed, offset; twice
    assert "aten::_safe_softmax" not in ops


def test_autocast_casts_before_the_kernel_is_chosen():
    """fp32 parameters under CUDA autocast to bf16: query, key and value reach SDPA in bf16 (autocast's
    policy for it), so an H100 takes cuDNN, not fp32 memory-efficient attention."""
    with fake_cuda(H100):
        q = torch.randn(B, H, T, E, device="cuda", requires_grad=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert y.dtype == torch.bfloat16 and type(y.grad_fn).__name__ == "ScaledDotProductCudnnAttentionBackward0"


def test_the_hook_lives_only_inside_a_fake_cuda_capture():
    """A fake CUDA capture runs the GPU's kernel; a CPU trace after it is the one taken before it."""

    def build(device: str):
        def workload() -> Workload:
            model = Attention().to(device, torch.bfloat16)
            x = torch.randn(B, T, H * E, device=device, dtype=torch.bfloat16)
            return Workload(model, x, torch.optim.SGD(model.parameters(), lr=0.1), lambda y, _: y.float().mean())

        return workload

    cpu_before = capture_step(build("cpu"))
    cuda = capture_step(build("cuda"), device="cuda", fake=True)
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::scaled_dot_product_attention", KEY)
    cpu_after = capture_step(build("cpu"))
    assert "aten::_scaled_dot_product_cudnn_attention" in set(cuda.op)  # an H100's choice for bf16
    assert list(cpu_after.op) == list(cpu_before.op) and list(cpu_after.size) == list(cpu_before.size)
    assert not any("cudnn" in op or "_scaled_dot_product_flash_attention" == op for op in cpu_after.op)


def test_flash_pads_a_head_dim_that_is_not_a_multiple_of_8():
    """pad_last_dim<8, false>: query, key and value padded to head dim 64 for the kernel, its output sliced back
    to 60 (a view), the scale that of head dim 60."""
    with fake_cuda(gpu("A100-80GB")) as recorder:
        q, k, v = (torch.randn(B, H, T, 60, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        recorder.begin_step()
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        events, names = recorder.end_step(), recorder.names()
    padded = B * H * T * 64 * 2
    allocations = [(int(size), names[op]) for size, op in zip(events.size, events.op) if size > 0]
    assert allocations[:4] == [(padded, "aten::constant_pad_nd")] * 3 + [(padded, allocations[3][1])]
    assert allocations[3][1] == "aten::_scaled_dot_product_flash_attention"
    assert tuple(y.shape) == (B, H, T, 60)


@pytest.mark.parametrize(
    "name, kernel",
    [
        ("H100-80GB", "aten::_scaled_dot_product_cudnn_attention"),
        ("A100-80GB", "aten::_scaled_dot_product_flash_attention"),
    ],
)
def test_the_gpu_a_step_is_traced_for_chooses_the_kernel(name, kernel):
    """examples/llama.py in bf16 (grouped-query heads, causal, no dropout) traced for a catalogue GPU (--gpu)."""
    step = StepSpec(EXAMPLES / "llama.py", batch=2, seq=64, dtype="bfloat16", device="cuda", fake=True, gpu=name)
    ops = set(trace_step(step).op)
    assert kernel in ops and kernel + "_backward" in ops
    assert "aten::_safe_softmax" not in ops
