"""An ordinary Accelerate training loop (no Trainer): a causal LM from a HuggingFace config (random weights, nothing
downloaded), AdamW and a DataLoader of random token ids through `accelerator.prepare`, mixed precision and gradient
accumulation from the command line.

    python examples/scripts/accelerate_loop.py --config examples/configs/tiny-llama.json
    memplan check --gpu H100 -- python examples/scripts/accelerate_loop.py --config CONFIG --mixed-precision bf16
    memplan check --gpu H100 -- accelerate launch --num_processes 2 examples/scripts/accelerate_loop.py --config CONFIG

train it here, on a fake H100, and on two fake ranks. On a GPU it prints what torch.cuda says of its memory after each
optimizer step."""

import argparse
import json

import torch
from accelerate import Accelerator
from transformers import AutoConfig, AutoModelForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--config", required=True, help="a HuggingFace config.json")
parser.add_argument("--batch-size", type=int, default=2)
parser.add_argument("--seq", type=int, default=256)
parser.add_argument("--mixed-precision", choices=["no", "fp16", "bf16"], default="no")
parser.add_argument("--accumulate", type=int, default=2, help="gradient accumulation steps")
parser.add_argument("--steps", type=int, default=4, help="optimizer steps")
args = parser.parse_args()

accelerator = Accelerator(mixed_precision=args.mixed_precision, gradient_accumulation_steps=args.accumulate)
fields = json.load(open(args.config))
config = AutoConfig.for_model(fields.pop("model_type"), **fields)
config.use_cache = False
model = AutoModelForCausalLM.from_config(config)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
samples = args.batch_size * args.accumulate * args.steps * accelerator.num_processes  # --steps on each rank
ids = torch.randint(0, config.vocab_size, (samples, args.seq))
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=args.batch_size, shuffle=True)
model, optimizer, data = accelerator.prepare(model, optimizer, data)

model.train()
for micro, (batch,) in enumerate(data):
    with accelerator.accumulate(model):
        outputs = model(input_ids=batch, labels=batch)
        loss = outputs.loss
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if accelerator.sync_gradients:
        said = f"step {micro // args.accumulate}: loss {loss.item():.3f}"
        if torch.cuda.is_available():
            said += f", max_memory_allocated {torch.cuda.max_memory_allocated():,} B"
        accelerator.print(said)
accelerator.end_training()
