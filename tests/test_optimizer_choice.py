"""The step's optimizer choice (--optimizer, modes.OPTIMIZERS): the model file's AdamW rebuilt with its groups and
hyperparameters; the quantized updates agree with torch.optim.AdamW within the bound their blocks' rounding gives,
the host one to fp32 rounding; the traced state holds the layout's bytes, on real and fake tensors; the host
choice leaves none on the device; what cannot be converted is refused in one line."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch
from click.testing import CliRunner

from memplan.cli import main
from memplan.errors import MemplanError, PatchError
from memplan.modes import ADAMW_4BIT, ADAMW_8BIT, ADAMW_HOST, AS_BUILT, OPTIMIZERS
from memplan.planner.layers import choose_optimizer
from memplan.planner.layers.host_adamw import HostAdamW
from memplan.planner.layers.lowbit_adamw import LAYOUTS, LowBitAdamW
from memplan.planner.report.trace_text import render_trace
from memplan.step import StepSpec
from memplan.traces.inputs.trace_model import trace_step
from memplan.traces.summary import summarize

torch.set_num_threads(1)
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.1
STEPS = 5
# 8-bit: 1 byte an element, a 4-byte scale per block of 256 and a 256-entry fp32 map, per moment; 4-bit: half a
# byte, a scale per 128, a 16-entry map; a tensor under 4096 elements (or not a multiple of the block) whole.
BLOCK = {8: 256, 4: 128}
MODEL = """
import torch
from torch import nn

def build(batch_size, seq_len, dtype, device):
    model = nn.Sequential(nn.Embedding(256, 64), nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 256))
    ids = torch.randint(0, 256, (batch_size, seq_len), device=device)
    return {{"model": model, "inputs": ids, "optimizer": optimizer,
            "loss": lambda out, inp: nn.functional.cross_entropy(out.flatten(0, 1).float(), inp.flatten())}}

def optimizer(params):
    params = list(params)  # the model's, once on its device: decay on matrices only, biases slower
    decay, rest = [p for p in params if p.dim() > 1], [p for p in params if p.dim() == 1]
    groups = [{{"params": decay, "weight_decay": 0.1}}, {{"params": rest, "weight_decay": 0.0, "lr": 3e-4}}]
    return {optimizer}
"""


def model_file(tmp_path, optimizer: str = "torch.optim.AdamW(groups, lr=1e-3, betas=(0.8, 0.99), eps=1e-6)"):
    path = tmp_path / "lm.py"
    path.write_text(textwrap.dedent(MODEL.format(optimizer=optimizer)))
    return str(path)


def layout_bytes(numel: int, bits: int) -> int:
    """One parameter's state by the layout's arithmetic: two moments and the 4-byte step counter (fp32 model)."""
    block = BLOCK[bits]
    if numel < 4096 or numel % block:
        return 2 * 4 * numel + 4
    return 2 * (numel * bits // 8 + 4 * (numel // block) + 4 * 2**bits) + 4


SHAPES = {"embedding": (256, 64), "linear1": (128, 64), "bias1": (128,), "linear2": (256, 128), "bias2": (256,)}


def optimizer_bytes(trace) -> int:
    return sum(int(size) for size, category in zip(trace.size, trace.category, strict=True) if category == "optimizer")


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
@pytest.mark.parametrize("choice", [ADAMW_8BIT, ADAMW_4BIT])
def test_the_traced_state_holds_the_layouts_bytes(tmp_path, choice, fake):
    bits = {ADAMW_8BIT: 8, ADAMW_4BIT: 4}[choice]
    step = StepSpec(model_file(tmp_path), batch=2, seq=16, fake=fake, optimizer=choice)
    trace = trace_step(step)
    expected = sum(layout_bytes(math.prod(shape), bits) for shape in SHAPES.values())
    assert optimizer_bytes(trace) == expected
    report = trace.meta["optimizer_state"]
    assert report["device_bytes"] + 4 * len(SHAPES) == expected and report["host_bytes"] == 0
    assert report["built"] == "AdamW" and report["built_bytes"] == sum(8 * math.prod(s) for s in SHAPES.values())
    as_built = trace_step(step.replace(optimizer=AS_BUILT))
    assert optimizer_bytes(as_built) == report["built_bytes"] + 4 * len(SHAPES) > expected


def test_the_host_choice_leaves_no_state_on_the_device_and_states_the_hosts(tmp_path):
    step = StepSpec(model_file(tmp_path), batch=2, seq=16, fake=True, device="cuda", optimizer=ADAMW_HOST)
    trace = trace_step(step)
    assert optimizer_bytes(trace) == 0
    as_built = trace_step(step.replace(optimizer=AS_BUILT))
    assert optimizer_bytes(as_built) == trace.meta["optimizer_state"]["built_bytes"] > 0  # its step counters: CPU
    numel = sum(math.prod(shape) for shape in SHAPES.values())  # fp32 master, gradient and moments, a step each
    assert trace.meta["optimizer_state"]["host_bytes"] == 16 * numel + 4 * len(SHAPES)
    assert trace.meta["optimizer_state"]["device_bytes"] == 0
    text = render_trace(summarize(trace))
    assert "optimizer adamw-host: the model file's AdamW rebuilt over 5 parameters; state on the device 0 B" in text


def test_the_chosen_optimizer_keeps_the_groups_and_hyperparameters():
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
    groups = [{"params": [model[0].weight, model[1].weight]}, {"params": [model[0].bias], "lr": 3e-4, "eps": 1e-6}]
    built = torch.optim.AdamW(groups, lr=1e-3, betas=(0.8, 0.99), weight_decay=0.05)
    for choice in (ADAMW_8BIT, ADAMW_4BIT, ADAMW_HOST):
        chosen, report = choose_optimizer(built, choice)
        assert report.optimizer == choice and report.parameters == 3
        for old, new in zip(built.param_groups, chosen.param_groups, strict=True):
            assert [id(p) for p in old["params"]] == [id(p) for p in new["params"]]
            for key in ("lr", "betas", "eps", "weight_decay"):
                assert new[key] == old[key], (choice, key)
    assert choose_optimizer(built, AS_BUILT) == (built, None)
    amsgrad = torch.optim.AdamW(model.parameters(), amsgrad=True)  # the host steps AdamW itself: amsgrad and all
    assert choose_optimizer(amsgrad, ADAMW_HOST)[0].inner.param_groups[0]["amsgrad"]


def reference_and_chosen(choice_of, weight: torch.Tensor, grads: list[torch.Tensor]):
    """torch.optim.AdamW and the chosen optimizer stepped in lockstep on the same gradients: yields, per step, both
    parameters, both optimizers and the step number."""
    ref, mine = torch.nn.Parameter(weight.clone()), torch.nn.Parameter(weight.clone())
    reference = torch.optim.AdamW([ref], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    chosen, _ = choose_optimizer(torch.optim.AdamW([mine], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD), choice_of)
    for t, grad in enumerate(grads, start=1):
        ref.grad, mine.grad = grad.clone(), grad.clone()
        reference.step()
        chosen.step()
        yield ref, mine, reference, chosen, t


@pytest.mark.parametrize("choice", [ADAMW_8BIT, ADAMW_4BIT])
def test_the_quantized_update_agrees_with_adamw_within_its_blocks_rounding(choice):
    """The bound, carried step by step from the blocks' rounding: a moment rounds to within `max_error` times its
    block's scale; the lerp shrinks the carried error by beta; the update m/(sqrt(v)+eps) then differs by at most
    |dm|/c1/(s+eps) + |m|/c1 * sqrt(|dv|/c2) / ((s+eps)(s'+eps)); decoupled decay shrinks the parameter's error."""
    torch.manual_seed(0)
    bits = {ADAMW_8BIT: 8, ADAMW_4BIT: 4}[choice]
    layout = LAYOUTS[bits]
    shape = (64, 256)
    grads = [torch.randn(shape) * (1 + torch.rand(shape[1])) for _ in range(STEPS)]
    dm = dv = dp = torch.zeros(shape)
    for ref, mine, reference, chosen, t in reference_and_chosen(choice, torch.randn(shape), grads):
        m_ref, v_ref = reference.state[ref]["exp_avg"], reference.state[ref]["exp_avg_sq"]
        m, v = chosen.moments(mine)  # as quantized after the step
        c1, c2 = 1 - BETAS[0] ** t, 1 - BETAS[1] ** t
        # this step's moments before they are quantized, as the update used them: the carried error shrunk by beta
        dm_used, dv_used = BETAS[0] * dm, BETAS[1] * dv
        s_ref = v_ref.sqrt() / math.sqrt(c2) + EPS
        s_low = (v_ref - dv_used).clamp(min=0).sqrt() / math.sqrt(c2) + EPS
        du = dm_used / c1 / s_ref + (m_ref.abs() + dm_used) / c1 * (dv_used / c2).sqrt() / (s_ref * s_low)
        dp = (1 - LR * WD) * dp + LR * du
        slack = 1e-6 * (1 + ref.abs())  # fp32 rounding of two evaluation orders
        assert ((mine - ref).abs() <= dp + slack).all(), (t, ((mine - ref).abs() - dp).max())
        # then the moments are stored rounded: within max_error of their block's scale
        block_max = lambda x: x.view(-1, layout.block).abs().amax(-1, keepdim=True).expand(-1, layout.block)  # noqa: E731
        dm = dm_used + layout.max_error(True) * block_max(m_ref.abs() + dm_used).reshape(shape)
        dv = dv_used + layout.max_error(False) * block_max(v_ref + dv_used).reshape(shape)
        assert ((m - m_ref).abs() <= dm + 1e-6 * m_ref.abs().max()).all()
        assert ((v - v_ref).abs() <= dv + 1e-6 * v_ref.max()).all()
        if t == 1:  # from zero moments the first update is AdamW's itself: nothing rounded has been read yet
            torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-6)
        else:  # 8-bit's bound is a fraction of the update for most elements: an error of its size would fail it
            assert dp.median() < 0.25 * LR * t or bits == 4  # 4-bit's worst-case rounding bounds little


@pytest.mark.parametrize("choice", [ADAMW_8BIT, ADAMW_4BIT])
def test_each_step_is_adamws_on_the_stored_moments_which_round_within_a_block(choice):
    """Step by step, from the moments the chosen optimizer stored: AdamW given them (loaded into its state) moves the
    parameter as the chosen one does, to fp32 rounding, and the chosen one stores AdamW's new moments rounded, each
    within the map's largest rounding error times its block's scale."""
    torch.manual_seed(1)
    layout = LAYOUTS[{ADAMW_8BIT: 8, ADAMW_4BIT: 4}[choice]]
    shape = (32, 512)
    mine = torch.nn.Parameter(torch.randn(shape))
    chosen, _ = choose_optimizer(torch.optim.AdamW([mine], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD), choice)
    for t in range(1, STEPS + 1):
        grad = torch.randn(shape) * (1 + torch.rand(shape[1]))
        ref = torch.nn.Parameter(mine.detach().clone())
        reference = torch.optim.AdamW([ref], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        if t > 1:
            m, v = chosen.moments(mine)
            reference.state[ref] = {"step": torch.tensor(float(t - 1)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
        ref.grad, mine.grad = grad.clone(), grad.clone()
        reference.step()
        chosen.step()
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-6)
        m, v = chosen.moments(mine)
        for stored, exact, signed in ((m, reference.state[ref]["exp_avg"], True),
                                      (v, reference.state[ref]["exp_avg_sq"], False)):  # fmt: skip
            scale = exact.view(-1, layout.block).abs().amax(-1, keepdim=True)
            error = (stored - exact).abs().view(-1, layout.block)
            assert (error <= layout.max_error(signed) * scale * (1 + 1e-5)).all(), (t, signed)
            assert error.max() > 0  # rounded indeed: the moments are not kept whole


def test_the_host_update_is_adamws_to_fp32_rounding():
    torch.manual_seed(0)
    grads = [torch.randn(64, 96) for _ in range(STEPS)]
    for ref, mine, reference, chosen, _ in reference_and_chosen(ADAMW_HOST, torch.randn(64, 96), grads):
        assert isinstance(chosen, HostAdamW)
        torch.testing.assert_close(mine, ref, rtol=0, atol=0)
        torch.testing.assert_close(chosen.state[mine]["exp_avg_sq"], reference.state[ref]["exp_avg_sq"])


def test_adam_converts_with_its_coupled_weight_decay():
    torch.manual_seed(0)
    w, g = torch.randn(64, 128), torch.randn(64, 128)
    ref, mine = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    reference = torch.optim.Adam([ref], lr=LR, weight_decay=WD)
    chosen, _ = choose_optimizer(torch.optim.Adam([mine], lr=LR, weight_decay=WD), ADAMW_8BIT)
    assert isinstance(chosen, LowBitAdamW) and not chosen.decoupled
    ref.grad, mine.grad = g.clone(), g.clone()
    reference.step()
    chosen.step()
    torch.testing.assert_close(mine, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("optimizer", "message"),
    [
        ("torch.optim.SGD(groups, lr=0.1)", "the model file's optimizer is SGD; only AdamW and Adam convert"),
        ("torch.optim.AdamW(groups, amsgrad=True)", "the model file's AdamW is set with amsgrad=True"),
    ],
    ids=["sgd", "amsgrad"],
)
def test_what_cannot_be_converted_is_refused_in_one_line(tmp_path, optimizer, message):
    path = model_file(tmp_path, optimizer)
    with pytest.raises(PatchError, match=message) as error:
        trace_step(StepSpec(path, batch=1, seq=8, optimizer=ADAMW_4BIT))
    assert isinstance(error.value, MemplanError) and "\n" not in str(error.value)
    result = CliRunner().invoke(main, ["trace", path, "--seq", "8", "--optimizer", "adamw-8bit"])
    assert result.exit_code == 1
    assert result.output.splitlines()[-1].startswith(f"Error: --optimizer adamw-8bit: {message}")


def test_the_step_names_its_optimizer_as_it_names_its_loss():
    assert tuple(OPTIMIZERS) == (AS_BUILT, ADAMW_8BIT, ADAMW_4BIT, ADAMW_HOST)
    step = StepSpec("m.py", mode="tempo", loss="fused", optimizer=ADAMW_8BIT)
    assert step.name == "tempo.loss-fused.adamw-8bit" and step.replace(optimizer=AS_BUILT).name == "tempo.loss-fused"
    assert "--optimizer adamw-8bit" in step.arguments() and "optimizer adamw-8bit" in step.describe()
    with pytest.raises(PatchError, match="unknown optimizer 'adamw-2bit'; choose one of as-built, adamw-8bit"):
        step.replace(optimizer="adamw-2bit")
    for command in ("trace", "replay", "run", "fit", "tradeoff", "optimize"):
        help_text = CliRunner().invoke(main, [command, "--help"]).output
        assert "--optimizer [as-built|adamw-8bit|adamw-4bit|adamw-host]" in help_text, command
