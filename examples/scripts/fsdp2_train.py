"""A torchtitan-style FSDP2 training script: `torchrun --nproc-per-node N examples/scripts/fsdp2_train.py` on N GPUs
(NCCL), or `memplan check --gpu H100 -- torchrun --nproc-per-node 8 examples/scripts/fsdp2_train.py` on N fake
ones. Each Transformer block is sharded with fully_shard, then the root; AdamW over the sharded parameters."""

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

parser = argparse.ArgumentParser()
parser.add_argument("--hidden", type=int, default=1024)
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--batch-size", type=int, default=4)
parser.add_argument("--seq", type=int, default=512)
parser.add_argument("--vocab", type=int, default=8192)
args = parser.parse_args()

backend = "nccl" if torch.cuda.is_available() else "gloo"
dist.init_process_group(backend)
local_rank = int(os.environ.get("LOCAL_RANK", 0))
device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)


class Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


model = nn.Sequential(nn.Embedding(args.vocab, args.hidden), *[Block(args.hidden) for _ in range(args.layers)],
                      nn.Linear(args.hidden, args.vocab)).to(device)  # fmt: skip
for block in model[1:-1]:
    fully_shard(block)
fully_shard(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
ids = torch.randint(0, args.vocab, (args.batch_size, args.seq), device=device)
for _ in range(5):
    loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
dist.destroy_process_group()
