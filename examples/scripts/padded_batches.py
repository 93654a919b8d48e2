"""A training loop whose batch shapes come from its data: sequences of random lengths, batched by a DataLoader whose
collate function pads each batch to its longest sequence, on the CPU. `python examples/scripts/padded_batches.py`
runs it (on a GPU when there is one); under `memplan check` the data loading runs on the CPU as written, so the GPU
sees the shapes a real run would. It prints each batch's shape, and stops early if its loss diverges (a branch on a
value the fake GPU does not know, which memplan check names)."""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--max-len", type=int, default=96)
parser.add_argument("--hidden", type=int, default=64)
parser.add_argument("--vocab", type=int, default=1000)
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--workers", type=int, default=0, help="data loader worker processes")
args = parser.parse_args()


class Sequences(Dataset):
    """Token sequences of random lengths, made on the CPU from a seeded generator."""

    def __init__(self, count: int):
        generator = torch.Generator().manual_seed(1)
        lengths = torch.randint(8, args.max_len + 1, (count,), generator=generator)
        self.items = [torch.randint(1, args.vocab, (int(n),), generator=generator) for n in lengths]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def pad_to_longest(batch):
    """The batch padded with 0 to its longest sequence, and the mask of real tokens."""
    longest = max(len(s) for s in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    for row, s in enumerate(batch):
        ids[row, : len(s)] = s
    return ids, ids != 0


device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
shuffled = torch.Generator().manual_seed(2)  # its own generator: the order does not depend on the model's init
loader = DataLoader(Sequences(64), args.batch_size, shuffle=True, collate_fn=pad_to_longest, generator=shuffled,
                    num_workers=args.workers, pin_memory=device == "cuda")  # fmt: skip
model = nn.Sequential(nn.Embedding(args.vocab, args.hidden), nn.Linear(args.hidden, 4 * args.hidden), nn.GELU(),
                      nn.Linear(4 * args.hidden, args.vocab)).to(device)  # fmt: skip
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step, (ids, mask) in zip(range(args.steps), loader):
    print(f"step {step}: batch {tuple(ids.shape)}, {int(mask.sum())} tokens")
    ids, mask = ids.to(device), mask.to(device)
    logits = model(ids)
    losses = nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="none")
    loss = (losses * mask.flatten()).sum() / mask.sum()
    loss.backward()
    if loss.item() > 1e4:
        print("the loss diverged: stopping")
        break
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
