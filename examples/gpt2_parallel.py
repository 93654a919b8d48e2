"""Model file for `memplan trace --nproc N`: the bundled GPT-2 split over the N ranks (Megatron-style).

MEMPLAN_PARALLEL chooses tensor parallelism alone (tp) or with sequence parallelism (tp+sp, default);
the tensor-parallel size is the number of ranks (1 without --nproc). The shape comes from MEMPLAN_PRESET:
tiny (default), small (GPT-2 124M) or medium (GPT-2 355M).
Example: MEMPLAN_PARALLEL=tp+sp memplan trace examples/gpt2_parallel.py --nproc 2 --seq 64 -o gpt2.json.gz
"""

import os

from memplan.planner.parallel.model import build_workload
from memplan.planner.workloads.gpt2 import PRESETS

KINDS = {"tp": False, "tp+sp": True}


def build(batch_size, seq_len, dtype, device):
    """This rank's share of the GPT-2 next-token training step (same weights as examples/gpt2.py)."""
    preset = os.environ.get("MEMPLAN_PRESET", "tiny")
    kind = os.environ.get("MEMPLAN_PARALLEL", "tp+sp")
    if preset not in PRESETS:
        raise ValueError(f"MEMPLAN_PRESET={preset!r} is not one of {', '.join(PRESETS)}")
    if kind not in KINDS:
        raise ValueError(f"MEMPLAN_PARALLEL={kind!r} is not one of {', '.join(KINDS)}")
    return build_workload(batch_size, seq_len, dtype, device, config=PRESETS[preset], sequence_parallel=KINDS[kind])
