"""Model file: the CS336 reference LM, a real training program no one here wrote, as its GPU snapshots
were made (../shared/clients/cs336/NOTICE.md): GPT-2-medium size (d_model 1024, 24 layers, 16 heads,
d_ff 4096, vocabulary 10000), fp32, its own AdamW (which replaces its state tensors every step) and
its own cross-entropy. The program is imported from ../shared/clients/cs336 (or $CS336_DIR), never copied.
CS336_AUTOCAST=bf16 runs forward and loss under torch.autocast(bfloat16) on the model's device type.
Example: memplan trace examples/cs336_lm.py --batch 4 --seq 128 --fake
"""

import os
import sys
from pathlib import Path

import torch

CLIENT = Path(os.environ.get("CS336_DIR") or Path(__file__).resolve().parents[2] / "shared" / "clients" / "cs336")


def build(batch_size, seq_len, dtype, device):
    """One training step of BasicsTransformerLM with the client's AdamW and cross_entropy."""
    if not (CLIENT / "cs336_basics").is_dir():
        raise FileNotFoundError(f"the CS336 client is not at {CLIENT} (set CS336_DIR)")
    sys.path.insert(0, str(CLIENT))
    from cs336_basics.model import BasicsTransformerLM
    from cs336_basics.nn_utils import cross_entropy
    from cs336_basics.optimizer import AdamW

    model = BasicsTransformerLM(
        vocab_size=10000, context_length=seq_len, d_model=1024, num_layers=24, num_heads=16, d_ff=4096
    )
    x = torch.randint(0, 10000, (batch_size, seq_len), device=device)
    y = torch.randint(0, 10000, (batch_size, seq_len), device=device)
    if os.environ.get("CS336_AUTOCAST") == "bf16":
        model = Autocast(model)
    return {
        "model": model,
        "inputs": x,
        "loss": lambda output, _: autocast(output)(cross_entropy)(output, y),
        "optimizer": AdamW,
        "name": "cs336-gpt2-medium",
    }


def autocast(tensor):
    """torch.autocast(bfloat16) on the tensor's device type when CS336_AUTOCAST=bf16, else nothing."""
    enabled = os.environ.get("CS336_AUTOCAST") == "bf16"
    return torch.autocast(tensor.device.type, dtype=torch.bfloat16, enabled=enabled)


class Autocast(torch.nn.Module):
    """The model with its forward under autocast."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        with autocast(x):
            return self.model(x)
