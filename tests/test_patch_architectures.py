"""Every causal LM the installed transformers ships, built tiny from its default config with eager attention
(hf_tiny.py): under tempo, which swaps only what a probe proves computes the same function, the loss, logits and
gradients equal the model as built, and no Transformer layer holds more for backward than as built."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_tiny import architectures, build, inputs, step  # noqa: E402  (needs transformers)
from lanes import some  # noqa: E402

from memplan.modes import FUSED  # noqa: E402
from memplan.planner.layers import patch, patch_loss, unpatch  # noqa: E402

FAST = (
    "llama",
    "qwen3",
    "gemma2",
    "gpt_oss",
    "olmo2",
    "phi3",
    "bert",
    "gpt2",
)  # the fast lane's sample


@pytest.mark.parametrize("kind", some(architectures(), fast=FAST))
def test_tempo_and_the_fused_loss_equal_the_model_as_built(kind):
    """One build per architecture for both sweeps: tempo holds no more per layer, and `--loss fused` is exact or
    says why it changes nothing."""
    torch.set_num_threads(1)
    try:
        model = build(kind, attention="eager")
        reference = step(model)
    except Exception as error:  # noqa: BLE001 - the model itself does not run at the sweep's sizes
        pytest.skip(f"{kind} does not run as built at the sweep's sizes: {type(error).__name__}: {error}"[:300])
    # 1. Tempo: the same function (loss, logits, every gradient), and no layer holds more for backward.
    report = patch(model, "tempo")
    loss, logits, gradients, held = step(model)
    torch.testing.assert_close(loss, reference[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, reference[1], rtol=1e-4, atol=1e-5 * reference[1].abs().max().item())
    assert_same_gradients(gradients, reference[2], f"{kind} under tempo; {report}")
    raised = {path: (reference[3].get(path, 0), n) for path, n in held.items() if n > reference[3].get(path, 0)}
    assert not raised, f"{kind}: tempo holds more in {raised}; {report}"
    unpatch(model)
    # 2. The fused loss: the same loss and gradients, its one call, or the note saying why it changes nothing.
    loss_report = patch_loss(model, FUSED)
    if not loss_report.patched:
        (note,) = loss_report.notes
        assert note.startswith("--loss fused changes nothing in this model: ")
        return
    loss, _, gradients, _ = step(model)
    assert loss_report.use.calls == 1
    torch.testing.assert_close(loss, reference[0], rtol=1e-5, atol=1e-6)
    assert_same_gradients(gradients, reference[2], f"{kind} with the fused loss")


def assert_same_gradients(got: dict, want: dict, what: str) -> None:
    """The same parameters have gradients, each within 1e-4 of the largest gradient's magnitude."""
    assert got.keys() == want.keys(), what
    scale = max(g.abs().max().item() for g in want.values())
    worst = max((got[k] - g).abs().max().item() for k, g in want.items())
    assert worst <= 1e-4 * scale, f"gradients differ by {worst / scale:.2e} of their scale: {what}"


@pytest.mark.parametrize(
    "kind, note",
    [
        ("mamba", "InplaceSiLU never called in the step"),  # its mixer calls F.silu, not its activation module
        ("phi3", "InplaceSiLU kept its input in every call"),  # the gate is half of a fused gate-and-up projection
    ],
)
def test_the_traced_report_says_which_swaps_saved_nothing(kind, note):
    from memplan.traces.capture import capture_step

    torch.set_num_threads(1)
    notes = capture_step(lambda: workload_of(kind)).meta["patch"]["notes"]
    assert any(note in n for n in notes), notes
    assert not any("saves nothing" in n for n in capture_step(lambda: workload_of("llama")).meta["patch"]["notes"])


def workload_of(kind: str):
    """`kind` tiny under tempo as a Workload with its patch report."""
    from memplan.traces.inputs.workload import Workload

    model = build(kind)
    report = patch(model, "tempo")
    optimizer = torch.optim.AdamW(model.parameters())
    return Workload(model, inputs(), optimizer, lambda out, _: out.loss, kind, report.to_dict())
