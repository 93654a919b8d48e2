"""Model file for `memplan trace --nproc N`: the bundled Llama sharded by FSDP2 (`fully_shard` on every layer and
on the root), with PyTorch's AdamW over the sharded parameters; with MEMPLAN_TP=T, tensor parallelism too.

MEMPLAN_FSDP_PRECISION picks the precision: fp32 (default) or bf16 (FSDP2's MixedPrecisionPolicy: parameters
gathered in bf16 for compute, gradients reduced in fp32). The shape comes from MEMPLAN_PRESET: tiny (default), 7b, 8b or
70b; MEMPLAN_LAYERS sets its number of layers.
MEMPLAN_TP=T (default 1) lays the N ranks out as a 2-D DeviceMesh (dp = N / T, tp = T) and, before FSDP2, splits each
layer's attention and MLP over the tp dimension with parallelize_module as torchtitan's Llama does (q, k, v and the
MLP's gate and up column-parallel, o and down row-parallel: each rank computes its share of the heads); FSDP2 then
shards every parameter over the dp dimension (the embedding, the norms and the head are replicated over tp).
The ranks' process group is memplan's (gloo on the CPU, NCCL on CUDA).
Example: memplan trace examples/llama_fsdp2.py --nproc 2 --seq 64 -o fsdp2.json.gz
Example: MEMPLAN_TP=2 memplan trace examples/llama_fsdp2.py --nproc 4 --fake -o fsdp2-tp.json.gz
"""

import dataclasses
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from memplan.planner.parallel.fsdp import PRECISIONS, shard
from memplan.planner.workloads.llama import PRESETS, build_workload

# torchtitan's Llama plan without its sequence parallelism: a layer's input and output are replicated over tp
LAYER_PLAN = {
    "attention.q": ColwiseParallel(),
    "attention.k": ColwiseParallel(),
    "attention.v": ColwiseParallel(),
    "attention.o": RowwiseParallel(),
    "mlp.gate": ColwiseParallel(),
    "mlp.up": ColwiseParallel(),
    "mlp.down": RowwiseParallel(),
}


def mesh_for(device, tp, config):
    """The ranks as a (dp,) mesh, or with tp > 1 a (dp, tp) one; ValueError when tp divides the ranks or heads not."""
    world = dist.get_world_size()
    if tp == 1:
        return init_device_mesh(device, (world,))
    for what, count in (("ranks", world), ("heads", config.heads), ("kv heads", config.kv_heads)):
        if count % tp:
            raise ValueError(f"MEMPLAN_TP={tp} does not divide the {count} {what}")
    return init_device_mesh(device, (world // tp, tp), mesh_dim_names=("dp", "tp"))


def build(batch_size, seq_len, dtype, device):
    """This rank's Llama training step under FSDP2 (and TP): same weights and tokens on every rank
    (examples/llama.py's)."""
    preset = os.environ.get("MEMPLAN_PRESET", "tiny")
    precision = os.environ.get("MEMPLAN_FSDP_PRECISION", "fp32")
    tp = os.environ.get("MEMPLAN_TP", "1")
    layers = os.environ.get("MEMPLAN_LAYERS")
    if preset not in PRESETS:
        raise ValueError(f"MEMPLAN_PRESET={preset!r} is not one of {', '.join(PRESETS)}")
    if precision not in PRECISIONS:
        raise ValueError(f"MEMPLAN_FSDP_PRECISION={precision!r} is not one of {', '.join(PRECISIONS)}")
    for name, value in (("MEMPLAN_TP", tp), ("MEMPLAN_LAYERS", layers)):
        if value is not None and (not value.isdigit() or int(value) < 1):
            raise ValueError(f"{name}={value!r} is not a whole number of at least 1")
    if not dist.is_initialized():
        raise ValueError("FSDP2 shards over the ranks' process group: run this model file with --nproc N")
    config = PRESETS[preset] if layers is None else dataclasses.replace(PRESETS[preset], layers=int(layers))
    workload = build_workload(batch_size, seq_len, dtype, device, config=config)
    mesh = mesh_for(torch.device(device).type, int(tp), config)  # the ranks, on the step's device
    if mesh.ndim == 2:
        for layer in workload.model.layers:
            parallelize_module(layer, mesh["tp"], LAYER_PLAN)
        mesh = mesh["dp"]
    shard(workload.model, list(workload.model.layers), mesh, precision)
    workload.optimizer = torch.optim.AdamW(workload.model.parameters(), lr=1e-4)  # over the sharded parameters
    workload.name = f"{workload.name}-fsdp2-{precision}" + (f"-tp{tp}" if int(tp) > 1 else "")
    return workload
