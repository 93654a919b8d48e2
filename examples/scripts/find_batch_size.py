"""accelerate's find_executable_batch_size around a training step: `python examples/scripts/find_batch_size.py
--start 96` tries batch 96, then one smaller each time CUDA runs out of memory, until three steps run. The file is
also a memplan model file (`build`), so `memplan fit examples/scripts/find_batch_size.py --gpu H100` answers for the
same step, and `memplan check --gpu H100 -- python examples/scripts/find_batch_size.py --start 96` runs the search
itself on a fake H100."""

import argparse

import torch
from torch import nn

VOCAB, HIDDEN, LAYERS = 32000, 1024, 4


def make_model(device, dtype=torch.float32) -> nn.Module:
    """An embedding, LAYERS MLP blocks and a vocabulary head."""
    blocks = [
        nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN)) for _ in range(LAYERS)
    ]
    return nn.Sequential(nn.Embedding(VOCAB, HIDDEN), *blocks, nn.Linear(HIDDEN, VOCAB)).to(device, dtype)


def loss_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


def build(batch_size, seq_len, dtype, device):
    """memplan's model file protocol: the same model, batch, loss and optimizer as the script's step."""
    model = make_model(device, dtype)
    ids = torch.randint(0, VOCAB, (batch_size, seq_len), device=device)
    return {"model": model, "inputs": ids, "loss": loss_of, "optimizer": lambda params: torch.optim.AdamW(params)}


if __name__ == "__main__":
    from accelerate.utils import find_executable_batch_size

    parser = argparse.ArgumentParser()
    parser.add_argument("--start", type=int, default=96)
    parser.add_argument("--seq", type=int, default=1024)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = make_model(device)
    optimizer = torch.optim.AdamW(model.parameters())
    batch = args.start

    def one_smaller() -> int:
        global batch
        batch -= 1
        return batch

    @find_executable_batch_size(starting_batch_size=args.start, reduce_batch_size_fn=one_smaller)
    def train(batch_size):
        print(f"trying batch {batch_size}")
        optimizer.zero_grad(set_to_none=True)
        ids = torch.randint(0, VOCAB, (batch_size, args.seq), device=device)
        for _ in range(3):
            logits = model(ids)
            loss = loss_of(logits, ids)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del logits, loss
        print(f"three steps run at batch {batch_size}")

    train()
