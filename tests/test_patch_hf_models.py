"""The layer modes on HuggingFace models built from tiny configs (Llama, Mistral, Qwen2, GPT-NeoX, ViT, T5):
what the report says, what each mode holds for backward, and gradients equal to the model as built."""

from __future__ import annotations

import pytest
import torch

from memplan.planner.layers import MODES, hf_attention, patch, unpatch
from memplan.planner.layers.memory import held_for_backward
from memplan.traces.capture import capture_step

pytest.importorskip("transformers")

from hf_models import MODELS, build, loss, workload  # noqa: E402  (needs transformers)
from lanes import some  # noqa: E402

SWAPS = {  # tempo's swaps per model: (original type, replacement, count)
    "llama": {("LlamaRMSNorm", "InplaceRMSNorm", 5), ("LlamaMLP", "GatedMLP", 2)},
    "mistral": {("MistralRMSNorm", "InplaceRMSNorm", 5), ("MistralMLP", "GatedMLP", 2)},
    "qwen2": {("Qwen2RMSNorm", "InplaceRMSNorm", 5), ("Qwen2MLP", "GatedMLP", 2)},
    "gpt-neox": {("LayerNorm", "InplaceLayerNorm", 5), ("GELUActivation", "InplaceGELU", 2)},
    "vit": {("LayerNorm", "InplaceLayerNorm", 5), ("GELUActivation", "InplaceGELU", 2)},
    "t5": {("T5LayerNorm", "InplaceRMSNorm", 12), ("T5DenseGatedActDense", "GatedMLP", 4)},
}
ATTENTION = {"llama": "LlamaAttention", "mistral": "MistralAttention", "qwen2": "Qwen2Attention"}
ATTENTION["gpt-neox"] = "GPTNeoXAttention"
SQUARE = {"vit", "t5"}  # attention that keeps an s x s tensor here: ViT (SDPA with dropout on the CPU), T5 (eager)


@pytest.mark.parametrize("name", MODELS)
def test_the_report_lists_the_swaps_and_what_was_left(name):
    model = build(name)
    report = patch(model, "tempo")
    swaps = {(s.original, s.replacement, s.count) for s in report.swapped}
    assert SWAPS[name] <= swaps, report
    assert report.changed and report.left_alone == ([] if name in SQUARE else [ATTENTION[name]])
    attention = [s for s in report.swapped if s.replacement.endswith("attention")]
    if name in SQUARE:
        assert attention and attention[0].replacement == "memplan_tempo attention"
    else:
        assert not attention and "nothing to recompute" in report.notes[0]
    assert patch(model, "as-built").swapped == []
    assert unpatch(model) == 0  # as-built patched nothing
    checkpointed = [s for s in patch(model, "full").swapped if s.replacement == "checkpoint"]
    assert sum(s.count for s in checkpointed) == 2 * (1 + (name == "t5"))  # T5: encoder and decoder blocks
    unpatch(model)
    assert not any(getattr(m, "gradient_checkpointing", False) or "forward" in vars(m) for m in model.modules())


@pytest.mark.parametrize("name", MODELS)
def test_selective_recomputes_only_where_an_s_by_s_tensor_exists(name):
    model = build(name)
    report = patch(model, "selective")
    attention = [s for s in report.swapped if s.replacement.endswith("attention")]
    if name in SQUARE:
        assert attention and attention[0].replacement == "memplan_selective attention"
        attention_modules = [m for m in model.modules() if hf_attention.uses_registry(m)]
        implementations = {m.config._attn_implementation for m in attention_modules}
        assert implementations == {"memplan_selective"}  # every config: T5's encoder and decoder have one each
        unpatch(model)
        assert "memplan_selective" not in {m.config._attn_implementation for m in attention_modules}
    else:
        assert not report.changed and report.notes and "nothing to recompute" in report.notes[0]


def held(name: str, mode: str, layers: int) -> int:
    """Bytes the traced step holds from forward into backward, with `layers` layers (a step with no warm-up before it:
    what a layer keeps for backward is its forward's, made anew each step; every case measured the same with one)."""
    return held_for_backward(capture_step(lambda: workload(name, mode, layers), warmup=False))


@pytest.mark.parametrize("name", some(MODELS, fast=("llama", "t5")))  # fast lane: a decoder, an encoder-decoder
def test_tempo_and_selective_hold_less_per_layer_than_baseline(name):
    per_layer = {mode: held(name, mode, 2) - held(name, mode, 1) for mode in ("baseline", "tempo", "selective")}
    assert per_layer["tempo"] < per_layer["baseline"]
    if name in SQUARE:
        assert per_layer["selective"] < per_layer["baseline"]
    else:
        assert per_layer["selective"] == per_layer["baseline"]


@pytest.mark.parametrize("mode", [m for m in MODES if m != "as-built"])
@pytest.mark.parametrize("name", MODELS)
def test_gradients_equal_the_model_as_built(name, mode):
    grads = []
    for m in ("as-built", mode):
        model = build(name)
        if name in SQUARE:
            model.config._attn_implementation = "eager"  # the reference: HF's own written-out attention
        patch(model, m)
        torch.manual_seed(7)
        loss(model, name).backward()
        grads.append({k: p.grad for k, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-4, atol=1e-6)


def test_trace_keeps_and_prints_what_the_mode_changed(tmp_path):
    import json

    from click.testing import CliRunner

    from memplan.cli import main
    from memplan.planner.report.memory_report import trace_title
    from memplan.traces.format import load

    out = tmp_path / "llama.selective.json.gz"
    args = ["trace", "examples/hf_llama.py", "--layers", "selective", "--seq", "16", "-o", str(out)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "layers selective changes nothing in this model" in r.stdout
    assert "nothing to recompute" in r.stdout
    trace = load(out)
    assert trace.meta["patch"]["mode"] == "selective" and not trace.meta["patch"]["changed"]
    assert trace_title(trace, str(out)).endswith("selective (changes nothing)")
    r = CliRunner().invoke(main, ["trace", "examples/hf_llama.py", "--seq", "16", "-o", str(out), "--json"])
    summary = json.loads(r.stdout)
    assert summary["layers"] == "as-built" and summary["patch"]["swapped"] == []
