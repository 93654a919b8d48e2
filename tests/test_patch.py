"""patch/unpatch on the bundled workloads and on HuggingFace BertModel/GPT2Model: same outputs, same weights,
reversible."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

from memplan.planner.layers import MODES, PatchError, patch, unpatch
from memplan.planner.layers.memory import LayerShape, saved_bytes
from memplan.planner.workloads import bert, gpt2

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def hf_bert(layers=2):
    torch.manual_seed(0)
    return transformers.BertModel(
        transformers.BertConfig(
            vocab_size=300, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=256
        )
    )


def hf_gpt2(layers=2):
    torch.manual_seed(0)
    return transformers.GPT2Model(
        transformers.GPT2Config(
            vocab_size=300, n_embd=64, n_layer=layers, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0
        )
    )


def ours_bert():
    return bert.build_workload(batch_size=2, seq_len=16).model


def ours_gpt2():
    return gpt2.build_workload(batch_size=2, seq_len=16).model


def forward(model, ids):
    out = model(ids, use_cache=False) if isinstance(model, transformers.GPT2Model) else model(ids)
    return out if isinstance(out, torch.Tensor) else out.last_hidden_state


LAYER_TYPES = {"bert": "BertLayer", "gpt2": "GPT2Layer", "hf-bert": "BertLayer", "hf-gpt2": "GPT2Block"}
BUILDERS = {"bert": ours_bert, "gpt2": ours_gpt2, "hf-bert": hf_bert, "hf-gpt2": hf_gpt2}
GELUS_AND_LAYERNORMS = {
    "bert": (3, 6),
    "gpt2": (2, 5),
    "hf-bert": (2, 5),
    "hf-gpt2": (2, 5),
}  # ours have an MLM head / none


@pytest.mark.parametrize("name", BUILDERS)
def test_eval_outputs_and_weights_unchanged_and_unpatch_restores(name):
    model = BUILDERS[name]().eval()
    with torch.no_grad():  # no LayerNorm at weight 1 and bias 0: a patch that re-initialises them shows
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    ids = torch.randint(1, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = {k: id(p) for k, p in model.named_parameters()}
    modules = {k: m for k, m in model.named_modules()}
    with torch.no_grad():
        want = forward(model, ids)
    reports = {}
    for mode in MODES:
        reports[mode] = patch(model, mode)
        # memplan's own workloads are built with baseline's layers (1-byte dropout masks, attention written out)
        changes = mode != "as-built" and (mode != "baseline" or name.startswith("hf"))
        assert reports[mode].mode == mode and reports[mode].changed == changes
        assert {k: id(p) for k, p in model.named_parameters()} == params
        with torch.no_grad():
            torch.testing.assert_close(forward(model, ids), want, rtol=1e-5, atol=1e-5)
    tempo = reports["tempo"]
    gelus = sum(s.count for s in tempo.swapped if "GELU" in s.original)
    assert (gelus, tempo.count("LayerNorm")) == GELUS_AND_LAYERNORMS[name]
    # BERT's pooler; in eval HuggingFace's SDPA attention keeps no s x s tensor, so it stays as built
    assert set(tempo.left_alone) - {"Tanh"} <= {"BertSelfAttention", "GPT2Attention"}
    assert "LayerNorm" in reports["as-built"].left_alone
    assert reports["full"].count(LAYER_TYPES[name]) == 2 and reports["tempo+full"].count(LAYER_TYPES[name]) == 2
    unpatch(model)
    assert all(modules[k] is m for k, m in model.named_modules())
    assert set(before) == set(model.state_dict())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_hf_attention_setting_restored():
    model = hf_bert()
    original = model.config._attn_implementation
    patch(model, "tempo+selective")
    assert model.config._attn_implementation == "memplan_selective"
    assert unpatch(model) > 0
    assert model.config._attn_implementation == original
    assert unpatch(model) == 0


@pytest.mark.parametrize("mode", MODES)
def test_hf_bert_training_matches_unpatched_eager_with_the_same_dropout_masks(mode):
    ids = torch.randint(1, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    grads = []
    for m in (None, mode):
        model = hf_bert().train()
        model.config._attn_implementation = "eager"  # HF's own explicit attention with F.dropout
        if m is not None:
            patch(model, m)
        torch.manual_seed(7)
        forward(model, ids).square().mean().backward()
        grads.append({k: p.grad for k, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("builder", [hf_bert, hf_gpt2], ids=["hf-bert", "hf-gpt2"])
@pytest.mark.parametrize("mode", ["baseline", "tempo", "selective", "tempo+selective"])
def test_hf_layer_holds_formula_bytes(builder, mode):
    ids = torch.randint(1, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    held = []
    for layers in (1, 2):
        model = builder(layers).train()
        patch(model, mode)
        held.append(saved_bytes(model, lambda model=model: forward(model, ids)))
    formula = LayerShape(s=16, b=2, h=64, a=4, p=4).formula(mode)
    if builder is hf_gpt2 and not mode.startswith("tempo"):
        formula += 3 * 16 * 2 * 4 * 64 * 4  # HF's NewGELU is written out: it also keeps 0.5x, tanh(u) and 1 + tanh(u)
    assert abs(held[1] - held[0] - formula) <= 0.02 * formula


@pytest.mark.parametrize("file", ["hf_bert.py", "hf_gpt2.py"])
def test_model_files_are_patched_for_baseline_too(file):
    """`--layers baseline` traces memplan's reference layers (1-byte dropout masks, attention written out),
    so baseline and tempo differ only in what tempo saves."""
    from memplan.step import StepSpec
    from memplan.traces.inputs.model_file import load_workload

    path = Path(__file__).resolve().parents[1] / "examples" / file
    w = load_workload(StepSpec(path, batch=2, seq=16, mode="baseline"))
    assert not any(type(m) is nn.Dropout for m in w.model.modules())
    assert w.model.config._attn_implementation == "memplan_baseline"


def test_unknown_types_left_alone_and_listed():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.MultiheadAttention(8, 2), nn.GELU(), nn.Dropout(0.1))
    relu, mha = model[1], model[2]
    report = patch(model, "tempo")
    assert report.left_alone == ["MultiheadAttention", "ReLU"]
    assert [(s.original, s.replacement, s.count) for s in report.swapped] == [
        ("Dropout", "Dropout", 1),
        ("GELU", "InplaceGELU", 1),
    ]
    assert model[1] is relu and model[2] is mha


def test_a_mode_that_changes_nothing_says_so():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    for mode in MODES:
        report = patch(model, mode)
        assert not report.changed and report.left_alone == ["BatchNorm2d", "ReLU"]
    assert patch(model, "full").notes == ["full: no list of Transformer layers found, nothing checkpointed"]
    assert patch(model, "offload").notes == ["offload: no list of Transformer layers found, nothing offloaded"]
    assert patch(model, "selective").notes[0].startswith("selective: nothing to recompute")


def test_bad_mode_is_a_memplan_error():
    with pytest.raises(PatchError, match="unknown layers mode"):
        patch(nn.Linear(2, 2), "fast")


def test_patching_twice_replaces_the_first_patch():
    model = ours_bert()
    patch(model, "tempo")
    report = patch(model, "selective")
    assert [(s.original, s.count) for s in report.swapped] == [("AttentionCore", 2)]
    assert sum(type(m) is nn.LayerNorm for m in model.modules()) == 6
    assert report.to_dict() == {**dataclasses.asdict(report), "changed": True}


def test_hf_features_the_cores_do_not_have_are_refused():
    model = transformers.GPT2Model(
        transformers.GPT2Config(
            vocab_size=300, n_embd=64, n_layer=1, n_head=4, n_positions=64, reorder_and_upcast_attn=True
        )
    )
    with pytest.raises(PatchError, match="reorder_and_upcast_attn"):
        patch(model, "tempo")
    assert not any(type(m).__name__ == "InplaceGELU" for m in model.modules())  # nothing half-patched
