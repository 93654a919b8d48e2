"""Model file: a Llama-style decoder in plain torch (RMSNorm, SwiGLU, rotary positions, grouped-query
attention through SDPA, no dropout), memplan's own (planner/workloads/llama.py).

MEMPLAN_PRESET picks the shape: tiny (default: 2 layers, hidden 64, 4 heads, 2 k/v heads), 7b (Llama 2 7B)
or 8b (Llama 3 8B). The 7B and 8B shapes need --fake on a machine without their ~100 GB of training state.
Example: MEMPLAN_PRESET=7b memplan trace examples/llama.py --fake --device cuda --dtype bfloat16 --batch 1 --seq 2048
"""

import os

from memplan.planner.workloads.llama import PRESETS, build_workload


def build(batch_size, seq_len, dtype, device):
    """The next-token training step (AdamW) of the preset's Llama-style decoder."""
    preset = os.environ.get("MEMPLAN_PRESET", "tiny")
    if preset not in PRESETS:
        raise ValueError(f"MEMPLAN_PRESET={preset!r} is not one of {', '.join(PRESETS)}")
    return build_workload(batch_size, seq_len, dtype, device, config=PRESETS[preset])
