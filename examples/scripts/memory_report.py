"""A training loop that watches its own GPU memory, as many do: it records the allocator's history, resets the peak
before its last step, prints what torch.cuda says, and dumps a snapshot for pytorch.org/memory_viz. Unmodified under
`memplan check`, every one of those calls answers as the fake GPU would."""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--snapshot", default="memory.pickle")
parser.add_argument("--batch-size", type=int, default=16)
args = parser.parse_args()

torch.cuda.memory._record_memory_history(max_entries=100_000)
model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()
optimizer = torch.optim.AdamW(model.parameters())
for step in range(3):
    if step == 2:
        torch.cuda.reset_peak_memory_stats()
    x = torch.randn(args.batch_size, 512, 1024, device="cuda")
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    free, total = torch.cuda.mem_get_info()
    print(f"step {step}: max_memory_allocated {torch.cuda.max_memory_allocated():,} B, free {free:,} of {total:,} B")
    torch.cuda.memory._dump_snapshot(args.snapshot)
