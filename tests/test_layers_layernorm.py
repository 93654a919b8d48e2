"""In-place LayerNorm: same output and gradients as nn.LayerNorm, including zero and tiny weights, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

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
    # fp32 weights with a bf16 output (autocast): |β| = 10·|γ| would cost the output's rounding ten bf16 ulps
    w, b = torch.tensor([1.0, 0.5]), torch.tensor([0.0, 5.0])
    assert exact_channels(w, b).tolist() == [] and exact_channels(w, b, torch.bfloat16).tolist() == [1]


def test_no_exact_channel_is_remembered_until_the_weight_or_bias_changes():
    w, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.0, 0.0, 0.0])
    assert exact_channels(w, b).tolist() == []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        assert exact_channels(w, b).tolist() == []  # remembered: the mask computed, not read
    ops = {event.name for event in profile.events()}
    assert "aten::abs" in ops and "aten::nonzero" not in ops
    w[0] = 0.0  # written in place: a new version
    assert exact_channels(w, b).tolist() == [0] and exact_channels(w, b).tolist() == [0]
    b[2] = 1000.0
    assert exact_channels(w, b).tolist() == [0, 2]
    assert exact_channels(w, None).tolist() == [0] and exact_channels(w, b, torch.bfloat16).tolist() == [0, 2]
    w.data, b.data = torch.ones(3), torch.zeros(3)
    assert exact_channels(w, b).tolist() == [] and exact_channels(w, b).tolist() == []
    w.data = torch.tensor([1.0, 0.0, 1.0])  # swapped, at the same version
    assert exact_channels(w, b).tolist() == [1]


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


class LiveBytes(TorchDispatchMode):
    """Independent count of the bytes of live storages that ops return (as tests/test_capture.py counts) and
    their peak; the `resident` tensors' storages count from the start, and once."""

    def __init__(self, resident: list[torch.Tensor]):
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        for t in resident:
            self._add(t)
        self.peak = self.live()

    def _add(self, t: torch.Tensor) -> None:
        ref = StorageWeakRef(t.untyped_storage())
        self.storages.setdefault(ref.cdata, (ref, t.untyped_storage().nbytes()))

    def live(self) -> int:
        for key in [key for key, (ref, _) in self.storages.items() if ref.expired()]:
            del self.storages[key]
        return sum(nbytes for _, nbytes in self.storages.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        self.peak = max(self.peak, self.live())
        return out


def temporary_peaks(module, x, dy) -> tuple[int, int]:
    """Bytes of temporaries at the forward's and at the backward's peak: beyond the bytes live when the pass
    began and those it leaves behind (the output and what backward keeps; the gradients)."""
    x = x.clone().requires_grad_()
    params = list(module.parameters())
    with LiveBytes([x, dy, *params]) as count:
        out = module(x)
        forward = count.peak - count.live()
        count.peak = start = count.live()
        out.backward(dy)
        grads = sum(t.grad.untyped_storage().nbytes() for t in [x, *params])
        backward = count.peak - start - grads
    return forward, backward


def one_activation(x: torch.Tensor) -> int:
    """The bound on a layer's temporaries: the input's bytes, plus a few fp32 vectors per row and per channel."""
    rows, n = x.reshape(-1, x.shape[-1]).shape
    return x.numel() * x.element_size() + 16 * (rows + n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_temporaries_stay_within_one_activation(dtype):
    """Backward works in row chunks: all in one piece it held 4 (fp32) to 11 (bf16) activations of fp32."""
    ln = InplaceLayerNorm.from_layernorm(make_layernorm("zero-weights", dtype))
    x, dy = torch.randn(2048, H).to(dtype), torch.randn(2048, H).to(dtype)
    forward, backward = temporary_peaks(ln, x, dy)
    assert backward <= one_activation(x)
    assert forward <= one_activation(x)
