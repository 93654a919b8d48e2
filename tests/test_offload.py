"""Activation offload per layer: the offload modes compute the same loss and gradients as the modes they extend, free
the layer's saved device bytes between forward and backward (the trace shows it, and records the host bytes), and
the time the host link adds."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from memplan.cli import main
from memplan.errors import MemplanError, TraceError
from memplan.gpus import NVLINK_C2C, PCIE_GEN5_X16, gpu
from memplan.modes import (
    BASELINE,
    OFFLOAD,
    OPTIMIZE_MODES,
    PER_LAYER_MODES,
    REGISTRY,
    SWEPT_MODES,
    mode,
)
from memplan.planner.cost import CostError, host_transfer
from memplan.planner.layers import patch, transformer_layers, unpatch
from memplan.planner.layers.memory import LayerShape, LlamaLayerShape, held_for_backward, host_formula
from memplan.planner.layers.patch import host_ledger
from memplan.planner.workloads import gpt2, llama
from memplan.traces.capture import capture_step
from memplan.traces.format import load, save, trace_digest
from memplan.traces.host import host_bytes
from memplan.units import SizeError, parse_bandwidth

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
OFFLOADING = ("offload", "tempo+offload", "selective+offload")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def test_offload_composes_with_the_parts_that_change_what_a_layer_saves():
    assert tuple(n for n, m in REGISTRY.items() if m.offloads) == OFFLOADING
    assert [mode(n).resident for n in OFFLOADING] == ["baseline", "tempo", "selective"]
    assert all(mode(n).resident == n for n in REGISTRY if not mode(n).offloads)
    for name in OFFLOADING:
        m = mode(name)
        assert BASELINE in m.parts and OFFLOAD in m.parts and not m.checkpoints  # full keeps its input out of reach
        assert name in PER_LAYER_MODES and name not in SWEPT_MODES and name not in OPTIMIZE_MODES
        assert m.core == mode(m.resident).core


def step_of(module, name: str, dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and gradients of one forward and backward of the bundled `module` under the mode `name`."""
    workload = module.build_workload(batch_size=2, seq_len=16, dtype=dtype)
    patch(workload.model, name)
    torch.manual_seed(0)  # the same dropout masks
    loss = workload.loss_fn(workload.forward(), workload.inputs)
    loss.backward()
    return loss.detach(), {k: p.grad for k, p in workload.model.named_parameters()}


@pytest.mark.parametrize("offloading", OFFLOADING)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
@pytest.mark.parametrize("module", [gpt2, llama], ids=["gpt2", "llama"])
def test_loss_and_gradients_equal_the_mode_without_offload(module, dtype, offloading):
    loss, grads = step_of(module, mode(offloading).resident, dtype)
    offloaded_loss, offloaded_grads = step_of(module, offloading, dtype)
    assert torch.equal(offloaded_loss, loss)
    assert grads.keys() == offloaded_grads.keys()
    assert all(torch.equal(offloaded_grads[k], grads[k]) for k in grads)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
def test_a_huggingface_model_computes_the_same_offloaded(dtype):
    pytest.importorskip("transformers")
    from hf_models import build, inputs

    results = []
    for name in ("baseline", "offload"):
        model = build("llama").to(dtype)
        report = patch(model, name)
        torch.manual_seed(0)
        loss = model(**inputs("llama")).loss
        loss.backward()
        results.append((loss.detach(), {k: p.grad for k, p in model.named_parameters()}))
    assert report.count("LlamaDecoderLayer") == 2 and host_ledger(model) is not None  # every layer offloaded
    (loss, grads), (offloaded_loss, offloaded_grads) = results
    assert torch.equal(offloaded_loss, loss) and all(torch.equal(offloaded_grads[k], grads[k]) for k in grads)


def test_per_layer_offload_moves_only_that_layers_tensors_and_unpatch_puts_its_forward_back():
    workload = gpt2.build_workload(batch_size=2, seq_len=16)
    first, second = transformer_layers(workload.model)
    report = patch(workload.model, {first: "offload", second: "tempo"})
    assert report.layers == {first: "offload", second: "tempo"}
    ledger = host_ledger(workload.model)
    ledger.begin(lambda: 0)
    workload.step()
    copies = ledger.end(1)
    assert copies["size"] and set(copies["module"]) == {first}
    assert copies["free"] == [1] * len(copies["size"]) and not ledger.live  # backward took every copy back
    workload.step()  # not recording: nothing is kept of a copy once freed
    assert not ledger.live and ledger.recorded is None
    assert unpatch(workload.model) > 0 and host_ledger(workload.model) is None
    assert all("forward" not in layer.__dict__ for layer in workload.model.modules())


def held_and_host(layers: dict | str, fake: bool, module=gpt2):
    """Bytes the traced step of the bundled `module` holds from forward into backward, its host copies, its trace."""

    def build():
        workload = module.build_workload(batch_size=2, seq_len=16)
        workload.patch = patch(workload.model, layers).to_dict()
        return workload

    trace = capture_step(build, fake=fake)
    return held_for_backward(trace), host_bytes(trace), trace


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_offload_frees_a_layers_saved_device_bytes_and_records_them_as_host_bytes(fake, tmp_path):
    held, none, _ = held_and_host("baseline", fake)
    all_held, all_host, trace = held_and_host("offload", fake)
    assert none is None
    # Each layer's saved bytes (Megatron's, and LayerNorm's mean and rstd) leave the device; the host holds them.
    shape = LayerShape(s=16, b=2, h=64, a=4, p=4)
    layer = host_formula(shape, "offload") + 2 * 2 * 4 * shape.s * shape.b
    assert held - all_held == all_host.moved == 2 * layer
    # Per layer: only the layer offloaded frees its bytes, which the host then holds.
    tempo_held, _, _ = held_and_host({"layers.0": "tempo", "layers.1": "as-built"}, fake)
    one_held, one_host, _ = held_and_host({"layers.0": "tempo+offload", "layers.1": "as-built"}, fake)
    assert tempo_held - one_held == one_host.moved > 0 and set(one_host.module) == {"layers.0"}
    # Copies are made in forward and freed in backward, within the window; at backward's start all are on the host.
    backward = min(int(t) for t, phase in zip(trace.alloc, trace.phase) if phase == "backward")
    assert all_host.live_at(backward) == all_host.peak() == all_host.moved
    assert (all_host.free < trace.end).all() and (all_host.alloc < backward).all()
    # The trace's file keeps them; the device buffers the planners read are the device's only.
    save(trace, tmp_path / "offload.json.gz")
    again = load(tmp_path / "offload.json.gz")
    assert host_bytes(again).moved == all_host.moved and trace_digest(again) == trace_digest(trace)


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_views_of_one_storage_move_once(fake):
    """Llama's q, k and v are views of each other's storages after rotation and repeat: each storage moves once. What
    moves beyond the device bytes freed is each layer's copy of the rotary cos and sin, made outside the layers (which
    the model holds anyway)."""
    held, _, _ = held_and_host("baseline", fake, llama)
    offloaded, host, _ = held_and_host("offload", fake, llama)
    assert 0 < host.moved - (held - offloaded) <= 0.01 * host.moved


def test_a_malformed_host_record_is_refused_in_one_line():
    _, _, trace = held_and_host({"layers.0": "offload"}, True)
    for broken in ({"size": [1]}, {**trace.meta["host"], "free": [-1] * len(trace.meta["host"]["free"])}):
        with pytest.raises(TraceError, match="meta host"):
            host_bytes(dataclasses.replace(trace, meta={**trace.meta, "host": broken}))


def test_the_formulas_keep_nothing_on_the_device_and_move_the_modes_bytes_to_the_host():
    shape = LayerShape(s=128, b=2, h=256, a=8, p=2)
    llama_shape = LlamaLayerShape(s=128, b=2, h=256, a=8, k=2, f=704, p=2)
    for name in OFFLOADING:
        assert shape.formula(name) == llama_shape.formula(name) == 0
        assert host_formula(shape, name) == shape.formula(mode(name).resident) > 0
        assert host_formula(llama_shape, name) == llama_shape.formula(mode(name).resident) > 0
    assert host_formula(shape, "tempo") == 0


def test_transfer_time_is_the_bytes_moved_over_the_host_link():
    moved = 3 * 10**9
    h100 = host_transfer(moved, gpu("H100"))
    assert (h100.bandwidth, h100.link) == (PCIE_GEN5_X16, "PCIe gen5 x16")
    assert h100.seconds_each_way == moved / PCIE_GEN5_X16 and h100.seconds == 2 * moved / PCIE_GEN5_X16
    assert host_transfer(moved, gpu("GH200")).bandwidth == NVLINK_C2C
    given = host_transfer(moved, gpu("H100"), parse_bandwidth("25GB/s"))  # the bandwidth given wins
    assert given.bandwidth == 25 * 10**9 and given.seconds == pytest.approx(0.24)
    assert given.to_dict()["seconds"] == given.seconds
    with pytest.raises(CostError, match="--gpu.*--host-bandwidth"):
        host_transfer(moved)


def test_bandwidths_are_parsed_by_units_and_bad_ones_refused():
    assert parse_bandwidth("25GB/s") == parse_bandwidth("25 GB / s") == parse_bandwidth("25GB") == 25 * 10**9
    assert parse_bandwidth("64GiB/s") == 64 << 30
    for bad in ("fast", "25GB/min", "0GB/s"):
        with pytest.raises(SizeError) as error:
            parse_bandwidth(bad)
        assert isinstance(error.value, MemplanError)


def test_trace_reports_host_bytes_and_transfer_time(tmp_path):
    out = tmp_path / "t.json.gz"
    args = ["trace", str(EXAMPLES / "gpt2.py"), "--batch", "1", "--seq", "16", "--fake", "--layers", "offload"]
    result = CliRunner().invoke(main, [*args, "--host-bandwidth", "10GB/s", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["host"]["moved"] == summary["host_transfer"]["moved"] == host_bytes(load(out)).moved > 0
    assert summary["host_transfer"]["seconds"] == 2 * summary["host"]["moved"] / 10**10
    text = CliRunner().invoke(main, [*args, "--gpu", "H100", "-o", str(out)])
    assert "host memory (offloaded layers)" in text.output and "over PCIe gen5 x16" in text.output
    bad = CliRunner().invoke(main, [*args, "--host-bandwidth", "fast", "-o", str(tmp_path / "u.json.gz")])
    assert bad.exit_code == 1 and bad.output.strip().splitlines()[-1].startswith("Error: 'fast' is not a bandwidth")
    assert not (tmp_path / "u.json.gz").exists()


class TiedLayer(torch.nn.Module):
    """A layer that multiplies by a parameter of a module outside it (a tied weight)."""

    def __init__(self, shared: torch.nn.Linear):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.shared = [shared]  # not registered: the weight is the model's, not the layer's

    def forward(self, x):
        return self.proj(x) @ self.shared[0].weight


def test_parameters_stay_on_the_device_even_another_modules():
    shared = torch.nn.Linear(8, 8)
    model = torch.nn.Sequential(shared, torch.nn.ModuleList([TiedLayer(shared), TiedLayer(shared)]))
    patch(model, "offload")
    ledger = host_ledger(model)
    ledger.begin(lambda: 0)
    x = torch.randn(4, 8)
    for layer in model[1]:
        x = layer(x)
    x.sum().backward()
    copies = ledger.end(1)
    assert set(copies["module"]) == {"1.0", "1.1"}
    assert set(copies["size"]) == {4 * 8 * 4}  # activations of 4 x 8; no 8 x 8 weight
