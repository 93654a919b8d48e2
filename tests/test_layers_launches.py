"""The tempo layers' kernel launches and host reads (planner/layers/launches.py, planner/cost/launches.py), counted
on fake CUDA: each layer's forward + backward and a whole training step in tempo mode within 1.2x the baseline's
launches, no read of a device value on the host; a real fused training step on the CPU reads none either (the
norms' exact channels searched after the optimizer's step, planner/layers/channels.py); and each fused kernel is
no more kernels than a launch count counts it as."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from memplan.modes import BASELINE, TEMPO
from memplan.planner.cost.launches import layer_launches, step_launches
from memplan.planner.layers import channels, fusion, inverse, layernorm, patch, rmsnorm
from memplan.planner.layers.attention import DROPOUT_AGAIN, DROPOUT_GRADIENT, baseline_attention, tempo_attention
from memplan.planner.layers.baseline import SwiGLU
from memplan.planner.layers.gated_mlp import GatedMLP
from memplan.planner.layers.gelu import GELU, InplaceGELU
from memplan.planner.layers.layernorm import InplaceLayerNorm
from memplan.planner.layers.rmsnorm import InplaceRMSNorm
from memplan.planner.layers.silu import SILU, InplaceSiLU
from memplan.planner.workloads import bert, gpt2, llama
from memplan.step import StepSpec

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SHAPE, HEADS = (2, 16, 64), 4
LIMIT = 1.2  # the issue's: a tempo layer's launches at most 1.2x the baseline's


def _attention(core):
    def run(x):
        split = x.reshape(*x.shape[:2], HEADS, -1).transpose(1, 2)
        return core(split, split, split, None, 0.25, 0.1, True)

    return run


def _rmsnorm():
    native = nn.RMSNorm(SHAPE[-1], eps=1e-6)
    return native, InplaceRMSNorm.from_module(native)


def _gated():
    native = SwiGLU(SHAPE[-1], 2 * SHAPE[-1])
    return native, GatedMLP.from_module(native)


# name -> a maker of (the native layer, the tempo layer)
PAIRS = {
    "layernorm": lambda: (nn.LayerNorm(SHAPE[-1]), InplaceLayerNorm(SHAPE[-1])),
    "rmsnorm": _rmsnorm,
    "gelu": lambda: (nn.GELU(), InplaceGELU()),
    "silu": lambda: (nn.SiLU(), InplaceSiLU()),
    "gated-mlp": _gated,
    "attention-dropout": lambda: (_attention(baseline_attention), _attention(tempo_attention)),
}


@pytest.mark.parametrize("name", list(PAIRS))
def test_a_tempo_layer_launches_within_1_2x_of_its_native_layer_and_reads_nothing(name):
    native, tempo = (layer_launches(lambda i=i: PAIRS[name]()[i], SHAPE, torch.bfloat16) for i in (0, 1))
    assert native.total > 0 and not native.reads
    assert tempo.total <= LIMIT * native.total, (dict(tempo.launches), dict(native.launches))
    assert not tempo.reads
    assert any(op.startswith("fused ") for op in tempo.launches)  # its fused kernels counted as such


def test_the_eager_math_is_counted_op_by_op():
    fused = layer_launches(lambda: InplaceRMSNorm(SHAPE[-1], eps=1e-6), (8, 512, 1024), torch.bfloat16)
    eager = layer_launches(lambda: InplaceRMSNorm(SHAPE[-1], eps=1e-6), (8, 512, 1024), torch.bfloat16, fused=False)
    assert "fused rows_math" in fused.launches and not any(op.startswith("fused ") for op in eager.launches)
    assert eager.total > 3 * fused.total  # its forward in chunks of rows, several ops each


@pytest.mark.parametrize("model", ["bert", "gpt2", "llama"])
def test_a_tempo_training_step_launches_within_1_2x_of_the_baselines_and_reads_nothing(model):
    step = StepSpec(str(EXAMPLES / f"{model}.py"), batch=2, seq=32, dtype="bfloat16")
    base, tempo = (step_launches(step.replace(mode=mode)) for mode in (BASELINE, TEMPO))
    assert tempo.total <= LIMIT * base.total, (tempo.total, base.total)
    assert not tempo.reads and not base.reads
    # the norms' weights searched after the optimizer's step: one kernel each, not a forward's mask and nonzero
    assert tempo.launches["fused count_math"] == tempo.launches["fused normalized_math"] // 2 > 0


SYNCS = {"aten::nonzero", "aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal"}
WORKLOADS = {
    "bert": lambda: bert.build_workload(batch_size=2, seq_len=16),
    "gpt2": lambda: gpt2.build_workload(batch_size=2, seq_len=16),
    "llama": lambda: llama.build_workload(batch_size=2, seq_len=16),
}


@pytest.fixture
def fused_kernels(monkeypatch):
    """The fused kernels on, as a user's run has them (tests/conftest.py runs the rest of the suite eager)."""
    if not fusion.supported("cpu"):
        pytest.skip("no C++ compiler: Inductor cannot compile here")
    monkeypatch.setenv(fusion.ENV, "1")


@pytest.mark.slow
@pytest.mark.parametrize("model", list(WORKLOADS))
def test_a_fused_tempo_training_step_reads_no_device_value_on_the_host(model, fused_kernels):
    workload = WORKLOADS[model]()
    patch(workload.model, TEMPO)
    for _ in range(2):
        workload.step()  # the optimizer's state made, the kernels compiled
    ops = set()
    for _ in range(2):  # each forward meets the weights the optimizer's step before it changed
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            workload.loss_fn(workload.forward(), workload.inputs).backward()
        ops |= {event.name for event in profile.events()}
        workload.optimizer.step()  # (AdamW's loop on the CPU reads each step count: its own, not the layers')
        workload.optimizer.zero_grad(set_to_none=True)
    assert "aten::mm" in ops and not SYNCS & ops
    assert channels.PENDING or channels.NONE_FOUND  # the norms' answers came from the search after the step


def test_a_weight_the_optimizer_makes_hard_is_found_after_its_step(fused_kernels):
    norm = InplaceLayerNorm(8)
    reference = nn.LayerNorm(8)

    class ZeroFirst(torch.optim.SGD):
        def step(self, closure=None):
            super().step(closure)
            with torch.no_grad():
                norm.weight[0] = 0.0  # channel 0's x̂ can no longer be recovered from the output

    optimizer = ZeroFirst(norm.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    for _ in range(2):
        norm(x.clone().requires_grad_()).sum().backward()
        optimizer.step()
    assert channels.PENDING.get(norm.weight) is not None  # counted after the step, on the host
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        keep = channels.exact_channels(norm.weight, norm.bias, torch.float32)
    assert keep.tolist() == [0] and "aten::nonzero" in {e.name for e in profile.events()}  # its indices read
    reference.load_state_dict(norm.state_dict())
    got, want = x.clone().requires_grad_(), x.clone().requires_grad_()
    norm(got).sum().backward(), reference(want).sum().backward()
    torch.testing.assert_close(got.grad, want.grad, rtol=1e-5, atol=1e-6)


def _generated_kernels(kernel: fusion.Fused, args: tuple) -> int:
    """The kernel calls in the code Inductor generates on this machine for `kernel`'s function on `args` (a copy
    of its own, so it compiles here, or loads the compiled code from Inductor's cache)."""
    from torch._inductor.codecache import PyCodeCache

    copy = fusion.fused(kernel.function, launches=kernel.launches, **(kernel.options or {}))
    before = len(PyCodeCache.modules)
    copy.run(*args)
    calls = 0
    for module in PyCodeCache.modules[before:]:
        source = Path(module.__file__).read_text()
        names = re.findall(r"^(\w+) = async_compile\.", source, re.MULTILINE)
        calls += sum(source.count(f"{name}(") for name in names) + source.count("extern_kernels.")
    return calls


def _kernel_cases() -> dict[str, tuple[fusion.Fused, tuple]]:
    rows, n = 24, 40
    g = torch.Generator().manual_seed(0)
    dy, y = torch.randn(rows, n, generator=g), torch.randn(rows, n, generator=g)
    rstd, w, b = torch.rand(rows, 1, generator=g) + 0.5, torch.rand(n, generator=g) + 0.5, torch.randn(n, generator=g)
    flat = torch.randn(rows * n, generator=g)
    right = (flat > 0).view(torch.uint8)
    probs, mask = torch.rand(2, 3, 8, 8, generator=g), torch.rand(2, 3, 8, 8, generator=g) > 0.3
    cases = {
        "layernorm backward": (layernorm.FUSED_BACKWARD[True], (dy, y, rstd, w, b, True, torch.float32, True, True)),
        "rmsnorm backward": (layernorm.FUSED_BACKWARD[False], (dy, y, rstd, w, None, False, torch.float32, True, 0)),
        "hard channels": (channels.HARD, (w, b, 1e-38, 64.0)),
        "hard count": (channels.COUNT, (w, b, 1e-38, 64.0)),
        "dropout again": (DROPOUT_AGAIN, (probs, mask, 1.25)),
        "dropout gradient": (DROPOUT_GRADIENT, (probs, mask, 1.25)),
    }
    for flavour in rmsnorm.FLAVOURS:
        cases[f"rmsnorm forward {flavour}"] = (rmsnorm.FUSED_FORWARD, (y, w, 1e-6, flavour, n))
    for activation in (GELU["none"], GELU["tanh"], SILU):
        table = inverse.table_on(activation, "derivative", torch.device("cpu"))
        args = (flat, right, flat * 0.5, flat * 2.0, table, activation.tables)
        cases[f"{activation.name} gradient"] = (activation.fused_gradient, args)
    return cases


@pytest.mark.slow
def test_each_fused_kernel_is_no_more_kernels_than_it_is_counted_as(fused_kernels):
    for name, (kernel, args) in _kernel_cases().items():
        generated = _generated_kernels(kernel, args)
        assert 1 <= generated <= kernel.launches, (name, generated, kernel.launches)
