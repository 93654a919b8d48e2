"""Model file for `memplan trace`: the bundled plain-torch GPT-2 decoder with its tied language-model head.

The shape comes from MEMPLAN_PRESET: tiny (default, 2 layers x 64), small (GPT-2 124M) or medium (GPT-2 355M).
Example: MEMPLAN_PRESET=small memplan trace examples/gpt2.py --batch 4 --seq 1024
"""

import os

from memplan.planner.workloads.gpt2 import PRESETS, build_workload


def build(batch_size, seq_len, dtype, device):
    """The GPT-2 next-token training step at the chosen preset: AdamW, cross-entropy."""
    preset = os.environ.get("MEMPLAN_PRESET", "tiny")
    if preset not in PRESETS:
        raise ValueError(f"MEMPLAN_PRESET={preset!r} is not one of {', '.join(PRESETS)}")
    return build_workload(batch_size, seq_len, dtype, device, config=PRESETS[preset])
