"""Model file for `memplan trace`: the bundled BERT with its layers as a reversible pre-LN stack (RevNet,
Reformer), which holds two activation streams for backward however many layers it has.

The shape comes from MEMPLAN_PRESET, as for examples/bert.py: tiny (default, 2 layers x 64), base or large.
Example: MEMPLAN_PRESET=large memplan trace examples/bert_reversible.py --batch 8 --seq 512
"""

import os

from memplan.planner.workloads.bert import PRESETS
from memplan.planner.workloads.reversible import build_bert_workload


def build(batch_size, seq_len, dtype, device):
    """The reversible BERT MLM training step at the chosen preset: AdamW, cross-entropy on the masked positions."""
    preset = os.environ.get("MEMPLAN_PRESET", "tiny")
    if preset not in PRESETS:
        raise ValueError(f"MEMPLAN_PRESET={preset!r} is not one of {', '.join(PRESETS)}")
    return build_bert_workload(batch_size, seq_len, dtype, device, config=PRESETS[preset])
