"""In-place LayerNorm: same output and gradients as nn.LayerNorm, including zero and tiny weights, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from memplan.planner.layers.layernorm import InplaceLayerNorm, exact_channels
from memplan.planner.layers.memory import saved_bytes

H = 64


def make_layernorm(case: str, dtype=torch.float32) -> torch.nn.LayerNorm:
    torch.manual_seed(1)
    ln = torch.nn.LayerNorm(H, elementwise_affine=case != "no-affine")
    if ln.weight is not None:
        with torch.no_grad():
            ln.weight.copy_(torch.randn(H) * 0.5 + 1.0)
            ln.bias.copy_(torch.randn(H) * 0.3)
            if case == "zero-weights":
                ln.weight[:7] = 0.0
            if case == "tiny-weights":
                ln.weight[:4] = 1e-30
                ln.weight[4:8] = 1e-4
    return ln.to(dtype)


def run(module, x, dy):
    x = x.clone().requires_grad_()
    out = module(x)
    out.backward(dy)
    grads = [x.grad] + ([module.weight.grad, module.bias.grad] if module.weight is not None else [])
    return [out.detach()] + [g.clone() for g in grads]


CASES = ["random", "zero-weights", "tiny-weights", "no-affine"]


@pytest.mark.parametrize("case", CASES)
def test_fp32_matches_nn_layernorm(case):
    ref = make_layernorm(case)
    new = InplaceLayerNorm.from_layernorm(make_layernorm(case))
    torch.manual_seed(2)
    x, dy = torch.randn(4, 16, H) * 2 + 0.5, torch.randn(4, 16, H)
    for got, want in zip(run(new, x, dy), run(ref, x, dy)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("case", CASES)
def test_bf16_within_bf16_rounding(case):
    new = InplaceLayerNorm.from_layernorm(make_layernorm(case, torch.bfloat16))
    exact = make_layernorm(case, torch.float64)
    torch.manual_seed(2)
    x, dy = (torch.randn(4, 16, H) * 2 + 0.5).to(torch.bfloat16), torch.randn(4, 16, H).to(torch.bfloat16)
    ref = run(make_layernorm(case, torch.bfloat16), x, dy)
    truth = run(exact, x.double(), dy.double())
    for got, torch_bf16, want in zip(run(new, x, dy), ref, truth):
        assert got.dtype == torch.bfloat16
        # No further from the exact result than torch's own bf16 LayerNorm, give or take two bf16 ulps.
        bound = (torch_bf16.double() - want).abs().max() + 2**-7 * want.abs().max()
        assert (got.double() - want).abs().max() <= bound


def test_zero_weights_give_exact_weight_gradients_where_tempo_divides_by_zero():
    ref, new = make_layernorm("zero-weights"), InplaceLayerNorm.from_layernorm(make_layernorm("zero-weights"))
    x, dy = torch.randn(8, H), torch.randn(8, H)
    got, want = run(new, x, dy), run(ref, x, dy)
    assert torch.isfinite(got[2]).all()
    torch.testing.assert_close(got[2][:7], want[2][:7], rtol=1e-5, atol=1e-6)
    assert want[2][:7].abs().min() > 0  # the zero-weight channels do have a gradient to get right


def test_exact_channels_only_where_recovery_fails():
    w = torch.tensor([1.0, 0.0, 1e-40, 0.01, 2.0])
    b = torch.tensor([0.0, 0.0, 0.0, 5.0, 1.0])
    assert exact_channels(w, b).tolist() == [1, 2, 3]
    assert exact_channels(w, None).tolist() == [1, 2]


def test_holds_output_and_rstd_not_input():
    ln = InplaceLayerNorm.from_layernorm(make_layernorm("random"))
    x = torch.randn(32, H, requires_grad=True)
    held = saved_bytes(ln, lambda: ln(x * 1.0))
    assert held == 32 * H * 4 + 32 * 4  # the output (the next layer keeps it anyway) and rstd


def test_zero_weight_channels_cost_only_their_columns():
    ln = InplaceLayerNorm.from_layernorm(make_layernorm("zero-weights"))
    x = torch.randn(32, H, requires_grad=True)
    assert saved_bytes(ln, lambda: ln(x * 1.0)) == 32 * H * 4 + 32 * 4 + 7 * 8 + 32 * 7 * 4


def test_shares_parameters_with_the_replaced_module():
    ln = make_layernorm("random")
    new = InplaceLayerNorm.from_layernorm(ln)
    assert new.weight is ln.weight and new.bias is ln.bias and new.eps == ln.eps
