"""Model file for `memplan trace --nproc N`: the bundled GPT-2 replicated by DistributedDataParallel (gradients
all-reduced in DDP's buckets during the backward), with PyTorch's AdamW.

MEMPLAN_DDP_OPTIMIZER picks the optimizer: adamw (default: every rank steps every parameter) or zero
(ZeRO-1: torch.distributed.optim.ZeroRedundancyOptimizer with AdamW inside, each rank holding the AdamW state of
its partition of the parameters and broadcasting them, updated, to the other ranks).
The shape comes from MEMPLAN_PRESET: tiny (default), small (GPT-2 124M) or medium (GPT-2 355M).
The ranks' process group is memplan's (gloo on the CPU, NCCL on CUDA).
Example: MEMPLAN_DDP_OPTIMIZER=zero memplan trace examples/gpt2_ddp.py --nproc 2 --seq 64 -o zero.json.gz
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from memplan.planner.workloads.gpt2 import PRESETS, build_workload

OPTIMIZERS = ("adamw", "zero")


def build(batch_size, seq_len, dtype, device):
    """This rank's GPT-2 training step under DDP: same weights and tokens on every rank (examples/gpt2.py's)."""
    preset = os.environ.get("MEMPLAN_PRESET", "tiny")
    optimizer = os.environ.get("MEMPLAN_DDP_OPTIMIZER", "adamw")
    if preset not in PRESETS:
        raise ValueError(f"MEMPLAN_PRESET={preset!r} is not one of {', '.join(PRESETS)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"MEMPLAN_DDP_OPTIMIZER={optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    if not dist.is_initialized():
        raise ValueError("DDP replicates over the ranks' process group: run this model file with --nproc N")
    workload = build_workload(batch_size, seq_len, dtype, device, config=PRESETS[preset])
    device_ids = [torch.device(device).index or 0] if torch.device(device).type == "cuda" else None
    workload.model = DistributedDataParallel(workload.model, device_ids=device_ids)
    if optimizer == "zero":
        params = workload.model.parameters()
        workload.optimizer = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-4)
    else:
        workload.optimizer = torch.optim.AdamW(workload.model.parameters(), lr=1e-4)
    workload.name = f"{workload.name}-ddp" + ("-zero" if optimizer == "zero" else "")
    return workload
