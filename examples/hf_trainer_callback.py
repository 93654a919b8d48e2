"""memplan inside a HuggingFace Trainer run (docs/capture.md#huggingface-trainer-and-accelerate).

    python examples/hf_trainer_callback.py            # a few seconds on a CPU; needs transformers and accelerate

1. `dry_run` trains the Trainer under fake tensors to step 2, before any real training: here on a fake H100 (no
   GPU needed), in bf16 mixed precision, and memplan says whether the step fits it.
2. `MemplanCallback(step=2)` records training step 2 (forward and backward of both micro-batches, clipping,
   AdamW, the scheduler, zero_grad) of a real run on the CPU and writes it to hf-step2.trace.json.gz.
Not a model file: run it with python, not `memplan trace`.
"""

from __future__ import annotations

import tempfile

import torch
import transformers

import memplan
from memplan.integrations.huggingface import MemplanCallback, dry_run


class Tokens(torch.utils.data.Dataset):
    """Random token sequences as a causal LM's examples: use your own tokenized data set."""

    def __init__(self, n: int = 64, seq: int = 128, vocab: int = 1000):
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build_trainer(callbacks=(), **options) -> transformers.Trainer:
    """A tiny Llama and its Trainer, as you would build yours (two micro-batches per optimizer step)."""
    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=4,
        report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True, **{"use_cpu": True, **options},
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    return transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=list(callbacks))


if __name__ == "__main__":
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()

    # 1. A dry run before training: the Trainer built inside, under fake tensors, on a fake H100. (First: a fake
    # CUDA step needs the process's autograd engine to have run no backward before it.)
    fake = dry_run(lambda: build_trainer(use_cpu=False, bf16=True), step=2, device="cuda", gpu="H100-80GB")
    verdict = memplan.simulate(fake, gpu="H100-80GB").verdict
    print(f"dry run, step 2 on an H100 in bf16: peak live {fake.peak()[0]:,} B, fits: {verdict.fits}")

    # 2. A real run: step 2 recorded. `with callback:` discards the recording if training raises inside the step.
    callback = MemplanCallback(step=2, output="hf-step2.trace.json.gz")
    with callback:
        build_trainer(callbacks=[callback]).train()
    trace = callback.trace
    plan = memplan.solve(trace, time_limit=5)
    print(f"real step 2 on the CPU: peak live {trace.peak()[0]:,} B, plan arena {plan.arena:,} B ({plan.status})")
