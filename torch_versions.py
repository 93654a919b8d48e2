"""The torch a CUDA step will run on: the rules of each PyTorch release memplan follows that differ between them (the
attention kernel `scaled_dot_product_attention` picks, the cuDNN its wheels load, cuBLAS's default workspace), so a
fake CUDA step is traced as the GPU's own torch would run it. `torch_rules(version)` looks one up; the default is the
torch memplan is installed with. docs/torch-versions.md lists the differences and where each comes from.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from memplan.errors import MemplanError


class TorchVersionError(MemplanError):
    """A torch version memplan has no rules for."""


@dataclass(frozen=True)
class TorchRules:
    """One PyTorch release's rules, as far as a step's memory depends on them."""

    version: str  # "2.13": major.minor, the key --torch takes and a trace's meta "torch_rules" records
    release: str  # the release the rules were read from, as torch.__version__ gives it: "2.11.0+cu130"
    cudnn_version: int  # the cuDNN its CUDA 13.0 wheels load, as versionRuntimeCuDNN(): 9.19.0 -> 91900
    cudnn_dropout_sixteenths: bool  # cuDNN attention refuses a dropout that is no multiple of 1/16 (#174245)
    cudnn_batch_heads_limit: bool  # cuDNN attention refuses batch or heads above 65,535 (#180718)
    cublas_large_majors: tuple[int, ...]  # compute capability majors whose default cuBLAS workspace is 32 MiB
    source: str  # where the rules come from

    def as_dict(self) -> dict:
        """The rules as the commands' --json gives them."""
        return {"version": self.version, "release": self.release, "cudnn_version": self.cudnn_version}


# The rules of torch 2.13.0, the release memplan is installed with (pyproject.toml pins it):
# traces/cuda/sdpa_choice.py's header says which sdp_utils.cpp they follow; cuDNN 9.20.0.48 (pytorch/pytorch#177321);
# cuBLAS's 32 MiB on Hopper and Blackwell (pytorch/pytorch#175344) and Thor (#189312), as gpus.py has it.
TORCH_2_13 = TorchRules(
    version="2.13",
    release="2.13.0",
    cudnn_version=92000,
    cudnn_dropout_sixteenths=True,
    cudnn_batch_heads_limit=True,
    cublas_large_majors=(9, 10, 11, 12),
    source="sdp_utils.cpp after pytorch/pytorch#174245 and #180718; CublasHandlePool.cpp after #175344 and #189312",
)

# torch 2.11.0 (branch cut before its first release candidate, 2026-02-17; released 2026-03-18), which the GPU
# images people rent ship. Its sdp_utils.cpp predates pytorch/pytorch#174245 (merged 2026-02-26: cuDNN takes
# dropout only in steps of 1/16) and #180718 (2026-04-20: batch and heads at most 65,535), so cuDNN attention
# takes any dropout: on an H100 or H200, where cuDNN comes first, fp16/bf16 attention with dropout 0.1 runs cuDNN,
# not flash, memory-efficient or math
# (../shared/traces/h200-programs/sdpa_h200_torch211.json: torch 2.11.0+cu130's own `_fused_sdp_choice` for 768
# calls on an H200, cuDNN 91900). Its CublasHandlePool.cpp predates #175344 (2026-02-19: 32 MiB workspaces on
# Blackwell again): 32 MiB on sm_90 only, ":4096:2:16:8" (8,519,680 B) on Blackwell and the rest.
TORCH_2_11 = TorchRules(
    version="2.11",
    release="2.11.0+cu130",
    cudnn_version=91900,
    cudnn_dropout_sixteenths=False,
    cudnn_batch_heads_limit=False,
    cublas_large_majors=(9,),
    source="sdp_utils.cpp before pytorch/pytorch#174245 and #180718; CublasHandlePool.cpp before #175344; "
    "torch 2.11.0+cu130's _fused_sdp_choice on an H200 (sdpa_h200_torch211.json)",
)

RELEASES = (TORCH_2_13, TORCH_2_11)
INSTALLED = TORCH_2_13  # the torch memplan is installed with: a step runs on it unless --torch names another
BY_VERSION = {r.version: r for r in RELEASES}


def torch_rules(version: TorchRules | str | None = None) -> TorchRules:
    """The rules of torch `version` ("2.11", "2.11.0", "2.11.0+cu130": its major.minor decides; None or "installed":
    the installed torch's); TorchVersionError names the known versions."""
    if isinstance(version, TorchRules):
        return version
    if version is None or str(version).strip().lower() == "installed":
        return INSTALLED
    match = re.fullmatch(r"\s*v?(\d+)\.(\d+)(?:\.\d+)?(?:[+a-z].*)?\s*", str(version), re.IGNORECASE)
    found = BY_VERSION.get(f"{match.group(1)}.{match.group(2)}") if match else None
    if found is None:
        known = ", ".join(f"{r.version}{' (installed)' if r is INSTALLED else ''}" for r in RELEASES)
        raise TorchVersionError(f"--torch {str(version)[:40]!r}: memplan has no rules for it (known: {known})")
    return found
