"""A plain PyTorch training loop, written without memplan in mind: `python examples/scripts/plain_loop.py` runs it
(on a GPU when there is one), `memplan check --gpu H100 -- python examples/scripts/plain_loop.py` runs it on a fake
H100. It prints what torch.cuda says of its memory, as a script checking its own headroom would."""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=8)
parser.add_argument("--seq", type=int, default=256)
parser.add_argument("--hidden", type=int, default=512)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--vocab", type=int, default=8192)
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
layer = nn.TransformerEncoderLayer(args.hidden, nhead=8, dim_feedforward=4 * args.hidden, batch_first=True)
model = nn.Sequential(nn.Embedding(args.vocab, args.hidden), nn.TransformerEncoder(layer, args.layers),
                      nn.Linear(args.hidden, args.vocab)).to(device)  # fmt: skip
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
if device == "cuda":
    free, total = torch.cuda.mem_get_info()
    print(f"GPU memory: {total:,} B, {free:,} B free")
    torch.cuda.reset_peak_memory_stats()
for step in range(args.steps):
    ids = torch.randint(0, args.vocab, (args.batch_size, args.seq), device=device)
    logits = model(ids)
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if device == "cuda":
        print(f"step {step}: max_memory_allocated {torch.cuda.max_memory_allocated():,} B, "
              f"memory_reserved {torch.cuda.memory_reserved():,} B")  # fmt: skip
