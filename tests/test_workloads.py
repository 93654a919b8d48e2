"""The bundled BERT and GPT-2 workloads: deterministic from a seed, trainable, and Megatron's baseline accounting."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memplan.errors import MemplanError
from memplan.planner.layers.memory import LayerShape, saved_bytes
from memplan.planner.workloads import bert, gpt2

MODELS = [bert, gpt2]


@pytest.mark.parametrize("module", MODELS, ids=lambda m: m.__name__.split(".")[-1])
def test_same_seed_same_losses_and_training_lowers_loss(module):
    runs = []
    for _ in range(2):
        w = module.build_workload(batch_size=2, seq_len=16, seed=3, lr=3e-3)
        torch.manual_seed(0)
        runs.append([float(w.step()) for _ in range(8)])
    assert runs[0] == runs[1]
    assert runs[0][-1] < runs[0][0]


@pytest.mark.parametrize("module", MODELS, ids=lambda m: m.__name__.split(".")[-1])
def test_logits_shape_and_dtype(module):
    w = module.build_workload(batch_size=3, seq_len=8, dtype=torch.bfloat16)
    logits = w.forward()
    assert logits.shape == (3, 8, module.TINY.vocab_size)
    assert logits.dtype == torch.bfloat16


def test_gpt2_is_causal():
    w = gpt2.build_workload(batch_size=1, seq_len=8)
    w.model.eval()
    ids = w.inputs[0]
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % gpt2.TINY.vocab_size
    with torch.no_grad():
        a, b = w.model(ids), w.model(changed)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


@pytest.mark.parametrize("module", MODELS, ids=lambda m: m.__name__.split(".")[-1])
@pytest.mark.parametrize("dtype,p", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_baseline_layer_holds_megatron_bytes(module, dtype, p):
    per_stack = []
    for layers in (1, 2):
        w = module.build_workload(
            batch_size=2, seq_len=16, dtype=dtype, config=dataclasses.replace(module.TINY, layers=layers)
        )
        per_stack.append(saved_bytes(w.model, w.forward))
    shape = LayerShape(s=16, b=2, h=64, a=4, p=p)
    stat_bytes = torch.native_layer_norm(torch.ones(1, 2, dtype=dtype), (2,), None, None, 1e-5)[1].element_size()
    layernorm_stats = 2 * 2 * stat_bytes * shape.s * shape.b  # mean and rstd of two LayerNorms
    assert per_stack[1] - per_stack[0] == shape.formula("baseline") + layernorm_stats


def test_bad_shapes_raise_memplan_errors():
    with pytest.raises(MemplanError, match="positions"):
        bert.build_workload(seq_len=10_000)
    with pytest.raises(MemplanError, match="multiple"):
        gpt2.build_workload(config=dataclasses.replace(gpt2.TINY, heads=5))


def test_formula_and_measure_errors_are_memplan_errors():
    from memplan.planner.layers.memory import LayerShape, held_for_backward
    from memplan.traces.format import make_trace

    with pytest.raises(MemplanError, match="no formula"):
        LayerShape(s=1, b=1, h=1, a=1, p=4).formula("as-built")
    trace = make_trace(
        {
            "size": [8],
            "alloc": [1],
            "free": [2],
            "stream": [0],
            "addr": [-1],
            "category": ["activation"],
            "phase": ["forward"],
            "op": ["x"],
            "module": ["m"],
        }
    )
    with pytest.raises(MemplanError, match="no backward phase"):
        held_for_backward(trace)
