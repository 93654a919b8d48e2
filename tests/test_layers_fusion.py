"""The tempo layers' fused kernels (planner/layers/fusion.py): on the CPU they compute what the eager math computes
(fp32, bf16), their backwards never hold more bytes than the eager ones, and everything that traces (fake tensors,
dispatch modes, captures) or asks for eager math gets it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from memplan.planner.layers import attention, fusion, inverse, layernorm, patch, rmsnorm
from memplan.planner.layers.baseline import SwiGLU
from memplan.planner.layers.gated_mlp import GatedMLP
from memplan.planner.layers.gelu import GELU, InplaceGELU
from memplan.planner.layers.layernorm import InplaceLayerNorm
from memplan.planner.layers.rmsnorm import InplaceRMSNorm
from memplan.planner.layers.silu import SILU, InplaceSiLU
from memplan.planner.workloads import gpt2
from memplan.traces.capture import capture_step
from memplan.traces.recorder import recording

pytestmark = pytest.mark.skipif(not fusion.supported("cpu"), reason="no C++ compiler: Inductor cannot compile here")


@pytest.fixture(autouse=True)
def fused(monkeypatch):
    """The fused kernels on, as a user's run has them (tests/conftest.py runs the rest of the suite eager)."""
    monkeypatch.setenv(fusion.ENV, "1")


ROWS, WIDTH = 48, 96


def _affine(module: torch.nn.Module, generator: torch.Generator) -> torch.nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(1.0 + 0.5 * torch.rand(p.shape, generator=generator))  # no channel needs its exact x̂
    return module


def _attention(x: torch.Tensor) -> torch.Tensor:
    q, k, v = x.reshape(2, 2, ROWS // 4, 3, WIDTH // 3).unbind(-2)
    torch.manual_seed(7)  # the same dropout mask in both runs
    return attention.tempo_attention(q, k, v, None, 0.5, 0.3, True)


def _gated(generator: torch.Generator) -> torch.nn.Module:
    swiglu = SwiGLU(WIDTH, 2 * WIDTH)
    with torch.no_grad():
        for p in swiglu.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.2)
    return GatedMLP.from_module(swiglu)


# name -> (module maker, the kernels its backward runs)
CASES = {
    "gelu-erf": (lambda g: InplaceGELU("none"), [GELU["none"].fused_gradient]),
    "gelu-tanh": (lambda g: InplaceGELU("tanh"), [GELU["tanh"].fused_gradient]),
    "silu": (lambda g: InplaceSiLU(), [SILU.fused_gradient]),
    "layernorm": (lambda g: _affine(InplaceLayerNorm(WIDTH), g), [layernorm.FUSED_BACKWARD[True]]),
    "rmsnorm": (
        lambda g: _affine(InplaceRMSNorm(WIDTH, eps=1e-6), g),
        [rmsnorm.FUSED_FORWARD, layernorm.FUSED_BACKWARD[False]],
    ),
    "rmsnorm-llama": (
        lambda g: _affine(InplaceRMSNorm(WIDTH, eps=1e-6, flavour="llama"), g),
        [rmsnorm.FUSED_FORWARD, layernorm.FUSED_BACKWARD[False]],
    ),
    "attention-dropout": (lambda g: _attention, [attention.DROPOUT_AGAIN, attention.DROPOUT_GRADIENT]),
    "gated-mlp": (_gated, [SILU.fused_gradient]),
}
# Relative, and absolute as a fraction of the largest value (a kernel rounds its products once; a matmul after it
# may cancel its last bit): one fp32 rounding in 10^5, one bf16 unit in the last place.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-7}
BITWISE = {"attention-dropout"}  # products of a 0/1 mask and a scale of the dtype: one rounding either way


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available() or not fusion.supported("cuda"), reason="needs a GPU with Triton"
        ),
    ),
]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _make(name: str, dtype: torch.dtype, device: str):
    generator = torch.Generator().manual_seed(0)
    module = CASES[name][0](generator)
    if isinstance(module, torch.nn.Module):
        module = module.to(device, dtype)
    x = (3 * torch.randn(ROWS, WIDTH, generator=generator)).to(device, dtype)
    return module, x


def _run(module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_()
    out = module(x * 1)  # an intermediate, as the layers meet it in a model
    out.backward(torch.cos(out.detach().float()).to(out.dtype))
    params = list(module.parameters()) if isinstance(module, torch.nn.Module) else []
    return (out.detach(), x.grad, *(p.grad for p in params))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_fused_and_eager_math_agree(name, dtype, device):
    module, x = _make(name, dtype, device)
    with fusion.eager():
        want = _run(module, x)
    for p in module.parameters() if isinstance(module, torch.nn.Module) else ():
        p.grad = None
    kernels = CASES[name][1]
    before = [k.runs for k in kernels]
    got = _run(module, x)
    assert all(k.runs > n for k, n in zip(kernels, before)), "the backward did not run its fused kernels"
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        tolerance = 0.0 if name in BITWISE else TOLERANCE[dtype]
        torch.testing.assert_close(g, w, rtol=tolerance, atol=tolerance * w.abs().max().item())


def _peak(run, device: str = "cpu") -> int:
    """The highest live bytes above the start that `run` reaches, every allocation on `device` recorded."""
    with recording(torch.device(device)) as recorder:
        recorder.begin_step()
        run()
        sizes = recorder.end_step().size
    return int(np.cumsum(sizes).max(initial=0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_a_fused_backward_holds_no_more_than_the_eager_one(name, dtype, device):
    module, x = _make(name, dtype, device)
    _run(module, x)  # compiled before it is measured
    with fusion.eager():
        eager = _peak(lambda: _run(module, x), device)
    assert _peak(lambda: _run(module, x), device) <= eager


def test_a_fused_training_step_peaks_no_higher_than_the_eager_one():
    workload = gpt2.build_workload(batch_size=2, seq_len=32)
    patch(workload.model, "tempo")
    workload.step()  # optimizer state made, kernels compiled
    runs = SILU.fused_gradient.runs + GELU["tanh"].fused_gradient.runs + GELU["none"].fused_gradient.runs
    fused = _peak(workload.step)
    assert GELU["tanh"].fused_gradient.runs + GELU["none"].fused_gradient.runs + SILU.fused_gradient.runs > runs
    with fusion.eager():
        assert fused <= _peak(workload.step)


def test_captures_record_the_eager_math():
    def build():
        workload = gpt2.build_workload(batch_size=2, seq_len=32)
        patch(workload.model, "tempo")
        return workload

    runs = layernorm.FUSED_BACKWARD[True].runs
    fused = capture_step(build)
    assert layernorm.FUSED_BACKWARD[True].runs == runs
    with fusion.eager():
        eager = capture_step(build)
    assert fused.peak() == eager.peak() and list(fused.op) == list(eager.op) and list(fused.size) == list(eager.size)


class Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_eager_wherever_a_kernel_must_not_run(monkeypatch):
    x = torch.ones(4)
    assert fusion.runs_fused([x, x])
    with fusion.eager():
        assert not fusion.runs_fused([x])
    with FakeTensorMode() as mode:
        assert not fusion.runs_fused([mode.from_tensor(x)])
    with Passthrough():
        assert not fusion.runs_fused([x])
    assert not fusion.runs_fused([torch.ones(4, device="meta")])
    assert not fusion.runs_fused([x, torch.ones(4, requires_grad=True)])
    with torch.no_grad():
        assert fusion.runs_fused([x, torch.ones(4, requires_grad=True)])
    monkeypatch.setenv(fusion.ENV, "0")
    assert not fusion.runs_fused([x])


def test_an_activation_backward_under_fake_tensors_runs_the_eager_chunks():
    runs = GELU["tanh"].fused_gradient.runs
    with FakeTensorMode():
        y = torch.randn(64, 32)
        grad = inverse.input_gradient(y, y >= 0, GELU["tanh"], torch.randn(64, 32))
    assert grad.shape == (64, 32) and GELU["tanh"].fused_gradient.runs == runs


def _norm_operands(rows: int, n: int):
    generator = torch.Generator().manual_seed(1)
    dy, y = torch.randn(rows, n, generator=generator), torch.randn(rows, n, generator=generator)
    rstd, w = torch.rand(rows, 1, generator=generator) + 0.5, torch.rand(n, generator=generator) + 0.5
    return dy, y, rstd, w, torch.randn(n, generator=generator)


def test_a_call_seen_before_runs_its_compiled_graph_directly_with_the_same_bits():
    kernel = fusion.fused(layernorm.normalized_math)  # a function of its own: its first call goes through Dynamo
    args = (*_norm_operands(6, 10), True, torch.float32, True, False)  # dβ not asked: a None among the outputs
    first = kernel.run(*args)
    assert kernel.direct_runs == 0
    second = kernel.run(*args)
    assert kernel.direct_runs == 1 and second[2] is None
    for got, want in zip(second[:2], first[:2]):
        assert torch.equal(got, want) and got.data_ptr() != want.data_ptr()
    other = (*_norm_operands(7, 12), True, torch.float32, True, False)  # new shapes: Dynamo's guards choose again
    for got, want in zip(kernel.run(*other)[:2], layernorm.normalized_math(*other)[:2]):
        torch.testing.assert_close(got, want)
    assert kernel.direct_runs == 1 and kernel.run(*other) is not None and kernel.direct_runs == 2


def test_a_call_with_a_tensor_passed_twice_is_never_replayed_directly():
    kernel = fusion.fused(attention.dropout_gradient)
    grad = torch.randn(4, 8)
    for _ in range(2):
        torch.testing.assert_close(kernel.run(grad, grad, 2.0), attention.dropout_gradient(grad, grad, 2.0))
    assert kernel.runs == 2 and kernel.direct_runs == 0


@pytest.mark.parametrize("name", list(CASES))
def test_a_layer_runs_its_kernels_directly_from_its_second_call_with_the_same_bits(name, monkeypatch):
    module, x = _make(name, torch.float32, "cpu")
    kernels = CASES[name][1]
    for kernel in kernels:
        monkeypatch.setattr(kernel, "_direct", {})  # the first call through Dynamo, whatever ran before
    first = _run(module, x)
    direct = [kernel.direct_runs for kernel in kernels]
    for p in module.parameters() if isinstance(module, torch.nn.Module) else ():
        p.grad = None
    second = _run(module, x)
    assert all(kernel.direct_runs > n for kernel, n in zip(kernels, direct))
    assert all(torch.equal(got, want) for got, want in zip(second, first))


SYNCS = {"aten::nonzero", "aten::_local_scalar_dense", "aten::item", "aten::is_nonzero"}  # reads of device values


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_a_repeated_forward_and_backward_reads_no_value_on_the_host(name, device):
    module, x = _make(name, torch.float32, device)
    _run(module, x)  # kernels compiled, a norm's exact channels found for its weights
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        _run(module, x)
    ops = {event.name for event in profile.events()}
    assert "aten::native_dropout" in ops or "aten::mm" in ops or len(ops) > 5  # the profiler saw the ops
    assert not SYNCS & ops
