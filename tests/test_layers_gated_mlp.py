"""GatedMLP: the original gated feed-forward's output and gradients (fp32, bf16, autocast, T5's dropout) from
act's output, its 1-byte mask and up's output, with one ffn-wide temporary in backward."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from test_layers_gelu import backward_temporaries
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.planner.layers.gated_mlp import GatedMLP, GatedMLPFunction
from memplan.planner.layers.gelu import GELU
from memplan.planner.layers.memory import saved_bytes
from memplan.planner.layers.silu import SILU
from memplan.planner.workloads.llama import SwiGLU

transformers = pytest.importorskip("transformers")
HIDDEN, FFN = 64, 176
SHAPE = (4, 32, HIDDEN)


def llama(**config):
    from transformers.models.llama.modeling_llama import LlamaMLP

    return LlamaMLP(transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=FFN, **config))


def mistral():
    from transformers.models.mistral.modeling_mistral import MistralMLP

    return MistralMLP(transformers.MistralConfig(hidden_size=HIDDEN, intermediate_size=FFN))


def qwen2():
    from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP

    return Qwen2MLP(transformers.Qwen2Config(hidden_size=HIDDEN, intermediate_size=FFN))


def t5(projection="gated-gelu", dropout=0.1):
    from transformers.models.t5.modeling_t5 import T5DenseGatedActDense

    config = transformers.T5Config(d_model=HIDDEN, d_ff=FFN, feed_forward_proj=projection, dropout_rate=dropout)
    return T5DenseGatedActDense(config)


def swiglu():
    return SwiGLU(HIDDEN, FFN)


MODULES = {
    "swiglu": swiglu,
    "llama": llama,
    "llama-bias": lambda: llama(mlp_bias=True),
    "mistral": mistral,
    "qwen2": qwen2,
    "t5": t5,
    "t5-erf": lambda: t5("gated-gelu_python"),
}


def build(name: str, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    module = MODULES[name]().train().to(dtype)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.2)
    return module


def run(module: nn.Module, x: torch.Tensor, dy: torch.Tensor, seed: int = 0) -> list[torch.Tensor]:
    """Output, input gradient and every parameter's gradient (the same dropout masks for the same seed)."""
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    torch.manual_seed(seed)
    out = module(x)
    out.backward(dy)
    return [out.detach(), x.grad, *(p.grad for p in module.parameters())]


def inputs(dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(SHAPE, generator=generator).to(dtype), torch.randn(SHAPE, generator=generator).to(dtype)


@pytest.mark.parametrize("name", MODULES)
def test_shares_the_originals_linears_and_names(name):
    module = build(name)
    mlp = GatedMLP.from_module(module.eval())
    assert not mlp.training
    assert all(a is b for a, b in zip(mlp.parameters(), module.parameters()))
    assert list(mlp.state_dict()) == list(module.state_dict())


class RenamedMLP(nn.Module):
    """A gated feed-forward under names no list holds, its up and gate in the other order, dropout on the product."""

    def __init__(self, down_after: bool = False):
        super().__init__()
        self.w_a, self.w_b = nn.Linear(HIDDEN, FFN, bias=False), nn.Linear(HIDDEN, FFN, bias=False)
        self.w_out, self.nonlinearity = nn.Linear(FFN, HIDDEN, bias=False), nn.SiLU()
        self.drop, self.down_after = nn.Dropout(0.1), down_after

    def forward(self, x):
        product = self.w_a(x) * self.nonlinearity(self.w_b(x))
        if self.down_after:  # the dropout after the down projection: not what GatedMLP computes
            return self.drop(self.w_out(product))
        return self.w_out(self.drop(product))


def test_recognises_gated_mlps_by_what_they_compute():
    assert GatedMLP.from_module(llama(hidden_act="relu")) is None
    assert GatedMLP.from_module(t5("gated-relu")) is None
    assert GatedMLP.from_module(nn.Linear(4, 4)) is None
    assert GatedMLP.from_module(llama(hidden_act="gelu_pytorch_tanh")).activation is GELU["tanh"]
    assert GatedMLP.from_module(t5()).activation is GELU["tanh"]  # NewGELUActivation
    assert GatedMLP.from_module(t5("gated-gelu_python")).activation is GELU["none"]
    renamed = GatedMLP.from_module(RenamedMLP())
    assert (renamed.layout.gate, renamed.layout.up, renamed.layout.dropout) == ("w_b", "w_a", "drop")
    assert GatedMLP.from_module(RenamedMLP(down_after=True)) is None
    assert GatedMLP.from_module(RenamedMLP().eval()) is not None  # the probe runs in training whatever the mode
    for name in ("Qwen3", "Phi3", "Olmo2", "Gemma2"):  # decoders whose MLP class names no list held
        config = getattr(transformers, f"{name}Config")(hidden_size=HIDDEN, intermediate_size=FFN)
        modeling = importlib.import_module(f"transformers.models.{name.lower()}.modeling_{name.lower()}")
        module = getattr(modeling, f"{name}MLP")(config)
        assert (GatedMLP.from_module(module) is None) == (name == "Phi3")  # Phi3 fuses gate and up in one Linear


@pytest.mark.parametrize("name", MODULES)
def test_fp32_output_and_gradients_match_the_original(name):
    module = build(name)
    mlp = GatedMLP.from_module(module)
    x, dy = inputs()
    for ref, got in zip(run(module, x, dy), run(mlp, x, dy)):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def bf16_ulp(t: torch.Tensor) -> float:
    """One bf16 ulp at the magnitude of t's largest element."""
    return 2.0 ** (torch.floor(torch.log2(t.abs().max().float())).item() - 7)


@pytest.mark.parametrize("name", ["llama-bias", "t5", "t5-erf"])
def test_bf16_no_further_from_fp64_than_the_original(name):
    module = build(name, torch.bfloat16).eval()  # eval: fp64's dropout would draw other masks
    truth = copy.deepcopy(module).double()
    mlp = GatedMLP.from_module(module)
    x, dy = inputs(torch.bfloat16)
    exact = run(truth, x.double(), dy.double())
    for ref, got, true in zip(run(module, x, dy), run(mlp, x, dy), exact):
        assert got.dtype == torch.bfloat16
        error, ref_error = (got.double() - true).abs().max(), (ref.double() - true).abs().max()
        assert error <= ref_error + 2 * bf16_ulp(true)


def test_dropout_draws_nn_dropouts_mask():
    module = build("t5")
    mlp = GatedMLP.from_module(module)
    x, dy = inputs()
    for seed in (1, 2):
        out = run(mlp, x, dy, seed)[0]
        torch.testing.assert_close(out, run(module, x, dy, seed)[0], rtol=1e-5, atol=1e-6)
    assert not torch.equal(run(mlp, x, dy, 1)[0], run(mlp, x, dy, 2)[0])


def test_autocast_gradients_match_the_original():
    module = build("llama-bias")
    mlp = GatedMLP.from_module(copy.deepcopy(module))
    x, dy = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, got = run(module, x, dy.bfloat16()), run(mlp, x, dy.bfloat16())
    for r, g in zip(ref, got):
        assert g.dtype == r.dtype
        torch.testing.assert_close(g.float(), r.float(), rtol=0.02, atol=0.02 * r.abs().max().item())


@pytest.mark.parametrize("activation", [SILU, GELU["none"], GELU["tanh"]], ids=lambda a: a.name)
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-3), (torch.bfloat16, 0.03)])
def test_gate_gradient_near_the_minimum(activation, dtype, bound):
    """The derivative at the recovered gate output is within 1e-3 of the exact one (fp32), within the
    in-place GELU's bf16 bound near the minimum (bf16), for gate outputs within 0.05 of the minimum."""
    torch.manual_seed(0)
    g = (activation.tables.x_min + torch.linspace(-0.05, 0.05, 32 * FFN).view(32, FFN)).to(dtype)
    u, weight, dy = torch.randn(32, FFN).to(dtype), torch.randn(HIDDEN, FFN).to(dtype), torch.randn(32, HIDDEN)
    g.requires_grad_()
    out = GatedMLPFunction.apply(g * 1.0, u, weight, None, activation, 0.0)
    out.backward(dy.to(dtype))
    g64 = g.detach().double().requires_grad_()
    grad_act = dy.to(dtype).double() @ weight.double() * u.double()
    activation.function(g64).backward(grad_act)
    assert ((g.grad.double() - g64.grad).abs() <= bound * grad_act.abs() + 1e-6).all()


def test_act_is_written_over_gates_output_unless_it_is_a_leaf():
    module = build("llama")
    mlp = GatedMLP.from_module(module)
    outputs = []
    module.gate_proj.register_forward_hook(lambda _, __, out: outputs.append(out))
    x = inputs()[0].requires_grad_()
    mlp(x)
    assert torch.equal(outputs[0], torch.nn.functional.silu(module.gate_proj(x)))
    g = torch.randn(8, FFN, requires_grad=True)
    before = g.detach().clone()
    GatedMLPFunction.apply(g, torch.randn(8, FFN), module.down_proj.weight, None, SILU, 0.0)
    assert torch.equal(g.detach(), before)


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_holds_act_output_mask_and_up_output(name):
    module = build(name)
    mlp = GatedMLP.from_module(module)
    x = inputs()[0].requires_grad_()
    rows, ffn_wide = SHAPE[0] * SHAPE[1], SHAPE[0] * SHAPE[1] * FFN
    dropout_mask = ffn_wide if name == "t5" else 0  # 1 byte per element in training
    # both keep x for gate's and up's weight gradients
    assert saved_bytes(mlp, lambda: mlp(x)) == rows * HIDDEN * 4 + ffn_wide * (2 * 4 + 1) + dropout_mask
    if name == "llama":  # as built: gate's output, act's output, up's output and the product
        assert saved_bytes(module, lambda: module(x)) == rows * HIDDEN * 4 + ffn_wide * 4 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_backward_holds_one_ffn_wide_temporary(dtype, dropout):
    torch.manual_seed(0)
    g, u = (torch.randn(256, FFN).to(dtype).requires_grad_() for _ in range(2))
    weight, bias = torch.randn(HIDDEN, FFN).to(dtype).requires_grad_(), torch.randn(HIDDEN).to(dtype).requires_grad_()
    h = g * 1.0  # an intermediate, so act is written over it
    out = GatedMLPFunction.apply(h, u, weight, bias, GELU["tanh"], dropout)
    held = backward_temporaries(out, [h, u, weight, bias], torch.randn_like(out))
    assert 0 < held <= g.numel() * g.element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_module_backward_holds_less_than_the_original(dtype):
    module = build("llama", dtype)
    mlp = GatedMLP.from_module(copy.deepcopy(module))
    x, dy = inputs(dtype)
    x.requires_grad_()
    original, patched = (backward_temporaries(m(x), [x, *m.parameters()], dy) for m in (module, mlp))
    ffn_wide = SHAPE[0] * SHAPE[1] * FFN * x.element_size()
    # gate's and up's gradients are temporaries of the whole module (their Linear modules take them), then one more
    assert patched <= 3 * ffn_wide and patched < original


def test_runs_under_fake_tensors():
    with FakeTensorMode():
        module = llama(mlp_bias=True)
        mlp = GatedMLP.from_module(module)
        x = torch.randn(SHAPE, requires_grad=True)
        mlp(x).sum().backward()
        assert x.grad.shape == x.shape and module.down_proj.weight.grad.shape == (HIDDEN, FFN)
