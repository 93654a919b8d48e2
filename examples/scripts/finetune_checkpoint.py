"""Fine-tune a causal LM from a local checkpoint: a folder `save_pretrained` wrote (config.json and model.safetensors,
sharded or not, or pytorch_model.bin), loaded with from_pretrained, moved to the GPU and trained a few steps with
AdamW on random token ids. `python examples/scripts/finetune_checkpoint.py --checkpoint DIR` trains it here;
`memplan check --gpu H100 -- python examples/scripts/finetune_checkpoint.py --checkpoint DIR` reads the checkpoint by
shape only (nothing of its weights) and asks whether the fine-tuning runs on an H100."""

import argparse

import torch
from transformers import AutoModelForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint", required=True, help="a folder save_pretrained wrote")
parser.add_argument("--batch-size", type=int, default=1)
parser.add_argument("--seq", type=int, default=128)
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
model = AutoModelForCausalLM.from_pretrained(args.checkpoint)  # the checkpoint's own dtype
model.config.use_cache = False
stored = sum(p.numel() * p.element_size() for p in model.parameters())
dtypes = sorted({str(p.dtype) for p in model.parameters()})
print(f"loaded {args.checkpoint}: {sum(p.numel() for p in model.parameters()):,} parameters, {stored:,} B, {dtypes}")
model.to(device).train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
ids = torch.randint(0, model.config.vocab_size, (args.batch_size, args.seq), device=device)
for step in range(args.steps):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"step {step}: loss {loss.item():.3f}")
