"""Model file: the step of ../shared's xl snapshots (xl_ctx128_full_step_none and _bf16), rebuilt from
PROGRAMS.md (section 3): the CS336 reference LM of examples/cs336_lm.py at its "xl" shape (d_model 2560,
32 layers, 32 heads, d_ff 10240; 3.4 B parameters, so --fake on a machine without ~52 GB of training state),
trained with PyTorch's own AdamW (lr 1e-3, default options) on PyTorch's cross-entropy of the fp32 logits.
CS336_AUTOCAST=bf16 runs the forward under torch.autocast(bfloat16) on the model's device type; the loss
is always outside it, as in the `_bf16` snapshot. AdamW's default on CUDA is its multi-tensor (foreach) path,
whose temporaries span every parameter at once (the snapshots' peak: 13 GB over the 52 GB of state); on the
CPU it is the per-tensor loop, so trace with --device cuda (--fake needs a CUDA build of torch) to compare.
Example: CS336_AUTOCAST=bf16 memplan trace examples/cs336_xl.py --batch 4 --seq 128 --fake --device cuda
"""

import torch
import torch.nn.functional as F
from cs336_lm import PRESETS, VOCAB, Autocast, BasicsTransformerLM


def build(batch_size, seq_len, dtype, device):
    """One training step of the xl BasicsTransformerLM with torch.optim.AdamW and F.cross_entropy."""
    model = Autocast(BasicsTransformerLM(vocab_size=VOCAB, context_length=seq_len, **PRESETS["xl"]))
    x = torch.randint(0, VOCAB, (batch_size, seq_len), device=device)
    y = torch.randint(0, VOCAB, (batch_size, seq_len), device=device)
    return {
        "model": model,
        "inputs": x,
        "loss": lambda logits, _: F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1)),
        "optimizer": lambda params: torch.optim.AdamW(params, lr=1e-3),
        "name": "cs336-xl",
    }
