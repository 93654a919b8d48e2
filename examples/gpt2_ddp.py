"""Model file for `memplan trace --nproc N`: the bundled GPT-2 replicated by DistributedDataParallel (gradients
all-reduced in DDP's buckets during the backward), with PyTorch's AdamW.

The shape comes from MEMPLAN_PRESET: tiny (default), small (GPT-2 124M) or medium (GPT-2 355M).
The ranks' process group is memplan's (gloo on the CPU, NCCL on CUDA).
Example: memplan trace examples/gpt2_ddp.py --nproc 2 --seq 64 -o ddp.json.gz
"""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from memplan.planner.workloads.gpt2 import PRESETS, build_workload


def build(batch_size, seq_len, dtype, device):
    """This rank's GPT-2 training step under DDP: same weights and tokens on every rank (examples/gpt2.py's)."""
    preset = os.environ.get("MEMPLAN_PRESET", "tiny")
    if preset not in PRESETS:
        raise ValueError(f"MEMPLAN_PRESET={preset!r} is not one of {', '.join(PRESETS)}")
    if not dist.is_initialized():
        raise ValueError("DDP replicates over the ranks' process group: run this model file with --nproc N")
    workload = build_workload(batch_size, seq_len, dtype, device, config=PRESETS[preset])
    device_ids = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else None
    workload.model = DistributedDataParallel(workload.model, device_ids=device_ids)
    workload.optimizer = torch.optim.AdamW(workload.model.parameters(), lr=1e-4)
    workload.name = f"{workload.name}-ddp"
    return workload
