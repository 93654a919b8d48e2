"""Model file for `memplan trace --nproc N`: the bundled Llama pipelined over the N ranks with
torch.distributed.pipelining (one stage per rank, two for the interleaved schedule), PyTorch's AdamW on each rank's
stages.

MEMPLAN_PIPELINE_SCHEDULE picks the schedule: 1f1b (default), gpipe or interleaved-1f1b. MEMPLAN_MICROBATCHES cuts
the batch into that many equal micro-batches (default: one sample each). The shape comes from MEMPLAN_PRESET: tiny
(default: examples/llama.py's tiny Llama with 8 layers, enough for 4 ranks of two stages), 7b, 8b or 70b; MEMPLAN_LAYERS
sets its number of layers (at least one a stage).
MEMPLAN_DP=D (default 1) composes the pipeline with FSDP2: the N ranks form a 2-D DeviceMesh ("pp", "dp") of N / D
pipeline ranks by D, the pipeline runs over each rank's "pp" group and each stage is fully_shard-ed (every layer,
then the stage) over its "dp" group; MEMPLAN_FSDP_PRECISION=bf16 gives FSDP2 its bf16 mixed precision.
Example: MEMPLAN_PIPELINE_SCHEDULE=1f1b memplan trace examples/llama_pipeline.py --nproc 2 --batch 4 -o pp.json.gz
Example: MEMPLAN_DP=2 memplan trace examples/llama_pipeline.py --nproc 4 --fake --batch 2 -o pp-fsdp.json.gz
"""

import dataclasses
import os

from memplan.planner.parallel.fsdp import PRECISIONS
from memplan.planner.parallel.pipeline import SCHEDULES, build_workload
from memplan.planner.workloads.llama import PRESETS

PIPELINE_PRESETS = {**PRESETS, "tiny": dataclasses.replace(PRESETS["tiny"], layers=8)}


def build(batch_size, seq_len, dtype, device):
    """This rank's stages of the Llama training step, run by the chosen schedule."""
    preset = os.environ.get("MEMPLAN_PRESET", "tiny")
    schedule = os.environ.get("MEMPLAN_PIPELINE_SCHEDULE", "1f1b")
    microbatches = os.environ.get("MEMPLAN_MICROBATCHES")
    layers = os.environ.get("MEMPLAN_LAYERS")
    dp = os.environ.get("MEMPLAN_DP", "1")
    precision = os.environ.get("MEMPLAN_FSDP_PRECISION", "fp32")
    if preset not in PIPELINE_PRESETS:
        raise ValueError(f"MEMPLAN_PRESET={preset!r} is not one of {', '.join(PIPELINE_PRESETS)}")
    if schedule not in SCHEDULES:
        raise ValueError(f"MEMPLAN_PIPELINE_SCHEDULE={schedule!r} is not one of {', '.join(SCHEDULES)}")
    if precision not in PRECISIONS:
        raise ValueError(f"MEMPLAN_FSDP_PRECISION={precision!r} is not one of {', '.join(PRECISIONS)}")
    for name, value in (("MEMPLAN_MICROBATCHES", microbatches), ("MEMPLAN_LAYERS", layers)):
        if value is not None and not value.isdigit():
            raise ValueError(f"{name}={value!r} is not a whole number")
    if not dp.isdigit() or int(dp) < 1:
        raise ValueError(f"MEMPLAN_DP={dp!r} is not a whole number of at least 1")
    config = PIPELINE_PRESETS[preset]
    if layers is not None:
        config = dataclasses.replace(config, layers=int(layers))
    return build_workload(
        batch_size,
        seq_len,
        dtype,
        device,
        config=config,
        schedule=schedule,
        microbatches=int(microbatches) if microbatches is not None else None,
        dp=int(dp),
        precision=precision,
    )
