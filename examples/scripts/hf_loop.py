"""An ordinary HuggingFace training loop: the causal LM a config.json describes (random weights, nothing downloaded),
AdamW, bf16 weights or bf16 autocast, a batch of random token ids. `python examples/scripts/hf_loop.py --config
examples/configs/tiny-llama.json` trains it here; `memplan check --gpu H100 -- python examples/scripts/hf_loop.py
--config examples/configs/llama-3-8b.json --seq 4096 --precision bf16` asks whether Llama-3-8B runs on an H100."""

import argparse
import json

import torch
from transformers import AutoConfig, AutoModelForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--config", required=True, help="a HuggingFace config.json")
parser.add_argument("--batch-size", type=int, default=1)
parser.add_argument("--seq", type=int, default=512)
parser.add_argument("--precision", choices=["fp32", "bf16", "bf16-mixed"], default="bf16-mixed")
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()

fields = json.load(open(args.config))
config = AutoConfig.for_model(fields.pop("model_type"), **fields)
config.use_cache = False
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype).to(device).train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq), device=device)
for step in range(args.steps):
    with torch.autocast(device, dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed"):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    print(f"step {step}: loss {out.loss.item():.3f}")
