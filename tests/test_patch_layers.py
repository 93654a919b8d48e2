"""Per-layer layer modes, `patch(model, {layer path: mode})`: gradients equal to the model as built, the bytes each
layer holds for backward, unpatch, and the errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from memplan.modes import check_layer_modes, describe_assignment
from memplan.planner.layers import (
    PER_LAYER_MODES,
    PatchError,
    hf_attention,
    patch,
    transformer_layers,
    unpatch,
)
from memplan.planner.layers.memory import held_for_backward
from memplan.planner.workloads import bert, gpt2, llama
from memplan.step import StepSpec
from memplan.traces.format import Trace
from memplan.traces.inputs.trace_model import trace_step
from memplan.traces.inputs.workload import Workload

pytest.importorskip("transformers")

import hf_models  # noqa: E402  (needs transformers)

GPT2_4 = gpt2.GPT2Config(layers=4)
WORKLOADS = {  # memplan's own models, tiny
    "bert": lambda: bert.build_workload(batch_size=2, seq_len=16),
    "gpt2": lambda: gpt2.build_workload(batch_size=2, seq_len=16, config=GPT2_4),
    "llama": lambda: llama.build_workload(batch_size=2, seq_len=16),
}
MIXED = {  # a mixed assignment per model, each leaving a layer as built where there are more than two
    "bert": {"layers.0": "tempo+full", "layers.1": "selective"},
    "gpt2": {"layers.0": "full", "layers.1": "tempo", "layers.2": "tempo+selective"},
    "llama": {"layers.0": "tempo", "layers.1": "full"},
    "t5": {"encoder.block.0": "tempo+selective", "decoder.block.0": "full", "decoder.block.1": "tempo"},
    "vit": {"vit.layers.1": "tempo+selective"},
    "hf-llama": {"model.layers.0": "tempo", "model.layers.1": "full"},
}
EAGER = {"vit"}  # built with HF's eager attention, so its as-built layer calls ViT's eager function through the
#                  dispatcher; T5 keeps SDPA (with dropout, on the CPU's math path: the same masks as memplan's cores)


def workload(name: str) -> Workload:
    """A training step of model `name` as built (ViT on HuggingFace's eager attention)."""
    if name in WORKLOADS:
        return WORKLOADS[name]()
    built = hf_models.workload(name.removeprefix("hf-"), "as-built")
    if name in EAGER:
        built.model.config._attn_implementation = "eager"
    return built


def gradients(name: str, modes) -> dict[str, torch.Tensor]:
    """The parameter gradients of one training step of model `name` patched with `modes` (seed 7: the same dropout
    masks in every run)."""
    step = workload(name)
    patch(step.model, modes)
    torch.manual_seed(7)
    step.loss_fn(step.forward(), step.inputs).backward()
    return {k: p.grad for k, p in step.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", MIXED)
def test_gradients_of_a_mixed_assignment_equal_the_model_as_built(name):
    built, mixed = gradients(name, "as-built"), gradients(name, MIXED[name])
    assert built.keys() == mixed.keys()
    for k in built:
        torch.testing.assert_close(mixed[k], built[k], rtol=1e-4, atol=1e-6)


def test_the_report_names_each_layer_and_what_stays_as_built():
    model = WORKLOADS["gpt2"]().model
    assert transformer_layers(model) == ["layers.0", "layers.1", "layers.2", "layers.3"]
    report = patch(model, MIXED["gpt2"])
    swaps = {(s.original, s.replacement, s.count) for s in report.swapped}
    assert swaps == {
        ("GPT2Layer", "checkpoint", 1),
        ("GELU", "InplaceGELU", 2),
        ("LayerNorm", "InplaceLayerNorm", 4),
        ("AttentionCore", "PatchedAttentionCore", 2),  # tempo's core and selective's
    }
    assert report.mode == "per-layer" and report.left_alone == ["GELU", "LayerNorm"] and not report.notes
    assert report.to_dict()["layers"] == MIXED["gpt2"]
    assert type(model.layers[3].ln1).__name__ == "LayerNorm" and type(model.ln_f).__name__ == "LayerNorm"
    assert type(model.layers[2].attention.core).__name__ == "PatchedAttentionCore"
    assert model.layers[2].attention.core.kind == "selective" and "forward" in vars(model.layers[0])
    assert "layers" not in patch(model, "tempo").to_dict()  # the uniform report's dict as it was


def test_hf_attention_of_layers_in_different_modes_dispatches_per_module():
    model = hf_models.build("t5")
    report = patch(model, MIXED["t5"])
    attention = [m for m in model.modules() if hf_attention.uses_registry(m)]
    choices = {m.__dict__.get(hf_attention.CHOICE) for m in attention}
    assert choices == {"memplan_selective", "memplan_baseline", "memplan_tempo", "sdpa"}
    assert {model.encoder.config._attn_implementation, model.decoder.config._attn_implementation} == {"memplan_layers"}
    assert report.count("T5Attention") == 5  # self-attention in the encoder's block 0, self and cross in the decoder's
    assert report.left_alone == ["NewGELUActivation", "T5Attention", "T5LayerNorm"]  # as-built and full blocks'


def test_hf_attention_keeping_no_square_tensor_is_not_switched_and_only_full_layers_checkpoint():
    model = hf_models.build("llama")
    report = patch(model, MIXED["hf-llama"])
    assert model.config._attn_implementation == "sdpa" and "nothing to recompute" in report.notes[0]
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [False, True]


def test_sdpa_layers_left_as_built_compute_as_built_under_the_dispatcher():
    """Llama with attention dropout keeps an s x s tensor on the CPU: its as-built layer calls SDPA, now with the
    eager mask; in eval mode (no dropout) every output is the model's as built."""
    model = hf_models.build("llama")
    for m in model.modules():
        if hf_attention.uses_registry(m):
            m.attention_dropout = 0.1
    ids = hf_models.inputs("llama")["input_ids"]
    with torch.no_grad():
        want = model.eval()(ids).logits
        patch(model.train(), {"model.layers.0": "selective"})
        assert model.model.layers[1].self_attn.__dict__[hf_attention.CHOICE] == "sdpa"
        torch.testing.assert_close(model.eval()(ids).logits, want, rtol=1e-5, atol=1e-5)


MODEL_FILE = """
from memplan.planner.workloads import gpt2


def build(batch_size, seq_len, dtype, device):
    return gpt2.build_workload(batch_size, seq_len, dtype, device, config=gpt2.GPT2Config(layers=4))
"""
SEQ = 32
LAYERS = ["layers.0", "layers.1", "layers.2", "layers.3"]


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """A function tracing a step of the 4-layer GPT-2 under a mode or {layer path: mode} (each traced once)."""
    path = tmp_path_factory.mktemp("models") / "gpt2_4.py"
    path.write_text(MODEL_FILE)
    traces: dict[str, Trace] = {}

    def trace(layers) -> Trace:
        step = StepSpec(path, batch=2, seq=SEQ, mode=layers)
        if step.mode_name not in traces:
            traces[step.mode_name] = trace_step(step)
        return traces[step.mode_name]

    return trace


def held_inside(trace: Trace, path: str) -> int:
    """Bytes the step holds for backward in buffers allocated inside the model's module `path`."""
    module = f"model.{path}"
    inside = np.array([m == module or m.startswith(module + ".") for m in trace.module])
    return held_for_backward(dataclasses.replace(trace, size=np.where(inside, trace.size, 0)))


def held_by_layer(trace: Trace) -> dict[str, int]:
    """Bytes held for backward per Transformer layer, and outside them ("")."""
    layers = {path: held_inside(trace, path) for path in LAYERS}
    return {**layers, "": held_for_backward(trace) - sum(layers.values())}


def test_a_mixed_assignment_holds_between_the_uniform_modes(traced):
    mixed = MIXED["gpt2"]
    assert describe_assignment(mixed) == "per-layer: layers.0 full, layers.1 tempo, layers.2 tempo+selective"
    trace = traced(mixed)
    assert trace.meta["layers"] == describe_assignment(mixed) and trace.meta["patch"]["layers"] == mixed
    held = {mode: held_for_backward(traced(mode)) for mode in ("as-built", "full")}
    assert held["full"] < held_for_backward(trace) < held["as-built"]


def test_full_on_one_layer_changes_only_that_layer(traced):
    built, one = held_by_layer(traced("as-built")), held_by_layer(traced({"layers.2": "full"}))
    assert all(one[path] == built[path] for path in ("layers.0", "layers.1", "layers.3"))
    assert one["layers.2"] < built["layers.2"] / 10
    assert one[""] - built[""] == SEQ * SEQ * 4  # the causal mask, an input the checkpointed layer keeps


@pytest.mark.parametrize("mode", [m for m in PER_LAYER_MODES if m != "as-built"])
def test_one_mode_on_every_layer_holds_what_the_uniform_mode_holds_inside_the_layers(traced, mode):
    uniform, every = (
        held_by_layer(traced(mode)),
        held_by_layer(traced(dict.fromkeys(LAYERS, mode))),
    )
    assert all(every[path] == uniform[path] for path in LAYERS[:-1])
    # The last layer's output is the final LayerNorm's input, which that LayerNorm (as built) keeps, tempo's not.
    assert every["layers.3"] - uniform["layers.3"] == (2 * SEQ * 64 * 4 if "tempo" in mode else 0)


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_unpatch_restores_the_model(name):
    model = workload(name).model
    modules = dict(model.named_modules())
    configs = {id(m.config): m.config for m in model.modules() if hf_attention.uses_registry(m)}.values()
    implementations = [c._attn_implementation for c in configs]
    patch(model, MIXED[name])
    assert unpatch(model) > 0
    assert dict(model.named_modules()) == modules and all(modules[k] is m for k, m in model.named_modules())
    assert [c._attn_implementation for c in configs] == implementations
    assert not any(
        hf_attention.CHOICE in vars(m) or "forward" in vars(m) or getattr(m, "gradient_checkpointing", False)
        for m in model.modules()
    )


def test_unpatch_gives_back_the_outputs_as_built():
    model = hf_models.build("t5").eval()
    inputs = hf_models.inputs("t5")
    with torch.no_grad():
        want = model(**inputs).logits
        patch(model.train(), MIXED["t5"])
        unpatch(model)
        torch.testing.assert_close(model.eval()(**inputs).logits, want, rtol=0, atol=0)


def test_bad_paths_and_modes_are_patch_errors():
    model = WORKLOADS["gpt2"]().model
    with pytest.raises(
        PatchError, match=r"'layers\.7' is not a Transformer layer of this model; its layers: layers\.0-3"
    ):
        patch(model, {"layers.7": "tempo"})
    with pytest.raises(PatchError, match="'baseline' is not a per-layer mode; choose one of as-built, tempo"):
        patch(model, {"layers.0": "baseline"})
    with pytest.raises(PatchError, match="'fast' is not a per-layer mode"):
        check_layer_modes({"layers.0": "fast"})
    with pytest.raises(PatchError, match="mode name or a {layer path: mode} mapping"):
        patch(model, ["layers.0"])
    with pytest.raises(PatchError, match="not a Transformer layer"):
        patch(model, {"h.0": "tempo"})
    assert not any(type(m).__name__.startswith("Inplace") for m in model.modules())  # nothing half-patched
