"""In-place RMSNorm: the bits of nn.RMSNorm's and HuggingFace's outputs and their gradients, for zero and tiny
weights, in fp32, bf16 and mixed precision; output and rstd held; temporaries within one activation."""

from __future__ import annotations

import importlib

import pytest
import torch
from test_layers_layernorm import one_activation, temporary_peaks
from torch import nn

from memplan.planner.layers.memory import saved_bytes
from memplan.planner.layers.rmsnorm import InplaceRMSNorm, RMSNormError
from memplan.traces.fake.mode import FakeCapture
from memplan.traces.recorder import recording

pytest.importorskip("transformers")

H = 64


def hf_class(model: str, name: str) -> type:
    """A HuggingFace module class from transformers.models.<model>.modeling_<model>."""
    return getattr(importlib.import_module(f"transformers.models.{model}.modeling_{model}"), name)


ORIGINALS = {
    "torch": lambda: nn.RMSNorm(H),  # eps None: torch's default
    "torch-no-weight": lambda: nn.RMSNorm(H, eps=1e-5, elementwise_affine=False),
    "llama": lambda: hf_class("llama", "LlamaRMSNorm")(H, eps=1e-6),
    "mistral": lambda: hf_class("mistral", "MistralRMSNorm")(H, eps=1e-6),
    "qwen2": lambda: hf_class("qwen2", "Qwen2RMSNorm")(H, eps=1e-6),
    "t5": lambda: hf_class("t5", "T5LayerNorm")(H, eps=1e-6),
    "olmo2": lambda: hf_class("olmo2", "Olmo2RMSNorm")(H, eps=1e-6),  # the fp32-weight flavour
    "gemma": lambda: hf_class("gemma", "GemmaRMSNorm")(H, eps=1e-6),  # the offset flavour: x̂·(1 + w)
}
FLAVOURS = ["torch", "torch-no-weight", "llama", "t5", "olmo2", "gemma"]  # Mistral and Qwen2 run Llama's code
CASES = ["random", "zero-weights", "tiny-weights", "small-inputs"]


def make_original(flavour: str, case: str, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(1)
    module = ORIGINALS[flavour]()
    if module.weight is not None:
        with torch.no_grad():
            module.weight.copy_(torch.randn(H) * 0.5 + 1.0)
            if case == "zero-weights":
                module.weight[:7] = 0.0
            if case == "tiny-weights":
                module.weight[:4] = 1e-30
                module.weight[4:8] = 1e-4
    return module.to(dtype)


def inputs(case: str, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """x and dy; "small-inputs" makes eps count (mean x² about 1e-6)."""
    torch.manual_seed(2)
    scale = 1e-3 if case == "small-inputs" else 2.0
    return (torch.randn(4, 16, H) * scale + scale / 4).to(dtype), torch.randn(4, 16, H).to(dtype)


def run(module, x, dy, autocast: bool = False) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = module(x)
    out.backward(dy.to(out.dtype))
    grads = [x.grad] + ([module.weight.grad] if module.weight is not None else [])
    return [out.detach()] + [g.clone() for g in grads]


def assert_within_bf16_rounding(got, torch_bf16, truth):
    """No further from the exact result than the original module in bf16, give or take two bf16 ulps."""
    for got_t, ref_t, want in zip(got, torch_bf16, truth):
        assert got_t.dtype == ref_t.dtype
        bound = (ref_t.double() - want).abs().max() + 2**-7 * want.abs().max()
        assert (got_t.double() - want).abs().max() <= bound


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_fp32_matches_the_original(flavour, case):
    ref = make_original(flavour, case)
    new = InplaceRMSNorm.from_module(make_original(flavour, case))
    x, dy = inputs(case)
    got, want = run(new, x, dy), run(ref, x, dy)
    assert torch.equal(got[0], want[0])  # the forward's bits
    for got_t, want_t in zip(got[1:], want[1:]):
        torch.testing.assert_close(got_t, want_t, rtol=1e-5, atol=1e-5 * want_t.abs().max().item())


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_bf16_within_bf16_rounding(flavour, case):
    new = InplaceRMSNorm.from_module(make_original(flavour, case, torch.bfloat16))
    x, dy = inputs(case, torch.bfloat16)
    got, ref = run(new, x, dy), run(make_original(flavour, case, torch.bfloat16), x, dy)
    assert torch.equal(got[0], ref[0])
    assert_within_bf16_rounding(got, ref, run(make_original(flavour, case, torch.float64), x.double(), dy.double()))


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's, for the original too
@pytest.mark.parametrize("autocast", [False, True], ids=["bf16-input", "autocast"])
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_bf16_input_with_fp32_weights_as_mixed_precision_gives_them(flavour, autocast):
    """Each flavour's own promotion: HF's outputs are fp32 there, torch's bf16; the output bits are the same."""
    new = InplaceRMSNorm.from_module(make_original(flavour, "zero-weights"))
    x, dy = inputs("random", torch.bfloat16)
    got, ref = run(new, x, dy, autocast), run(make_original(flavour, "zero-weights"), x, dy, autocast)
    assert torch.equal(got[0], ref[0])
    truth = run(make_original(flavour, "zero-weights", torch.float64), x.double(), dy.to(ref[0].dtype).double())
    assert_within_bf16_rounding(got, ref, truth)


@pytest.mark.parametrize("flavour", ["mistral", "qwen2"])
def test_mistral_and_qwen2_are_llamas(flavour):
    original = make_original(flavour, "random")
    new = InplaceRMSNorm.from_module(original)
    x, _ = inputs("random")
    assert new.flavour == "llama" and torch.equal(new(x), original(x))


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_holds_output_and_rstd_not_input(flavour):
    new = InplaceRMSNorm.from_module(make_original(flavour, "random"))
    x = torch.randn(32, H, requires_grad=True)
    assert saved_bytes(new, lambda: new(x * 1.0)) == 32 * H * 4 + 32 * 4


def test_zero_weight_channels_cost_only_their_columns():
    new = InplaceRMSNorm.from_module(make_original("llama", "zero-weights"))
    x = torch.randn(32, H, requires_grad=True)
    assert saved_bytes(new, lambda: new(x * 1.0)) == 32 * H * 4 + 32 * 4 + 7 * 8 + 32 * 7 * 4


def test_bf16_llama_holds_less_than_the_original_with_its_fp32_copy():
    original = make_original("llama", "random", torch.bfloat16)
    new = InplaceRMSNorm.from_module(original)
    x = torch.randn(32, H, dtype=torch.bfloat16, requires_grad=True)
    held = saved_bytes(new, lambda: new(x * 1.0))
    assert held == 32 * H * 2 + 32 * 4
    assert saved_bytes(original, lambda: original(x * 1.0)) >= held + 32 * H * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_temporaries_stay_within_one_activation(flavour, dtype):
    new = InplaceRMSNorm.from_module(make_original(flavour, "zero-weights", dtype))
    x, dy = torch.randn(2048, H).to(dtype), torch.randn(2048, H).to(dtype)
    forward, backward = temporary_peaks(new, x, dy)
    assert backward <= one_activation(x)
    assert forward <= one_activation(x)


def test_from_module_shares_the_weight_and_the_training_flag():
    for flavour in ORIGINALS:
        original = make_original(flavour, "random").eval()
        new = InplaceRMSNorm.from_module(original)
        assert new.weight is original.weight and not new.training
        assert new.eps == getattr(original, "variance_epsilon", getattr(original, "eps", None))


def test_from_module_declines_other_modules():
    imposter = type("LlamaRMSNorm", (nn.Module,), {})  # the name, but not HuggingFace's class
    assert InplaceRMSNorm.from_module(nn.LayerNorm(H)) is None and InplaceRMSNorm.from_module(imposter()) is None
    with pytest.raises(RMSNormError, match="unknown RMSNorm flavour"):
        InplaceRMSNorm(H, flavour="gemma")


def test_runs_under_fake_tensors():
    with recording(torch.device("cpu"), fake=True) as recorder, FakeCapture(recorder, "cpu") as fake:
        new = InplaceRMSNorm.from_module(make_original("llama", "random"))
        x = torch.randn(4096, H, dtype=torch.bfloat16, requires_grad=True)
        out = new(x)
        out.backward(torch.ones_like(out))
    assert (out.dtype, x.grad.dtype, new.weight.grad.shape) == (torch.float32, torch.bfloat16, (H,))
    assert fake.data_dependent["aten.nonzero"] == 1  # the exact channels' selection, taken as none
