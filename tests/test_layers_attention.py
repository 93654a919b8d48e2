"""Attention cores: dropout recomputation and selective recomputation give the baseline's outputs and gradients,
with the same mask."""

from __future__ import annotations

import pytest
import torch

from memplan.planner.layers.attention import CORES, baseline_attention
from memplan.planner.layers.memory import saved_bytes

B, A, S, D = 2, 4, 16, 16


def run(kind, q, k, v, bias, dy, dtype, training=True, seed=5):
    inputs = [t.to(dtype).clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(seed)
    out = CORES[kind](*inputs, None if bias is None else bias.to(dtype), D**-0.5, 0.3, training)
    after = torch.rand(3)  # the generator must end where the baseline leaves it
    out.backward(dy.to(dtype))
    return [out.detach()] + [t.grad for t in inputs] + [after]


@pytest.fixture
def tensors():
    g = torch.Generator().manual_seed(0)
    q, k, v, dy = (torch.randn(B, A, S, D, generator=g) for _ in range(4))
    causal = torch.full((S, S), float("-inf")).triu(1)
    return q, k, v, causal, dy


@pytest.mark.parametrize("kind", ["tempo", "selective"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("training", [True, False])
def test_same_outputs_gradients_and_mask_as_baseline(tensors, kind, dtype, training):
    want = run("baseline", *tensors, dtype, training)
    got = run(kind, *tensors, dtype, training)
    for g, w in zip(got, want):
        torch.testing.assert_close(
            g, w, rtol=1e-5 if dtype == torch.float32 else 2**-7, atol=1e-6 if dtype == torch.float32 else 2**-7
        )


@pytest.mark.parametrize("kind", ["tempo", "selective"])
def test_under_autocast_gradients_equal_the_baseline_bitwise(tensors, kind):
    """Mixed precision: backward (and the recomputation) runs under the forward's autocast setting, so the
    fp32 inputs' gradients round exactly as the baseline's."""
    q, k, v, causal, dy = tensors
    results = []
    for core in ("baseline", kind):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = CORES[core](*inputs, causal, D**-0.5, 0.3, True)
        out.backward(dy.to(out.dtype))
        results.append([out] + [t.grad for t in inputs])
    assert results[1][0].dtype == torch.bfloat16
    for got, want in zip(*reversed(results)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["tempo", "selective"])
def test_a_learned_attention_bias_gets_the_baselines_gradient(tensors, kind):
    q, k, v, _, dy = tensors
    grads = []
    for core in ("baseline", kind):
        bias = torch.randn(1, A, S, S, generator=torch.Generator().manual_seed(2)).requires_grad_()
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(5)
        CORES[core](*inputs, bias, D**-0.5, 0.3, True).backward(dy)
        grads.append([bias.grad] + [t.grad for t in inputs])
    assert grads[1][0] is not None
    for got, want in zip(*reversed(grads)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_dropout_is_really_applied_and_follows_the_seed(tensors):
    q, k, v, causal, dy = tensors
    a = run("selective", q, k, v, None, dy, torch.float32, seed=5)[0]
    b = run("selective", q, k, v, None, dy, torch.float32, seed=6)[0]
    c = run("baseline", q, k, v, None, dy, torch.float32, training=False)[0]
    assert not torch.allclose(a, b) and not torch.allclose(a, c)


def test_gradcheck_in_float64(tensors):
    q, k, v, causal, _ = (t.double() if t.is_floating_point() else t for t in tensors)
    args = [t[:1, :1, :6, :4].clone().requires_grad_() for t in (q, k, v)]
    for kind in ("tempo", "selective"):

        def core(q_, k_, v_, kind=kind):
            torch.manual_seed(1)  # the same dropout mask at every evaluation
            return CORES[kind](q_, k_, v_, causal[:6, :6], 0.25, 0.2, True)

        assert torch.autograd.gradcheck(core, args)


def test_held_bytes_per_core(tensors):
    q, k, v, _, _ = tensors
    qkv = [t.clone().requires_grad_() for t in (q, k, v)]
    elems, scores = B * A * S * D, B * A * S * S

    def held(kind):
        return saved_bytes(torch.nn.Identity(), lambda: CORES[kind](*(t * 1.0 for t in qkv), None, 0.25, 0.3, True))

    assert held("baseline") == 3 * elems * 4 + scores * (4 + 1 + 4)
    assert held("tempo") == 3 * elems * 4 + scores * (4 + 1)
    assert held("selective") == 3 * elems * 4
    assert baseline_attention is CORES["baseline"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_byte_dropout_draws_the_same_mask_as_nn_dropout(dtype):
    from memplan.planner.workloads.blocks import Dropout

    x, dy = torch.randn(64, 257).to(dtype), torch.randn(64, 257).to(dtype)
    results = []
    for module in (torch.nn.Dropout(0.3), Dropout(0.3)):
        xx = x.clone().requires_grad_()
        torch.manual_seed(3)
        out = module(xx)
        out.backward(dy)
        results.append((out, xx.grad))
    (out_ref, grad_ref), (out, grad) = results
    assert torch.equal(out, out_ref) and torch.equal(grad == 0, grad_ref == 0)
    # nn.Dropout's bf16 noise tensor holds 1/(1-p) rounded to bf16; the 1-byte mask scales in fp32.
    torch.testing.assert_close(grad, grad_ref, rtol=0 if dtype == torch.float32 else 2**-7, atol=0)
    xx = x.clone().requires_grad_()
    held = saved_bytes(torch.nn.Identity(), lambda: Dropout(0.3)(xx * 1))
    assert held == 64 * 257  # a bool mask, where nn.Dropout on the CPU keeps a noise tensor of x's dtype
