"""A script that starts its own ranks: `torch.multiprocessing.spawn` of a DDP training function, each rank calling
init_process_group itself (NCCL on GPUs, gloo on the CPU). `python examples/scripts/spawn_ddp.py --world-size 2` trains
it here on two CPU processes; `memplan check --gpu H100 --nproc 2 -- python examples/scripts/spawn_ddp.py
--world-size 2` runs each rank on the fake process group and a fake H100."""

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def train(rank: int, world_size: int, args: argparse.Namespace) -> None:
    """One rank: its process group, a DDP model on its GPU (or the CPU), AdamW, `args.steps` steps."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(rank)
    hidden = args.hidden
    model = nn.Sequential(nn.Embedding(args.vocab, hidden), nn.Linear(hidden, 4 * hidden), nn.GELU(),
                          nn.Linear(4 * hidden, hidden), nn.Linear(hidden, args.vocab)).to(device)  # fmt: skip
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch_size, args.seq), device=device)
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.3f}")
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(train, args=(args.world_size, args), nprocs=args.world_size, join=True)
