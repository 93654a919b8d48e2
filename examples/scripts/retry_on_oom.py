"""A training script that finds its own batch size, as accelerate's find_executable_batch_size does: it starts large
and halves the batch whenever CUDA runs out of memory. Under `memplan check --gpu L4 -- python
examples/scripts/retry_on_oom.py` the fake L4 raises torch.OutOfMemoryError where the real one would, so the script
settles where it would on the GPU."""

import argparse
import gc

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=512)
parser.add_argument("--seq", type=int, default=1024)
parser.add_argument("--hidden", type=int, default=1024)
parser.add_argument("--vocab", type=int, default=32000)
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
width = 4 * args.hidden
layers = [nn.Embedding(args.vocab, args.hidden), nn.Linear(args.hidden, width), nn.GELU()]
layers.append(nn.Linear(width, args.hidden))
model = nn.Sequential(*layers, nn.Linear(args.hidden, args.vocab)).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)


def train(batch_size: int, steps: int = 3) -> None:
    for _ in range(steps):
        ids = torch.randint(0, args.vocab, (batch_size, args.seq), device=device)
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


batch = args.batch_size
while batch >= 1:
    try:
        train(batch)
        break
    except torch.OutOfMemoryError:
        print(f"batch {batch}: out of memory, trying {batch // 2}")
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        batch //= 2
print(f"training runs at batch {batch}")
