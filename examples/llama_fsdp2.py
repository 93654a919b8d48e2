"""Model file for `memplan trace --nproc N`: the bundled Llama sharded by FSDP2 (`fully_shard` on every layer and
on the root), with PyTorch's AdamW over the sharded parameters.

MEMPLAN_FSDP_PRECISION picks the precision: fp32 (default) or bf16 (FSDP2's MixedPrecisionPolicy: parameters
gathered in bf16 for compute, gradients reduced in fp32). The shape comes from MEMPLAN_PRESET: tiny (default) or 7b.
The ranks' process group is memplan's (gloo on the CPU, NCCL on CUDA).
Example: memplan trace examples/llama_fsdp2.py --nproc 2 --seq 64 -o fsdp2.json.gz
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from memplan.planner.workloads.llama import PRESETS, build_workload

PRECISIONS = {
    "fp32": None,
    "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
}


def build(batch_size, seq_len, dtype, device):
    """This rank's Llama training step under FSDP2: same weights and tokens on every rank (examples/llama.py's)."""
    preset = os.environ.get("MEMPLAN_PRESET", "tiny")
    precision = os.environ.get("MEMPLAN_FSDP_PRECISION", "fp32")
    if preset not in PRESETS:
        raise ValueError(f"MEMPLAN_PRESET={preset!r} is not one of {', '.join(PRESETS)}")
    if precision not in PRECISIONS:
        raise ValueError(f"MEMPLAN_FSDP_PRECISION={precision!r} is not one of {', '.join(PRECISIONS)}")
    if not dist.is_initialized():
        raise ValueError("FSDP2 shards over the ranks' process group: run this model file with --nproc N")
    workload = build_workload(batch_size, seq_len, dtype, device, config=PRESETS[preset])
    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))  # the ranks, on the step's device
    policy = {"mesh": mesh} | ({"mp_policy": PRECISIONS[precision]} if PRECISIONS[precision] else {})
    for layer in workload.model.layers:
        fully_shard(layer, **policy)
    fully_shard(workload.model, **policy)
    workload.optimizer = torch.optim.AdamW(workload.model.parameters(), lr=1e-4)  # over the sharded parameters
    workload.name = f"{workload.name}-fsdp2-{precision}"
    return workload
