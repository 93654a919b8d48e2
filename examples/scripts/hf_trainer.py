"""An ordinary HuggingFace Trainer script: a Llama-shaped causal LM from a config (random weights, nothing
downloaded), a dataset of random token ids, TrainingArguments from the command line. `python
examples/scripts/hf_trainer.py --output_dir out --max_steps 3` trains it; `memplan check --gpu H100 -- python
examples/scripts/hf_trainer.py --output_dir out --max_steps 3` runs it on a fake H100."""

import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

(args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip
model = LlamaForCausalLM(config)


class RandomTokens(torch.utils.data.Dataset):
    """Token ids at random, as inputs and labels."""

    def __len__(self):
        return 1024

    def __getitem__(self, i):
        ids = torch.randint(0, config.vocab_size, (256,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


Trainer(model=model, args=args, train_dataset=RandomTokens()).train()
