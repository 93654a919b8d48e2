"""The models of benchmarks/tempo_throughput.py, as a model file: MEMPLAN_PRESET names one.

bert-large: BERT-Large (24 layers of 1024, 16 heads; the model of Tempo's throughput experiment).
llama-stack: a Llama layer stack of Llama 3.2 1B's shape (16 layers of 2048, 32 heads, 8 key/value heads, SwiGLU of
8192, RMSNorm) with Llama 2's vocabulary of 32000, so the layers, not the loss, hold most of a step's memory.
bert-tiny, llama-tiny: the bundled tiny shapes, for the script's CPU run.
"""

from __future__ import annotations

import os

from memplan.planner.workloads import bert, llama

LLAMA_STACK = llama.LlamaConfig(vocab_size=32000, hidden=2048, heads=32, kv_heads=8, layers=16, ffn_hidden=8192)
MODELS = {
    "bert-large": (bert, bert.LARGE),
    "llama-stack": (llama, LLAMA_STACK),
    "bert-tiny": (bert, bert.TINY),
    "llama-tiny": (llama, llama.TINY),
}


def build(batch_size, seq_len, dtype, device):
    """The MEMPLAN_PRESET model's training step."""
    preset = os.environ.get("MEMPLAN_PRESET", "bert-tiny")
    if preset not in MODELS:
        raise ValueError(f"MEMPLAN_PRESET={preset!r} is not one of {', '.join(MODELS)}")
    family, config = MODELS[preset]
    return family.build_workload(batch_size, seq_len, dtype, device, config=config)
