"""Model file for `memplan trace`: the bundled plain-torch BERT with its masked-language-model head.

The shape comes from MEMPLAN_PRESET: tiny (default, 2 layers x 64), base (BERT-Base) or large (BERT-Large).
Example: MEMPLAN_PRESET=large memplan trace examples/bert.py --batch 8 --seq 512
"""

import os

from memplan.planner.workloads.bert import PRESETS, build_workload


def build(batch_size, seq_len, dtype, device):
    """The BERT MLM training step at the chosen preset: AdamW, cross-entropy on the masked positions."""
    preset = os.environ.get("MEMPLAN_PRESET", "tiny")
    if preset not in PRESETS:
        raise ValueError(f"MEMPLAN_PRESET={preset!r} is not one of {', '.join(PRESETS)}")
    return build_workload(batch_size, seq_len, dtype, device, config=PRESETS[preset])
