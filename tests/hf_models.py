"""HuggingFace models from tiny configs (Llama, Mistral, Qwen2, GPT-NeoX, ViT, T5) with their inputs, for the
tests of the layer modes."""

from __future__ import annotations

import torch
import transformers

from memplan.planner.layers import patch
from memplan.traces.inputs.workload import Workload

transformers.logging.set_verbosity_error()

DECODER = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def decoder(family: str):
    """A builder of HuggingFace's `family`ForCausalLM (Llama, Mistral, Qwen2) with grouped-query attention."""

    def build(layers=2):
        config = getattr(transformers, f"{family}Config")(**{**DECODER, "num_hidden_layers": layers})
        return getattr(transformers, f"{family}ForCausalLM")(config)

    return build


def neox(layers=2):
    config = transformers.GPTNeoXConfig(
        vocab_size=300, hidden_size=64, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4
    )
    return transformers.GPTNeoXForCausalLM(config)


def vit(layers=2):
    config = transformers.ViTConfig(
        image_size=32,
        patch_size=4,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_labels=10,
        attention_probs_dropout_prob=0.1,
    )
    return transformers.ViTForImageClassification(config)


def t5(layers=2):
    config = transformers.T5Config(
        vocab_size=300,
        d_model=64,
        d_kv=16,
        d_ff=176,
        num_layers=layers,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.1,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(config)


MODELS = {name.lower(): decoder(name) for name in ("Llama", "Mistral", "Qwen2")}
MODELS |= {"gpt-neox": neox, "vit": vit, "t5": t5}


def inputs(name: str) -> dict:
    generator = torch.Generator().manual_seed(1)
    if name == "vit":
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=generator), "labels": torch.tensor([1, 7])}
    ids = torch.randint(1, 300, (2, 16), generator=generator)
    return {"input_ids": ids, "labels": ids}


def build(name: str, layers: int = 2):
    torch.manual_seed(0)
    return MODELS[name](layers).train()


def loss(model, name: str) -> torch.Tensor:
    return model(**inputs(name)).loss


def workload(name: str, mode: str, layers: int = 2) -> Workload:
    """A training step of model `name` with `layers` layers under layer mode `mode`: its own loss, AdamW."""
    model = build(name, layers)
    patch(model, mode)
    return Workload(model, inputs(name), torch.optim.AdamW(model.parameters()), lambda out, _: out.loss, name)
