"""Model file for `memplan trace`: the bundled GPT-2 with its layers as a reversible stack (RevNet, Reformer),
which holds two activation streams for backward however many layers it has.

The shape comes from MEMPLAN_PRESET, as for examples/gpt2.py: tiny (default, 2 layers x 64), small or medium.
Example: MEMPLAN_PRESET=small memplan trace examples/gpt2_reversible.py --batch 4 --seq 1024
"""

import os

from memplan.planner.workloads.gpt2 import PRESETS
from memplan.planner.workloads.reversible import build_gpt2_workload


def build(batch_size, seq_len, dtype, device):
    """The reversible GPT-2 next-token training step at the chosen preset: AdamW, cross-entropy."""
    preset = os.environ.get("MEMPLAN_PRESET", "tiny")
    if preset not in PRESETS:
        raise ValueError(f"MEMPLAN_PRESET={preset!r} is not one of {', '.join(PRESETS)}")
    return build_gpt2_workload(batch_size, seq_len, dtype, device, config=PRESETS[preset])
