"""Fake `Module.to` (and every Module._apply: `.cuda`, `.half`, ...) converts a model as PyTorch converts real tensors:
which objects stay, which attributes and gradient hooks come along, under each of torch.__future__'s flags, so a
program that builds its optimizer before `model.to("cuda")` keeps its optimizer state in a fake step."""

from __future__ import annotations

import contextlib

import pytest
import torch
from step_traces import bytes_by_category
from torch import nn

import memplan
from memplan.traces.capture import recording_session
from memplan.traces.fake.mode import module_to


class HandAdamW(torch.optim.Optimizer):
    """AdamW as a course's handout writes it: state made lazily in the first step, keyed by the parameter object."""

    def __init__(self, params, lr: float = 1e-3):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                state["m"].mul_(0.9).add_(p.grad)
                state["v"].mul_(0.99).addcmul_(p.grad, p.grad)
                p.sub_(group["lr"] * state["m"] / (state["v"].sqrt() + 1e-8))


class Tied(nn.Module):
    """A model with what `.to` treats apart: a tied weight, a buffer shared by two modules, an integer buffer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.LayerNorm(8)
        scale = torch.ones(8)
        self.register_buffer("scale", scale)
        self.norm.register_buffer("scale", scale)
        self.register_buffer("steps", torch.zeros(1, dtype=torch.long))

    def forward(self, ids):
        return self.head(self.norm(self.embed(ids)) * self.scale)


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer slot of `model`, shared ones under each of their names."""
    return {
        f"{path}.{name}": t
        for path, module in model.named_modules()
        for table in (module._parameters, module._buffers)
        for name, t in table.items()
        if t is not None
    }


def _moved(to) -> dict:
    """What one conversion `to(model)` does to a small model that has trained a step: for each slot, whether its
    object and its gradient's stay, whether the program's attribute and gradient hook come along, and which slots
    share a tensor afterwards."""
    model = Tied()
    model.embed.weight.flagged = True
    fired = []
    model.embed.weight.register_hook(lambda grad: fired.append(1))
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    before = _tensors(model)
    grads = {name: t.grad for name, t in before.items()}
    to(model)
    after = _tensors(model)
    ids = {name: id(t) for name, t in after.items()}
    model(torch.tensor([[1, 2, 3]], device=model.embed.weight.device)).float().sum().backward()
    return {
        "kept": {name: after[name] is t for name, t in before.items()},
        "grad kept": {name: after[name].grad is g for name, g in grads.items() if g is not None},
        "flagged": getattr(model.embed.weight, "flagged", False),
        "hook fired": len(fired),
        "shared": sorted(a for a in ids for b in ids if a < b and ids[a] == ids[b]),
        "dtype": str(model.embed.weight.dtype),
    }


@contextlib.contextmanager
def _future(swap: bool = False, overwrite: bool = False):
    """torch.__future__'s two conversion flags for the block."""
    future = torch.__future__
    before = future.get_swap_module_params_on_conversion(), future.get_overwrite_module_params_on_conversion()
    future.set_swap_module_params_on_conversion(swap)
    future.set_overwrite_module_params_on_conversion(overwrite)
    try:
        yield
    finally:
        future.set_swap_module_params_on_conversion(before[0])
        future.set_overwrite_module_params_on_conversion(before[1])


CONVERSIONS = {
    "to float64": lambda m: m.to(torch.float64),
    "double": lambda m: m.double(),
    "to float32 (no change)": lambda m: m.to(torch.float32),
    "module_to float64": lambda m: module_to(m, dtype=torch.float64),
}


@pytest.mark.parametrize("flags", [{}, {"overwrite": True}, {"swap": True}], ids=["default", "overwrite", "swap"])
@pytest.mark.parametrize("conversion", list(CONVERSIONS))
def test_fake_conversion_keeps_and_replaces_what_pytorchs_does_for_real_tensors(conversion, flags):
    to = CONVERSIONS[conversion]
    with _future(**flags):
        real = _moved(to)
        with recording_session(fake=True):
            fake = _moved(to)
    assert fake == real
    if not flags:  # PyTorch's default: parameters and gradients stay, buffers are replaced when converted
        assert all(real["kept"][name] for name in real["kept"] if "weight" in name or "bias" in name)
        assert real["flagged"] and real["hook fired"] == 2


def test_a_move_to_fake_cuda_keeps_every_parameter_object_and_what_the_program_attached():
    """Dense CPU and CUDA tensors are of one kind, so PyTorch sets `param.data`: the objects, their gradients,
    attributes and hooks stay; buffers move as copies (the shared one twice, as PyTorch converts it per module)."""
    real = _moved(lambda m: m.to(torch.float64))
    with recording_session("cuda", fake=True):
        fake = _moved(lambda m: m.to("cuda"))
        weight = nn.Linear(2, 2).cuda().weight
    assert weight.device.type == "cuda"
    assert fake["kept"] == {name: name.endswith(("weight", "bias")) for name in fake["kept"]}  # every buffer moved
    assert {**fake, "kept": None, "dtype": None} == {**real, "kept": None, "dtype": None}


def test_a_move_to_the_meta_device_makes_new_parameters_as_pytorch_does():
    """Meta tensors are another kind than CPU ones: PyTorch replaces each parameter (and fake tensors could not take
    the meta storage in place anyway)."""
    model = nn.Linear(2, 2)
    weight = model.weight
    model.to("meta")
    with recording_session(fake=True):
        fake_model = nn.Linear(2, 2)
        fake_weight = fake_model.weight
        fake_model.to("meta")
    assert (fake_model.weight is fake_weight) == (model.weight is weight) is False
    assert fake_model.weight.device.type == "meta"


def _optimizer_first(device: str) -> dict:
    """Optimizer, gradient and parameter bytes of a step whose program builds its optimizer before moving the model
    to `device`."""
    with memplan.record(fake=True, device=device) as recording:
        model = nn.Sequential(nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 8))
        optimizer = HandAdamW(model.parameters())
        model.to(device)
        x = torch.randn(4, 64, device=device)
        with recording.step(model, optimizer):
            model(x).sum().backward()
            optimizer.step()
    totals = bytes_by_category(recording.trace)
    return {category: totals[category] for category in ("optimizer", "gradient", "parameter")}


def test_an_optimizer_built_before_the_move_to_fake_cuda_keeps_its_state():
    """The issue's CS336 programs: the optimizer made on the CPU model, then `model.to("cuda")`: fake CUDA holds the
    same optimizer state as fake CPU (it held none when the move made new parameters)."""
    on_cpu, on_cuda = _optimizer_first("cpu"), _optimizer_first("cuda")
    params = 64 * 128 + 128 + 2 * 128 + 128 * 8 + 8
    assert on_cpu == on_cuda == {"optimizer": 2 * 4 * params, "gradient": 4 * params, "parameter": 4 * params}
