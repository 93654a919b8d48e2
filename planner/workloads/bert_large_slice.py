"""Model file: BERT-Large's shape (hidden 1024, 16 heads, vocabulary 30522) with 2 of its 24 layers.

The default workload of `memplan run`: each layer is a real BERT-Large layer, so per-layer savings read
as they would on the full model, while a traced step takes seconds on a 2-core CPU.
Example: memplan trace planner/workloads/bert_large_slice.py --batch 4 --seq 128 --layers tempo
"""

from dataclasses import replace

from memplan.planner.workloads.bert import LARGE, build_workload

LAYERS = 2


def build(batch_size, seq_len, dtype, device):
    """The BERT MLM training step (AdamW) on a 2-layer slice of BERT-Large."""
    return build_workload(batch_size, seq_len, dtype, device, config=replace(LARGE, layers=LAYERS))
