"""Model file for `memplan trace`: HuggingFace GPT2Model built from a config (random weights, no download).

MEMPLAN_PRESET picks the shape: tiny (default: 2 layers, hidden 64) or small (GPT-2 124M: 12 x 768).
The loss is the mean of the final hidden states (the model has no head).
Example: memplan trace examples/hf_gpt2.py --batch 2 --seq 128
"""

import os

import torch

PRESETS = {
    "tiny": dict(
        vocab_size=1024, n_embd=64, n_layer=2, n_head=4, n_positions=1024, bos_token_id=1023, eos_token_id=1023
    ),
    "small": dict(vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024),
}


def build(batch_size, seq_len, dtype, device):
    """A GPT2Model training step on random token ids."""
    from transformers import GPT2Config, GPT2Model

    preset = os.environ.get("MEMPLAN_PRESET", "tiny")
    if preset not in PRESETS:
        raise ValueError(f"MEMPLAN_PRESET={preset!r} is not one of {', '.join(PRESETS)}")
    model = GPT2Model(GPT2Config(**PRESETS[preset])).train()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, PRESETS[preset]["vocab_size"], (batch_size, seq_len), generator=generator)
    return {"model": model, "inputs": {"input_ids": ids.to(device)}}
