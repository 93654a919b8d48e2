"""Reversible layers: gradients equal ordinary autograd's (with dropout, and under tempo), inputs rebuilt within the
documented tolerance, bytes held for backward flat in the number of layers and equal to the formula, `full` leaving
the blocks alone, eval equal to training at dropout 0."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memplan.planner.layers import patch
from memplan.planner.layers.memory import LayerShape, held_for_backward, reversible_formula
from memplan.planner.layers.reversible import ReversibleError
from memplan.planner.workloads import bert, gpt2
from memplan.planner.workloads.reversible import build_bert_workload, build_gpt2_workload
from memplan.traces.capture import capture_step

torch.set_num_threads(1)

SEQ, BATCH = 32, 2
CONFIGS = {
    "gpt2": (build_gpt2_workload, dataclasses.replace(gpt2.TINY, vocab_size=256)),
    "bert": (build_bert_workload, dataclasses.replace(bert.TINY, vocab_size=256)),
}  # hidden 64, 4 heads, dropout 0.1
REBUILD_TOLERANCE = 1e-5  # of the streams' largest element (planner/layers/reversible.py: measured 5e-7 here)


def workload(name: str, **changes):
    build, config = CONFIGS[name]
    return build(BATCH, SEQ, config=dataclasses.replace(config, **changes))


def gradients(workload, reversible: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and every parameter's gradient of one forward and backward, the dropout masks drawn from seed 1."""
    workload.model.layers.stack.reversible = reversible
    workload.model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = workload.loss_fn(workload.forward(), workload.inputs)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in workload.model.named_parameters()}


@pytest.mark.parametrize("mode", ["as-built", "tempo", "tempo+selective"])
@pytest.mark.parametrize("name", CONFIGS)
def test_gradients_equal_those_of_autograd_keeping_every_activation(name, mode):
    w = workload(name, layers=3)
    want_loss, want = gradients(w, reversible=False)  # the model as built, every activation kept
    patch(w.model, mode)
    loss, got = gradients(w, reversible=True)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    assert got.keys() == want.keys()
    for key, grad in want.items():
        assert (got[key] - grad).abs().max() <= 1e-5 * grad.abs().max(), key


@pytest.mark.parametrize("name", CONFIGS)
def test_inputs_rebuilt_in_backward_within_the_tolerance(name):
    """Each branch sees its input twice, in forward and rebuilt in backward: x2 of every block (F's input) and x1 of
    every block but the first (the previous G's input)."""
    w = workload(name, layers=8)
    seen: dict[int, list[torch.Tensor]] = {}

    def keep(module, args):
        seen.setdefault(id(module), []).append(args[0].detach().clone())

    for block in w.model.layers.stack.layers:
        block.f.register_forward_pre_hook(keep)
        block.g.register_forward_pre_hook(keep)
    w.step()
    assert len(seen) == 16 and all(len(inputs) == 2 for inputs in seen.values())
    scale = max(first.abs().max() for first, _ in seen.values())
    error = max((rebuilt - first).abs().max() for first, rebuilt in seen.values())
    assert 0 < error <= REBUILD_TOLERANCE * scale  # not bitwise: (x + g) - g rounds


def held(build, config, layers: int) -> int:
    config = dataclasses.replace(config, layers=layers)
    return held_for_backward(capture_step(lambda: build(BATCH, SEQ, config=config)))


def test_bytes_held_for_backward_stay_flat_and_match_the_formula():
    config = CONFIGS["gpt2"][1]
    counts = (2, 4, 8)
    reversible = {n: held(build_gpt2_workload, config, n) for n in counts}
    baseline = {n: held(gpt2.build_workload, config, n) for n in counts}
    shape = LayerShape(s=SEQ, b=BATCH, h=config.hidden, a=config.heads, p=4)
    formula = {n: reversible_formula(shape, n, extra=SEQ * SEQ * 4).held for n in counts}  # the causal mask
    # The baseline grows by a layer's activations a layer; the reversible stack by two generator states a block.
    per_layer = (baseline[4] - baseline[2]) // 2
    assert baseline[8] - baseline[4] == 4 * per_layer and per_layer >= shape.formula("baseline")
    assert reversible[4] - reversible[2] == formula[4] - formula[2] == 4 * 5056
    assert reversible[8] - reversible[4] == formula[8] - formula[4]
    # The stack's bytes: the reversible model's less the model outside the layers (the baseline at zero layers);
    # the streams' mean keeps its 8-byte divisor besides.
    outside = 2 * baseline[2] - baseline[4]
    for n in counts:
        assert 0 <= reversible[n] - outside - formula[n] <= 64
    assert reversible[8] <= baseline[8] / 4


@pytest.mark.parametrize("mode", ["full", "tempo+full", {"layers.stack.layers.1": "full"}], ids=str)
def test_full_checkpoints_no_reversible_block_and_says_so(mode):
    w = workload("gpt2")
    report = patch(w.model, mode)
    assert "full: reversible layers keep no activations; nothing to checkpoint" in report.notes
    assert report.count("ReversibleBlock") == 0
    assert all("forward" not in block.__dict__ for block in w.model.layers.stack.layers)
    assert report.changed == (mode == "tempo+full")


@pytest.mark.parametrize("name", CONFIGS)
def test_eval_and_no_grad_outputs_equal_trainings_at_dropout_zero(name):
    w = workload(name, dropout=0.0, attn_dropout=0.0)
    trained = w.forward()
    assert trained.grad_fn is not None
    with torch.no_grad():
        plain = w.forward()
        w.model.eval()
        evaluated = w.forward()
    torch.testing.assert_close(plain, trained, rtol=0, atol=0)
    torch.testing.assert_close(evaluated, trained, rtol=0, atol=0)


def test_backward_refuses_outputs_changed_in_place_or_a_second_pass():
    w = workload("gpt2")
    x = torch.randn(BATCH, SEQ, 64, requires_grad=True)
    y1, y2 = w.model.layers.stack(x, x)
    y1.mul_(2)
    with pytest.raises(ReversibleError, match="changed in place"):
        (y1 + y2).sum().backward()
    y1, y2 = w.model.layers.stack(x, x)
    (y1 + y2).sum().backward(retain_graph=True)
    with pytest.raises(ReversibleError, match="backward ran twice"):
        (y1 + y2).sum().backward()
