"""The GPUs people rent, as memplan's verdict and the CUDA capture need them: each one's memory as PyTorch reports
it, its compute capability and architecture, the workspaces PyTorch's cuBLAS handles take through the caching
allocator, the CUDA context held outside it, and its link to the host. `gpu(name)` looks one up by any of its
names. Every figure says where it comes from (docs/fit-optimize.md: The GPU catalogue); an estimate says so.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass

from memplan.errors import MemplanError
from memplan.limits import short_repr
from memplan.torch_versions import INSTALLED, TorchRules
from memplan.units import MiB

# The vocabulary, first. `memory` is what torch.cuda.get_device_properties().total_memory reports
# (cudaDeviceProp.totalGlobalMem): a little less than nvidia-smi's total, and a few MiB apart between driver
# versions; torch prints it in whole MiB (truncated). Figures quoted as "N MiB (torch)" are N * 2**20, within
# 1 MiB of the real one; figures quoted in bytes are deviceQuery's exact totalGlobalMem.
AMPERE, ADA, HOPPER, BLACKWELL = "Ampere", "Ada", "Hopper", "Blackwell"
ARCHITECTURES = {8: AMPERE, 9: HOPPER, 10: BLACKWELL}  # by major compute capability; 8.9 is Ada (below)

# PCIe: 16 lanes x the generation's transfer rate x 128/130 (its line code) / 8 bits, one way; NVLink-C2C:
# NVIDIA's Grace Hopper datasheet, 900 GB/s both ways together.
PCIE_GEN4_X16 = 16 * 16_000_000_000 * 128 // 130 // 8  # 31,507,692,307 B/s
PCIE_GEN5_X16 = 16 * 32_000_000_000 * 128 // 130 // 8  # 63,015,384,615 B/s
NVLINK_C2C = 450_000_000_000  # 900 GB/s both ways

# PyTorch's default cuBLAS workspace (aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize, when
# CUBLAS_WORKSPACE_CONFIG is unset): 32 MiB (4096 KiB x 8) on the compute capability majors of the release's
# `TorchRules.cublas_large_majors` (torch 2.13: 9, 10, 11, 12, Hopper and Blackwell; torch 2.0 to 2.11: 9 alone,
# pytorch/pytorch#89027 and #175344), else ":4096:2:16:8" = 2 x 4096 KiB + 8 x 16 KiB.
# One is allocated through the caching allocator per (cuBLAS handle, stream); handles are per thread, so a
# training step holds two: its own thread's and the autograd engine's backward thread's. cuBLASLt (addmm's fused
# bias, for one) takes its own CUBLASLT_WORKSPACE_SIZE, default 1024 KiB, per handle and stream, unless
# TORCH_CUBLASLT_UNIFIED_WORKSPACE makes it share cuBLAS's. Measured on an H100 with torch 2.11
# (docs/gpu-validation.md): every real step held 2 x 32 MiB + 1 MiB of workspaces (68,157,440 B), and the
# models without biases (Llama) 2 x 32 MiB.
CUBLAS_WORKSPACE_LARGE = 4096 * 8 * 1024  # 33,554,432 B: one real set of Hopper snapshots measured this
CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8  # 8,519,680 B: another real set measured this
CUBLASLT_WORKSPACE = 1024 * 1024  # 1,048,576 B

# Dense peak FLOP/s (no 2:4 sparsity), from NVIDIA's datasheets: bf16 on the tensor cores with fp32 accumulation,
# and fp32 without them (PyTorch's matmuls do not use TF32 unless asked). H100 SXM5, H200 and GH200: 989 and 67
# TFLOPS; H100 PCIe: 756 and 51; A100: 312 and 19.5; L40S: 362 and 91.6; L4: 121 and 30.3; RTX 4090 (Ada's
# whitepaper, bf16 with fp32 accumulation): 165.2 and 82.6; B200 (HGX B200, per GPU): 2,250 and 75 (an ESTIMATE
# for fp32: NVIDIA quotes the 8-GPU board). A step's recompute costs its FLOPs at this rate: the least time it can
# take, as offload's transfer time is the link's when nothing overlaps.
TFLOPS = 10**12

# An ESTIMATE of the CUDA context during a training step: driver state, the kernels loaded so far, the
# device-side stack. With lazy module loading (CUDA 11.7+, PyTorch's default) PyTorch's maintainers put the
# context at about 300 MB (pytorch/pytorch#107667, 2023) to 400 MB (#109888, 2023) right after the first CUDA
# call; a training step lazily loads cuBLAS, cuDNN and NCCL kernels on top, so memplan counts 512 MiB. Where
# OUTSIDE_MEASURED has a row for the GPU and the torch the step runs on, the verdict counts that instead.
CUDA_CONTEXT_ESTIMATE = 512 * MiB

# An ESTIMATE of what one NCCL communicator (one process group) holds outside the caching allocator: measured
# on 4 A100s over NVLink with PyTorch as the front end, 544 MB for a 2-rank group and 688 MB for larger ones
# (NVIDIA/nccl#964, 2023). It grows with NCCL's channels (NCCL_BUFFSIZE, 4 MiB per channel and peer by
# default) and algorithms, so faster links may hold more; memplan counts the larger figure, in MiB.
NCCL_PER_PROCESS_GROUP = 688 * MiB
NCCL_SOURCE = "estimate: NVIDIA/nccl#964, 4 A100s over NVLink"
CUDA_CONTEXT_SOURCE = "estimate: pytorch/pytorch#107667 and #109888, plus the step's kernels"
GIVEN_SOURCE = "given (--outside)"


@dataclass(frozen=True)
class OutsideMeasurement:
    """Memory a GPU held outside the caching allocator after real training steps, with one torch and CUDA: the
    CUDA context, the kernels a step loaded and the libraries' handles (cuBLAS's and cuBLASLt's workspaces are not
    among them: PyTorch takes them through the caching allocator, so a trace holds them or the verdict adds them)."""

    gpu: str  # the catalogue's name
    torch: str  # the TorchRules version the step ran on ("2.11")
    cuda: str  # the CUDA runtime of its wheel ("13.0")
    bytes: int  # total_memory - torch.cuda.mem_get_info()[0] - torch.cuda.memory_reserved(), read after the steps
    source: str  # when, what program, how read


# What real runs measured, one row per (GPU, torch, CUDA); a step's verdict on that GPU and torch counts the row
# instead of CUDA_CONTEXT_ESTIMATE. Measure more when a GPU is lent (../shared/GPU_CHECKS.md, item 2).
OUTSIDE_MEASURED = (
    # The b7 (default allocator) and b8 (expandable segments) runs read the same bytes after three steps; the b9 run
    # that ran out of memory in its first step read 728,563,712 B: its context had not loaded every kernel yet.
    OutsideMeasurement("H200", "2.11", "13.0", 804_061_184,
                       "measured 2026-11-28 on an H200 (driver 580.159.04), torch 2.11.0+cu130: total_memory - "
                       "mem_get_info()[0] - memory_reserved() after three training steps of a Llama-3.2-1B-shaped "
                       "HuggingFace loop, bf16 autocast, AdamW, no NCCL (../shared/traces/h200-programs/PROGRAMS.md)"),
)  # fmt: skip


def outside_measurement(gpu: GPU, rules: TorchRules = INSTALLED) -> OutsideMeasurement | None:
    """The measurement of what `gpu` holds outside the caching allocator with torch `rules`'s release, or None."""
    return next((m for m in OUTSIDE_MEASURED if m.gpu == gpu.name and m.torch == rules.version), None)


class GPUError(MemplanError):
    """A GPU name the catalogue does not know, or a memory size given both as bytes and as a GPU."""


def cublas_workspace_size(capability: tuple[int, int], rules: TorchRules = INSTALLED) -> int:
    """PyTorch's cuBLAS workspace bytes per (handle, stream) on a GPU of `capability` with torch `rules`'s release
    (default: the installed one): what each handle's first matmul takes through the caching allocator.
    CUBLAS_WORKSPACE_CONFIG's ":SIZE:COUNT" pairs (KiB x count) when the environment sets it, as PyTorch reads it;
    else that release's default for the architecture."""
    pairs = re.findall(r":([0-9]+):([0-9]+)", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if pairs:
        return sum(int(size) * 1024 * int(count) for size, count in pairs)
    return CUBLAS_WORKSPACE_LARGE if capability[0] in rules.cublas_large_majors else CUBLAS_WORKSPACE_DEFAULT


@dataclass(frozen=True)
class GPU:
    """One GPU model of the catalogue, with the figures that decide whether a training step fits it."""

    name: str  # the catalogue's name, as reports print it: "H100-80GB"
    aliases: tuple[str, ...]  # other names accepted on the command line (case-insensitive; spaces and _ read as -)
    memory: int  # bytes, as torch.cuda.get_device_properties().total_memory reports it (see the vocabulary above)
    capability: tuple[int, int]  # compute capability (major, minor): the attention backend's and cuBLAS's rules
    host_link: str  # the link to the host: "PCIe gen5 x16", "NVLink-C2C"
    host_bandwidth: int  # bytes/s one way over that link (PCIE_GEN4_X16, PCIE_GEN5_X16, NVLINK_C2C)
    cuda_context: int = CUDA_CONTEXT_ESTIMATE  # bytes held outside the caching allocator by the CUDA context (estimate)
    outside: int | None = None  # bytes outside the caching allocator given by hand (--outside): instead of the
    #                             context's and NCCL's measured or estimated figures
    dense_flops: tuple[int, int] = (0, 0)  # FLOP/s peak without sparsity: bf16 on the tensor cores, fp32 without them

    def flop_rate(self, dtype: str) -> int:
        """The dense peak FLOP/s a step of `dtype` computes its matmuls at: bf16 for bfloat16 and bf16-mixed, fp32
        (no TF32: PyTorch's default for matmuls) for float32."""
        return self.dense_flops[1 if dtype == "float32" else 0]

    @property
    def architecture(self) -> str:
        """Ampere, Ada, Hopper or Blackwell, from the compute capability (8.9 is Ada)."""
        return ADA if self.capability == (8, 9) else ARCHITECTURES[self.capability[0]]

    @property
    def torch_name(self) -> str:
        """The name torch.cuda.get_device_name() gives it ("NVIDIA H100 80GB HBM3"): its alias that starts so."""
        return next((alias for alias in self.aliases if alias.startswith("NVIDIA ")), self.name)

    @property
    def cublas_workspace_bytes(self) -> int:
        """Bytes of one cuBLAS handle's workspace (per stream) with the installed torch, taken through the caching
        allocator by default."""
        return self.cublas_workspace(INSTALLED)

    def cublas_workspace(self, rules: TorchRules) -> int:
        """Bytes of one cuBLAS handle's workspace (per stream) with torch `rules`'s release."""
        return cublas_workspace_size(self.capability, rules)

    def given_outside(self, outside: int | None) -> GPU:
        """This GPU with `outside` bytes held outside the caching allocator given by hand (None: unchanged);
        GPUError when they are negative or leave it nothing."""
        if outside is None:
            return self
        if isinstance(outside, bool) or not isinstance(outside, int) or not 0 <= outside < self.memory:
            raise GPUError(f"--outside {outside!r}: bytes from 0 to less than {self.name}'s memory ({self.memory:,} B)")
        return dataclasses.replace(self, outside=outside)

    @property
    def cublaslt_workspace_bytes(self) -> int:
        """Bytes of cuBLASLt's own workspace (per handle and stream), beside cuBLAS's: PyTorch's default."""
        return CUBLASLT_WORKSPACE

    def as_dict(self) -> dict:
        """The GPU's figures as the commands' --json gives them."""
        return {
            "name": self.name,
            "memory": self.memory,
            "capability": list(self.capability),
            "architecture": self.architecture,
            "cublas_workspace_bytes": self.cublas_workspace_bytes,
            "cublaslt_workspace_bytes": self.cublaslt_workspace_bytes,
            "cuda_context": self.cuda_context,
            "outside": self.outside,
            "host_link": self.host_link,
            "host_bandwidth": self.host_bandwidth,
            "dense_flops": list(self.dense_flops),
        }


GPUS = (
    # total_memory 85,028,896,768 B (81,090 MiB): deviceQuery, driver 12.8 (torch reports 81,089 to 81,090 MiB;
    # drivers 12.7 and 13.0 gave 81,106 and 81,079 MiB); nvidia-smi shows 81,559 MiB. SXM5: PCIe gen5 to the host.
    GPU("H100-80GB", ("H100", "H100-SXM", "H100-SXM5", "H100-SXM-80GB", "NVIDIA H100 80GB HBM3"),
        85_028_896_768, (9, 0), "PCIe gen5 x16", PCIE_GEN5_X16, dense_flops=(989 * TFLOPS, 67 * TFLOPS)),
    # total_memory 81,008 MiB (torch, _CudaDeviceProperties of an "NVIDIA H100 PCIe", 114 SMs).
    GPU("H100-PCIe-80GB", ("H100-PCIe", "NVIDIA H100 PCIe"),
        81_008 * MiB, (9, 0), "PCIe gen5 x16", PCIE_GEN5_X16, dense_flops=(756 * TFLOPS, 51 * TFLOPS)),
    # total_memory 150,109,880,320 B (143,155.875 MiB; torch 2.11, "NVIDIA H200", driver 580.159.04,
    # ../shared/traces/h200-programs); nvidia-smi shows 143,771 MiB.
    GPU("H200", ("H200-141GB", "H200-SXM", "NVIDIA H200"), 150_109_880_320, (9, 0), "PCIe gen5 x16", PCIE_GEN5_X16,
        dense_flops=(989 * TFLOPS, 67 * TFLOPS)),
    # total_memory 102,005,473,280 B (97,280 MiB, exactly 95 GiB): deviceQuery of an "NVIDIA GH200 480GB",
    # driver 12.2: the "95 GiB GPU" of the shared xl snapshots. Grace Hopper: NVLink-C2C to the Grace CPU.
    GPU("GH200", ("GH200-96GB", "GH200-480GB", "NVIDIA GH200 480GB"),
        102_005_473_280, (9, 0), "NVLink-C2C", NVLINK_C2C, dense_flops=(989 * TFLOPS, 67 * TFLOPS)),
    # total_memory 42,298,834,944 B (40,339 MiB): deviceQuery, driver 12.2 (older drivers: 40,536 MiB);
    # nvidia-smi shows 40,960 MiB.
    GPU("A100-40GB", ("A100-SXM4-40GB", "NVIDIA A100-SXM4-40GB"), 42_298_834_944, (8, 0), "PCIe gen4 x16",
        PCIE_GEN4_X16, dense_flops=(312 * TFLOPS, 39 * TFLOPS // 2)),
    # total_memory 84,987,740,160 B (81,051 MiB): deviceQuery, driver 12.2 (driver 12.5: 81,158 MiB; an A100
    # 80GB PCIe, driver 12.3: 81,049 MiB); nvidia-smi shows 81,920 MiB.
    GPU("A100-80GB", ("A100-SXM4-80GB", "A100-PCIe-80GB", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"),
        84_987_740_160, (8, 0), "PCIe gen4 x16", PCIE_GEN4_X16, dense_flops=(312 * TFLOPS, 39 * TFLOPS // 2)),
    # total_memory 47,576,711,168 B (45,373 MiB): deviceQuery, driver 12.4 (torch elsewhere: 45,589 MiB);
    # nvidia-smi shows 46,068 MiB.
    GPU("L40S", ("L40S-48GB", "NVIDIA L40S"), 47_576_711_168, (8, 9), "PCIe gen4 x16", PCIE_GEN4_X16,
        dense_flops=(362 * TFLOPS, 91 * TFLOPS)),
    # total_memory 23,612,293,120 B (22,518 MiB): deviceQuery, driver 12.0; nvidia-smi shows 23,034 MiB.
    GPU("L4", ("L4-24GB", "NVIDIA L4"), 23_612_293_120, (8, 9), "PCIe gen4 x16", PCIE_GEN4_X16,
        dense_flops=(121 * TFLOPS, 30 * TFLOPS)),
    # total_memory 25,756,696,576 B (24,564 MiB): deviceQuery, driver 12.1, Linux; torch reports 24,563 MiB.
    # A GPU that also drives a display, or Windows (WDDM), leaves less.
    GPU("RTX-4090", ("4090", "RTX4090", "RTX-4090-24GB", "GeForce-RTX-4090", "NVIDIA GeForce RTX 4090"),
        25_756_696_576, (8, 9), "PCIe gen4 x16", PCIE_GEN4_X16, dense_flops=(165 * TFLOPS, 82 * TFLOPS)),
    # total_memory 182,631 MiB (torch, "NVIDIA B200"; another report: 182,642 MiB): the smaller is kept.
    GPU("B200", ("B200-180GB", "B200-192GB", "NVIDIA B200"), 182_631 * MiB, (10, 0), "PCIe gen5 x16", PCIE_GEN5_X16,
        dense_flops=(2250 * TFLOPS, 75 * TFLOPS)),
)  # fmt: skip


def spelling(name: str) -> str:
    """A GPU name as the lookup compares it: lower case, spaces and underscores as hyphens."""
    return "-".join(name.strip().lower().replace("_", " ").replace("-", " ").split())


BY_NAME = {spelling(n): g for g in GPUS for n in (g.name, *g.aliases)}


DEFAULT_GPU = "H100-80GB"  # the GPU a CUDA step is planned for when none is named


def gpu(name: str) -> GPU:
    """The catalogue's GPU called `name` (or one of its aliases, in any case); GPUError lists the known names, and
    refuses what is not a name (a number, None)."""
    if not isinstance(name, str):
        raise GPUError(f"--gpu {short_repr(name)}: expected a GPU's name (a str), got {type(name).__name__}")
    found = BY_NAME.get(spelling(name))
    if found is None:
        shown = name if name.strip() and len(name) <= 40 else short_repr(name)
        raise GPUError(f"--gpu {shown}: unknown GPU (known: {', '.join(g.name for g in GPUS)})")
    return found


def planned_gpu(named: GPU | str | None) -> GPU:
    """The GPU a CUDA step is planned for: `named` (a GPU, or a name to look up: an empty one is refused as the
    command line refuses it), else DEFAULT_GPU."""
    return named if isinstance(named, GPU) else gpu(DEFAULT_GPU if named is None else named)
