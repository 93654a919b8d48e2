"""Model file for `memplan trace --nproc N`: the bundled Llama pipelined over the N ranks with
torch.distributed.pipelining (one stage per rank, two for the interleaved schedule), PyTorch's AdamW on each rank's
stages.

MEMPLAN_PIPELINE_SCHEDULE picks the schedule: 1f1b (default), gpipe or interleaved-1f1b. MEMPLAN_MICROBATCHES cuts
the batch into that many equal micro-batches (default: one sample each). The shape comes from MEMPLAN_PRESET: tiny
(default: examples/llama.py's tiny Llama with 8 layers, enough for 4 ranks of two stages), 7b or 8b; MEMPLAN_LAYERS
sets its number of layers (at least one a stage).
Example: MEMPLAN_PIPELINE_SCHEDULE=1f1b memplan trace examples/llama_pipeline.py --nproc 2 --batch 4 -o pp.json.gz
"""

import dataclasses
import os

from memplan.planner.parallel.pipeline import SCHEDULES, build_workload
from memplan.planner.workloads.llama import PRESETS

PIPELINE_PRESETS = {**PRESETS, "tiny": dataclasses.replace(PRESETS["tiny"], layers=8)}


def build(batch_size, seq_len, dtype, device):
    """This rank's stages of the Llama training step, run by the chosen schedule."""
    preset = os.environ.get("MEMPLAN_PRESET", "tiny")
    schedule = os.environ.get("MEMPLAN_PIPELINE_SCHEDULE", "1f1b")
    microbatches = os.environ.get("MEMPLAN_MICROBATCHES")
    layers = os.environ.get("MEMPLAN_LAYERS")
    if preset not in PIPELINE_PRESETS:
        raise ValueError(f"MEMPLAN_PRESET={preset!r} is not one of {', '.join(PIPELINE_PRESETS)}")
    if schedule not in SCHEDULES:
        raise ValueError(f"MEMPLAN_PIPELINE_SCHEDULE={schedule!r} is not one of {', '.join(SCHEDULES)}")
    for name, value in (("MEMPLAN_MICROBATCHES", microbatches), ("MEMPLAN_LAYERS", layers)):
        if value is not None and not value.isdigit():
            raise ValueError(f"{name}={value!r} is not a whole number")
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
    )
