"""The fused linear cross-entropy (planner/layers/fused_loss.py and loss_patch.py, `--loss fused`): the loss and
gradients of the unfused head and cross-entropy it replaces (fp32, bf16 and bf16 autocast; ignore_index labels;
num_items_in_batch), on the function, a tiny HuggingFace Llama, memplan's GPT-2 and Llama and every causal LM of the
installed transformers; its bytes against memory.LossShape's formulas; a vocabulary-heavy step's peak below the
unfused one's by at least the logits; fake traces; the note where it cannot apply; the command line."""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from lanes import named
from torch import nn
from torch.nn import functional as F

from memplan.cli import main
from memplan.errors import PatchError
from memplan.modes import AS_BUILT, FUSED
from memplan.planner.layers import linear_cross_entropy, patch_loss, unpatch_loss
from memplan.planner.layers.fused_loss import CHUNKS, chunk_sizes
from memplan.planner.layers.memory import LossShape, loss_bytes
from memplan.planner.workloads import bert, gpt2, llama
from memplan.planner.workloads.lm_head import head_workload
from memplan.step import StepError, StepSpec
from memplan.traces.capture import capture_step
from memplan.traces.inputs.trace_model import trace_step

PRECISIONS = {  # name -> (parameters' dtype, autocast dtype)
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "bf16-mixed": (torch.float32, torch.bfloat16),
}
VOCAB, HIDDEN, SEQ = 32000, 64, 256  # the vocabulary-heavy step: logits 500x the hidden states
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def autocast(precision: str):
    """torch.autocast on the CPU in the precision's autocast dtype, or off."""
    dtype = PRECISIONS[precision][1]
    return torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def assert_same(got: torch.Tensor, want: torch.Tensor, precision: str, what: str) -> None:
    """Equal within the layer tests' tolerances: 1e-5 in fp32, bf16's 2^-7 when anything runs in bf16."""
    scale = want.float().abs().max().item()
    fp32 = precision == "fp32"
    torch.testing.assert_close(
        got.float(), want.float(), rtol=1e-5 if fp32 else 2**-7, atol=(1e-6 if fp32 else 2**-7) * scale, msg=what
    )


def loss_and_gradients(model: nn.Module, run) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """run(model)'s loss and every parameter's gradient, from a fixed seed (dropout draws alike)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    loss = run(model)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_step(got, want, precision: str) -> None:
    assert_same(got[0], want[0], precision, "loss")
    assert got[1].keys() == want[1].keys()
    for name, grad in want[1].items():
        assert_same(got[1][name], grad, precision, name)


# 1. The function.


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("items", [None, 30], ids=["mean", "num_items_in_batch"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_the_fused_loss_and_gradients_equal_the_unfused(precision, items, bias):
    torch.set_num_threads(1)
    dtype = PRECISIONS[precision][0]
    n, h, v = 37, 16, 203  # several chunks of rows (2 rows) and blocks of the vocabulary (16 columns)
    assert chunk_sizes(n, h, v) == (2, 16)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=generator).to(dtype).requires_grad_()
    weight = (0.3 * torch.randn(v, h, generator=generator)).to(dtype).requires_grad_()
    b = torch.randn(v, generator=generator).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(0, v, (n,), generator=generator)
    labels[::5] = -100
    inputs = [t for t in (hidden, weight, b) if t is not None]

    def unfused():
        loss = F.cross_entropy(
            F.linear(hidden, weight, b).float(), labels, reduction="mean" if items is None else "sum"
        )
        return loss if items is None else loss / items

    results = []
    for run in (unfused, lambda: linear_cross_entropy(hidden, weight, b, labels, num_items_in_batch=items)):
        with autocast(precision):
            loss = run()
        (0.5 * loss).backward()  # an incoming gradient other than 1 scales the saved ones
        results.append([loss.detach(), *(t.grad for t in inputs)])
        for t in inputs:
            t.grad = None
    for got, want, what in zip(results[1], results[0], ["loss", "hidden", "weight", "bias"]):
        assert got.dtype == want.dtype
        assert_same(got, want, precision, what)


def test_a_frozen_head_gets_no_gradient_and_backward_runs_once():
    hidden = torch.randn(8, 4, requires_grad=True)
    weight = torch.randn(50, 4)  # frozen: the vocabulary pass is skipped
    labels = torch.randint(0, 50, (8,))
    loss = linear_cross_entropy(hidden, weight, None, labels)
    loss.backward(retain_graph=True)
    assert hidden.grad is not None and weight.grad is None
    with pytest.raises(RuntimeError, match="once"):
        loss.backward()
    with torch.no_grad():  # an evaluation loss: the same value (and no gradient computed)
        evaluated = linear_cross_entropy(hidden, weight, None, labels)
    torch.testing.assert_close(evaluated, F.cross_entropy(hidden.detach() @ weight.T, labels))


def test_chunks_hold_at_most_the_hidden_states_or_a_sixteenth_of_the_logits():
    for n, h, v in [(8192, 4096, 128256), (256, 64, 32000), (37, 16, 203), (5, 64, 100), (1, 8, 7)]:
        rows, columns = chunk_sizes(n, h, v)
        budget = max(n * h, -(-n * v // CHUNKS))
        assert 1 <= rows <= n and 1 <= columns <= v
        assert rows * v <= max(budget, v) and n * columns <= max(budget, n)
        assert -(-n // rows) <= 2 * CHUNKS and -(-v // columns) <= 2 * CHUNKS  # rounding down: at most twice


# 2. Whole models: HuggingFace's Llama, memplan's decoders, every causal LM of transformers.


def hf_llama(dtype: torch.dtype, vocab: int = 300) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype).train()


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("items", [None, 30], ids=["mean", "num_items_in_batch"])
def test_a_huggingface_llama_trains_the_same_with_the_fused_loss(precision, items):
    torch.set_num_threads(1)
    model = hf_llama(PRECISIONS[precision][0])
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt without a loss
    extra = {} if items is None else {"num_items_in_batch": torch.tensor(items)}

    def run(m):
        with autocast(precision):
            return m(input_ids=ids, labels=labels, **extra).loss

    reference = loss_and_gradients(model, run)
    report = patch_loss(model, FUSED)
    assert (
        report.patched and report.replaced == "LlamaForCausalLM.lm_head + ForCausalLMLoss -> fused linear cross-entropy"
    )
    assert_same_step(loss_and_gradients(model, run), reference, precision)
    assert report.use.calls == 1 and report.use.tokens == 48
    assert model(input_ids=ids, labels=labels).logits is None  # the logits never existed
    assert model(input_ids=ids).logits.shape == (2, 24, 300)  # without labels: the head as built
    unpatch_loss(model)
    assert "forward" not in vars(model) and "forward" not in vars(model.lm_head)
    assert model(input_ids=ids, labels=labels).logits.shape == (2, 24, 300)


@pytest.mark.parametrize("module", [gpt2, llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_memplan_decoders_train_the_same_with_the_fused_loss(module, precision):
    torch.set_num_threads(1)
    workload = module.build_workload(
        2, 24, PRECISIONS[precision][0], config=dataclasses.replace(module.TINY, vocab_size=300)
    )
    workload.loss_fn.labels = workload.loss_fn.labels.clone()  # not a view of the inputs
    workload.loss_fn.labels[0, :5] = -100

    def run(m):
        with autocast(precision):
            return workload.loss_fn(m(*workload.inputs), workload.inputs)

    reference = loss_and_gradients(workload.model, run)
    report = patch_loss(workload.model, FUSED, workload.loss_fn)
    assert report.patched and report.replaced.endswith("head + TokenLoss -> fused linear cross-entropy")
    assert_same_step(loss_and_gradients(workload.model, run), reference, precision)
    assert report.use.calls == 1
    with pytest.raises(PatchError, match="patched already"):
        patch_loss(workload.model, FUSED, workload.loss_fn)


def test_where_it_cannot_apply_it_says_why():
    transformers = pytest.importorskip("transformers")
    assert patch_loss(hf_llama(torch.float32), AS_BUILT).to_dict()["notes"] == []
    headless = transformers.GPT2Model(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=100))
    (note,) = patch_loss(headless, FUSED).notes
    assert (
        note == "--loss fused changes nothing in this model: it has no language-model head (no get_output_embeddings())"
    )
    masked = bert.build_workload()  # memplan's BERT: its head is F.linear on the embedding, no module
    assert "no language-model head" in patch_loss(masked.model, FUSED, masked.loss_fn).notes[0]
    decoder = llama.build_workload()
    (note,) = patch_loss(decoder.model, FUSED, loss_fn=lambda out, inputs: out.float().mean()).notes
    assert note.endswith("its loss is not memplan's TokenLoss on its head's output")


# 3. Bytes: the formulas, and the step's peak.


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape", [(256, 64, 4000), (64, 128, 3000), (1000, 16, 5000)], ids=str)
def test_the_loss_holds_what_its_formula_says(precision, shape):
    torch.set_num_threads(1)
    n, h, v = shape
    dtype, cast = PRECISIONS[precision]
    measured = {
        loss: loss_bytes(capture_step(lambda loss=loss: head_workload(n, h, v, dtype, cast, loss)))
        for loss in (AS_BUILT, FUSED)
    }
    p, pw = (2 if cast or dtype == torch.bfloat16 else 4), torch.finfo(dtype).bits // 8
    shape = LossShape(n, h, v, p, pw, pw)
    # As built: log-softmax's backward holds the logits and three fp32 tensors of their size (a head wider than
    # its vocabulary may peak at its own backward instead: within 2%).
    assert shape.unfused() <= measured[AS_BUILT] <= 1.02 * shape.unfused()
    # Fused: its gradients and one block of logits; the formula's 34 bytes a token are 18 to 34 when measured.
    assert shape.fused() - 16 * n <= measured[FUSED] <= shape.fused() + 2 * n


MODEL_FILE = '''"""A vocabulary-heavy {kind}: vocabulary 32000, hidden 64."""
import dataclasses

from memplan.planner.workloads.{kind} import TINY, build_workload


def build(batch_size, seq_len, dtype, device):
    return build_workload(batch_size, seq_len, dtype, device, config=dataclasses.replace(TINY, vocab_size=32000))
'''


def model_file(tmp_path, kind: str) -> str:
    path = tmp_path / f"vocab_{kind}.py"
    path.write_text(MODEL_FILE.format(kind=kind))
    return str(path)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_vocabulary_heavy_step_peaks_below_the_unfused_by_the_logits(tmp_path, kind):
    torch.set_num_threads(1)
    step = StepSpec(model_file(tmp_path, kind), batch=1, seq=SEQ)
    unfused, fused = trace_step(step), trace_step(step.replace(loss=FUSED))
    logits = SEQ * VOCAB * 4
    assert fused.peak()[0] <= unfused.peak()[0] - logits
    assert fused.meta["loss"] == FUSED and fused.meta["loss_patch"]["changed"]
    assert unfused.meta["loss"] == AS_BUILT and not unfused.meta["loss_patch"]["patched"]
    assert max(fused.size) < logits  # no buffer of the logits' size: they never existed whole


def test_a_fake_cuda_step_of_a_huggingface_config_is_fused_too(tmp_path):
    pytest.importorskip("transformers")
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": HIDDEN,
        "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    step = StepSpec(str(tmp_path), batch=1, seq=SEQ, dtype="bf16-mixed", device="cuda", fake=True)
    unfused, fused = trace_step(step), trace_step(step.replace(loss=FUSED))
    assert fused.meta["fake"] and fused.meta["device"] == "cuda"
    assert fused.peak()[0] <= unfused.peak()[0] - SEQ * VOCAB * 2  # the bf16 logits at least
    assert fused.meta["loss_patch"]["replaced"].startswith("LlamaForCausalLM.lm_head + ForCausalLMLoss")


# 4. The command line and the step.


def test_the_cli_traces_the_fused_loss_and_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = model_file(tmp_path, "llama")
    result = CliRunner().invoke(main, ["trace", path, "--batch", "1", "--seq", "64", "--loss", "fused", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["output"] == "vocab_llama.as-built.loss-fused.trace.json.gz"
    assert summary["loss"] == FUSED and summary["loss_patch"]["changed"]
    with gzip.open(tmp_path / summary["output"]) as f:
        assert json.load(f)["meta"]["loss"] == FUSED
    text = CliRunner().invoke(main, ["trace", path, "--seq", "64", "--loss", "fused", "-o", "t.json"]).output
    assert "(as-built, loss fused, cpu, float32)" in text
    assert "loss fused: Llama.head + TokenLoss -> fused linear cross-entropy (128 tokens: chunks of 8 rows" in text


def test_the_cli_says_when_the_fused_loss_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["trace", "--seq", "32", "--loss", "fused", str(EXAMPLES / "bert.py")])
    assert result.exit_code == 0, result.output
    assert "--loss fused changes nothing in this model: it has no language-model head" in result.output


@pytest.mark.parametrize(
    "arguments, words",
    [
        (["--loss", "chunked"], "Invalid value for '--loss'"),
        (["--loss", "fused", "--compile"], "Error: --loss fused does not take --compile"),
    ],
    ids=named(["unknown", "compile"]),
)
def test_a_bad_loss_is_one_line(tmp_path, monkeypatch, arguments, words):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["trace", str(EXAMPLES / "llama.py"), *arguments])
    assert result.exit_code != 0 and words in result.output
    assert list(tmp_path.iterdir()) == []


def test_the_step_carries_its_loss_everywhere():
    step = StepSpec("m.py", loss=FUSED)
    assert step.name == "as-built.loss-fused" and "--loss fused" in step.arguments()
    assert "loss fused" in step.describe() and step.replace(mode="tempo").loss == FUSED
    with pytest.raises(PatchError, match="unknown loss"):
        StepSpec("m.py", loss="chunked")
    with pytest.raises(StepError, match="--compile"):
        StepSpec("m.py", loss=FUSED, compile=1.0)


@pytest.mark.slow  # several fake traces
def test_fit_takes_the_loss(tmp_path):
    result = CliRunner().invoke(
        main,
        ["fit", str(EXAMPLES / "llama.py"), "--memory", "4MiB", "--seq", "32", "--layers", "as-built",
         "--loss", "fused", "--capture", "fake", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["loss"] == FUSED
    assert summary["modes"][0]["loss_patch"].startswith("loss fused: Llama.head + TokenLoss -> fused linear")
