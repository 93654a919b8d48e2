"""A HuggingFace config.json as a model file (traces/inputs/hf_config.py), and bf16 mixed precision
(--dtype bf16-mixed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from step_traces import state_bytes

import memplan
from memplan.cli import main
from memplan.limits import LimitError
from memplan.step import StepSpec
from memplan.traces.inputs.trace_model import trace_step

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
TINY = CONFIGS / "tiny-llama.json"


def bytes_by_category(trace, category: str) -> int:
    """Bytes of the buffers of `category` alive when the step begins (the model's and optimizer's state)."""
    return state_bytes(trace)[category]


def llama_parameters(config: dict) -> int:
    """A Llama-style decoder's parameter count from its config (no biases, untied head, GQA)."""
    h, f, layers, vocab = (config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h  # q, o; k, v; gate, up, down; two RMSNorms
    return layers * layer + 2 * vocab * h + h  # embedding, head, final norm


def test_a_config_file_traces_like_a_model_file():
    trace = trace_step(StepSpec(TINY, batch=2, seq=32, fake=True))
    assert trace.meta["model"] == "tiny-llama"
    n = llama_parameters(json.loads(TINY.read_text()))
    assert bytes_by_category(trace, "parameter") >= 4 * n  # + RoPE's inv_freq buffer
    assert bytes_by_category(trace, "parameter") - 4 * n < 1024


def test_a_folder_holding_a_config_is_a_model_file(tmp_path):
    folder = tmp_path / "my-llama"
    folder.mkdir()
    shutil.copy(TINY, folder / "config.json")
    trace = trace_step(StepSpec(folder, batch=1, seq=16, fake=True))
    assert trace.meta["model"] == "my-llama"


def test_bf16_mixed_keeps_fp32_parameters_and_runs_matmuls_in_bf16():
    mixed = trace_step(StepSpec(TINY, batch=2, seq=32, fake=True, dtype="bf16-mixed"))
    fp32 = trace_step(StepSpec(TINY, batch=2, seq=32, fake=True))
    assert bytes_by_category(mixed, "parameter") == bytes_by_category(fp32, "parameter")
    assert mixed.meta["dtype"] == "bf16-mixed"

    def forward_matmuls(trace) -> int:
        return sum(
            int(trace.size[i]) for i in range(len(trace)) if (trace.op[i], trace.phase[i]) == ("aten::mm", "forward")
        )

    assert 2 * forward_matmuls(mixed) == forward_matmuls(fp32)  # every projection's output in bf16


@pytest.mark.parametrize(
    "text, words",
    [
        ("{not json", "not a JSON config"),
        ('{"hidden_size": 8}', "names its model_type"),
        ('{"model_type": "no-such-model"}', "is not one of the"),
        ('{"model_type": "vit"}', "no causal language model"),
    ],
)
def test_a_bad_config_is_one_line(tmp_path, text, words):
    config = tmp_path / "bad.json"
    config.write_text(text)
    result = CliRunner().invoke(main, ["trace", str(config), "--fake", "-o", str(tmp_path / "t.json")])
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1].startswith("Error:") and words in result.output
    assert not (tmp_path / "t.json").exists()


def test_max_parameters_bounds_a_configs_model_and_can_be_raised(tmp_path):
    """The model's parameters are counted before it is built (on the meta device): above --max-parameters it is
    one Error line and nothing written; at its own count it traces, from the command line and from the API."""
    n = llama_parameters(json.loads(TINY.read_text()))
    out = tmp_path / "t.json"
    args = ["trace", str(TINY), "--fake", "--batch", "1", "--seq", "8", "-o", str(out)]
    refused = CliRunner().invoke(main, [*args, "--max-parameters", str(n - 1)])
    assert refused.exit_code == 1 and not out.exists()
    assert refused.stderr.splitlines()[-1].endswith(
        f"the model has {n:,} parameters, more than --max-parameters {n - 1:,} (limits.MAX_PARAMETERS; raise it to "
        "build a model this large)"
    )
    assert CliRunner().invoke(main, [*args, "--max-parameters", str(n)]).exit_code == 0 and out.exists()
    with pytest.raises(LimitError, match="more than --max-parameters 1,000"):
        memplan.trace_model_file(TINY, fake=True, batch=1, seq=8, max_parameters=1000)
    assert memplan.trace_model_file(TINY, fake=True, batch=1, seq=8, max_parameters=n).meta["model"] == "tiny-llama"


@pytest.mark.slow  # an 8-billion-parameter model under fake tensors: 10-30 s
def test_llama_3_8b_config_state_bytes_equal_the_configs_arithmetic():
    config = CONFIGS / "llama-3-8b.json"
    n = llama_parameters(json.loads(config.read_text()))
    assert n == 8_030_261_248  # Llama-3-8B's published count
    trace = trace_step(StepSpec(config, batch=1, seq=128, fake=True, device="cuda", dtype="bf16-mixed"))
    assert 0 <= bytes_by_category(trace, "parameter") - 4 * n < 1024  # fp32 master weights (+ RoPE's table)
    assert bytes_by_category(trace, "optimizer") == 8 * n  # AdamW's two fp32 moments
    gradients = sum(int(trace.size[i]) for i in range(len(trace)) if trace.category[i] == "gradient")
    assert gradients == 4 * n


@pytest.mark.slow  # the pre-flight: one fake trace at sequence 8192 per mode
def test_fit_answers_for_llama_3_8b_at_8192_from_its_config():
    result = CliRunner().invoke(
        main,
        [
            "fit",
            str(CONFIGS / "llama-3-8b.json"),
            "--capture",
            "fake",
            "--memory",
            "80GB",
            "--seq",
            "8192",
            "--dtype",
            "bf16-mixed",
            "--layers",
            "full",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    (full,) = json.loads(result.stdout)["modes"]
    # 16 bytes per parameter (fp32 weights, gradients, two moments) are 128 GB: no batch fits 80 GB with AdamW
    assert full["plan"]["batch"] == 0 and full["plan"]["at_next"] > 16 * 8_030_261_248


def mixtral_parameters(config: dict) -> int:
    """A Mixtral-style decoder's parameters: Llama's with each layer's MLP replaced by its experts and a router."""
    h, f, experts = config["hidden_size"], config["intermediate_size"], config["num_local_experts"]
    mlp, router = 3 * h * f, h * experts
    return llama_parameters(config) + config["num_hidden_layers"] * ((experts - 1) * mlp + router)


@pytest.mark.parametrize("device, experts", [("cpu", None), ("cuda", None), ("cpu", "eager"), ("cuda", "eager")])
def test_every_expert_of_a_mixture_runs_and_holds_its_state(tmp_path, device, experts):
    """A Mixtral-style config (tests/data/hf-configs/tiny-mixtral.json, 4 experts, top-2) under fake tensors: the
    parameter, gradient and AdamW bytes are the config's arithmetic, so every expert ran and got a gradient, with
    transformers' default experts (grouped GEMMs, in fp32 through their fallback) and with its eager loop over the
    experts a batch hits (routed by the balanced rule: every expert gets tokens)."""
    config = Path(__file__).resolve().parent / "data" / "hf-configs" / "tiny-mixtral.json"
    if experts is not None:
        fields = {**json.loads(config.read_text()), "experts_implementation": experts}
        config = tmp_path / "tiny-mixtral.json"
        config.write_text(json.dumps(fields))
    trace = trace_step(StepSpec(config, batch=2, seq=64, fake=True, device=device))
    n = 4 * mixtral_parameters(json.loads(config.read_text()))
    assert 0 <= bytes_by_category(trace, "parameter") - n < 1024  # + RoPE's inv_freq buffer
    assert 2 * n <= bytes_by_category(trace, "optimizer") < 2 * n + 1024  # + the step counters
    gradients = [int(trace.size[i]) for i in range(len(trace)) if trace.category[i] == "gradient"]
    assert sum(gradients) >= n - 1024  # every parameter's gradient made in the step


def test_the_bundled_mixtral_config_is_mixtral_8x7b():
    """examples/configs/mixtral-8x7b.json: 46.7 billion parameters, as published."""
    config = json.loads((CONFIGS / "mixtral-8x7b.json").read_text())
    assert round(mixtral_parameters(config) / 1e9, 1) == 46.7
