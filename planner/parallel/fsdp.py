"""FSDP2 as the bundled Llama model files apply it: `fully_shard` on every layer, then on the root, over a mesh,
with or without FSDP2's bf16 mixed precision (parameters gathered in bf16 for compute, gradients reduced in fp32)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

PRECISIONS = {
    "fp32": None,
    "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
}


def shard(root: nn.Module, layers: list[nn.Module], mesh: DeviceMesh, precision: str = "fp32") -> None:
    """fully_shard each of `layers` and then `root` over `mesh` under the named precision (PRECISIONS)."""
    policy = {"mesh": mesh} | ({"mp_policy": PRECISIONS[precision]} if PRECISIONS[precision] else {})
    for layer in layers:
        fully_shard(layer, **policy)
    fully_shard(root, **policy)
