"""Bytes per HuggingFace Llama layer, measured by the tracer (stacks of 2 and 1 layers), against
LlamaLayerShape's formulas in every mode, fp32 and bf16, with grouped-query and full multi-head attention, on
SDPA and on eager attention, with and without attention dropout."""

from __future__ import annotations

import pytest
import torch
from lanes import diagonal, named

from memplan.modes import mode as registered
from memplan.planner.layers import MODES, patch
from memplan.planner.layers.memory import LlamaLayerShape, held_for_backward
from memplan.traces.capture import capture_step
from memplan.traces.inputs.workload import Workload

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

S, B, H, A, F = 64, 2, 128, 4, 352


def held(
    mode: str, layers: int, kv_heads: int, dtype: torch.dtype, attention: str = "sdpa", dropout: float = 0.0
) -> int:
    def build():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=H,
            intermediate_size=F,
            num_hidden_layers=layers,
            num_attention_heads=A,
            num_key_value_heads=kv_heads,
            max_position_embeddings=S,
            attention_dropout=dropout,
        )
        config._attn_implementation = attention
        model = transformers.LlamaForCausalLM(config).to(dtype).train()
        patch(model, mode)
        ids = torch.randint(0, 256, (B, S))
        optimizer = torch.optim.AdamW(model.parameters())
        # the layer's own bytes: a loop holding the output would also keep HF's KV cache (use_cache) through backward
        loss = lambda out, _: out.loss  # noqa: E731
        return Workload(model, {"input_ids": ids, "labels": ids}, optimizer, loss, "llama", holds_output=False)

    # the step with no warm-up before it: what a layer keeps for backward is its forward's, made anew each step (the
    # warm-up makes the optimizer's state); every case here measured the same bytes either way
    return held_for_backward(capture_step(build, warmup=False))


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def near_formula(measured: int, shape: LlamaLayerShape, name: str) -> bool:
    """`measured` within 2% of the formula of the mode `name`; for an offloading mode (which keeps 0 bytes a layer on
    the device) within 2% of what the layer keeps without offload (the 8-byte scalar attention dropout keeps stays)."""
    return abs(measured - shape.formula(name)) <= 0.02 * shape.formula(registered(name).resident)


@pytest.mark.parametrize("mode, dtype, kv_heads", diagonal(named(MODES), DTYPES, {"gqa": 2, "mha": 4}))
def test_llama_layer_bytes_within_2_percent_of_formula(mode, dtype, kv_heads):
    shape = LlamaLayerShape(s=S, b=B, h=H, a=A, k=kv_heads, f=F, p=torch.finfo(dtype).bits // 8)
    measured = held(mode, 2, kv_heads, dtype) - held(mode, 1, kv_heads, dtype)
    assert near_formula(measured, shape, mode)


SQUARE = [("eager", 0.0), ("eager", 0.1), ("sdpa", 0.1)]


@pytest.mark.parametrize(
    "mode, dtype, attention, dropout",
    diagonal(named(MODES), DTYPES, dict(zip(["eager", "eager-dropout", "sdpa-dropout"], SQUARE))),
)
def test_llama_layer_bytes_with_a_square_tensor_within_2_percent_of_formula(mode, dtype, attention, dropout):
    """Eager attention, and SDPA with dropout on the CPU (its math path), keep s x s tensors; grouped-query."""
    shape = LlamaLayerShape(
        s=S, b=B, h=H, a=A, k=2, f=F, p=torch.finfo(dtype).bits // 8, attention=attention, dropout=dropout > 0
    )
    measured = held(mode, 2, 2, dtype, attention, dropout) - held(mode, 1, 2, dtype, attention, dropout)
    assert near_formula(measured, shape, mode)


def test_tempo_formula_saving_at_the_7b_shape():
    """At Llama 2 7B's shape in bf16 the formulas give tempo a saving of more than 35% of a layer."""
    shape = LlamaLayerShape(s=4096, b=1, h=4096, a=32, k=32, f=11008, p=2)
    assert 1 - shape.formula("tempo") / shape.formula("as-built") > 0.35
