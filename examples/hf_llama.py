"""Model file: HuggingFace LlamaForCausalLM built from a config (random weights, no download), trained on
its own next-token loss (labels = input ids).

MEMPLAN_PRESET picks the shape: tiny (default: 2 layers, hidden 64, 4 heads, 2 k/v heads) or 7b (the
config's defaults, Llama 2 7B: 32 x 4096, ffn 11008, vocabulary 32000), which needs --fake here.
Example: MEMPLAN_PRESET=7b memplan trace examples/hf_llama.py --fake --dtype bfloat16 --batch 1 --seq 2048
"""

import os

import torch

PRESETS = {
    "tiny": dict(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    ),
    "7b": dict(max_position_embeddings=4096),
}


def build(batch_size, seq_len, dtype, device):
    """A LlamaForCausalLM training step on random token ids."""
    from transformers import LlamaConfig, LlamaForCausalLM

    preset = os.environ.get("MEMPLAN_PRESET", "tiny")
    if preset not in PRESETS:
        raise ValueError(f"MEMPLAN_PRESET={preset!r} is not one of {', '.join(PRESETS)}")
    config = LlamaConfig(**PRESETS[preset])
    model = LlamaForCausalLM(config).train()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=generator).to(device)
    return {"model": model, "inputs": {"input_ids": ids, "labels": ids}}
