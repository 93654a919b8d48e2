"""Model file for `memplan trace`: HuggingFace BertModel built from a config (random weights, no download).

MEMPLAN_PRESET picks the shape: tiny (default: 2 layers, hidden 64) or large (BERT-Large: 24 x 1024).
The loss is the mean of both outputs (sequence output and pooler), so every parameter gets a gradient.
Example: memplan trace examples/hf_bert.py --batch 2 --seq 128
"""

import os

import torch

PRESETS = {
    "tiny": dict(
        vocab_size=1024,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=512,
    ),
    "large": dict(
        vocab_size=30522,
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
        max_position_embeddings=512,
    ),
}


def loss(output, inputs):
    """Mean of the sequence output plus mean of the pooled output, in fp32."""
    return output.last_hidden_state.float().mean() + output.pooler_output.float().mean()


def build(batch_size, seq_len, dtype, device):
    """A BertModel training step on random token ids, every token attended (no attention mask: HuggingFace
    checks an all-ones mask's values to skip it, and with fake tensors, which have none, builds it instead)."""
    from transformers import BertConfig, BertModel

    preset = os.environ.get("MEMPLAN_PRESET", "tiny")
    if preset not in PRESETS:
        raise ValueError(f"MEMPLAN_PRESET={preset!r} is not one of {', '.join(PRESETS)}")
    model = BertModel(BertConfig(**PRESETS[preset])).train()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, PRESETS[preset]["vocab_size"], (batch_size, seq_len), generator=generator)
    inputs = {"input_ids": ids.to(device)}
    return {"model": model, "inputs": inputs, "loss": loss}
