"""No mode costs memory by accident: the peak live bytes of a traced step under tempo are at most the
baseline's, for every bundled model file and HuggingFace models from tiny configs, and for a small MLP with
a GELU right after a LayerNorm (where it rose 26.9% before the GELU kept the input the norm keeps)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from memplan.planner.layers import patch
from memplan.step import StepSpec
from memplan.traces.capture import capture_step
from memplan.traces.inputs.trace_model import trace_step
from memplan.traces.inputs.workload import Workload

pytest.importorskip("transformers")

from hf_models import MODELS, workload  # noqa: E402  (needs transformers)
from lanes import some  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


BUNDLED = ["bert.py", "gpt2.py", "llama.py", "hf_bert.py", "hf_gpt2.py", "hf_llama.py"]


@pytest.mark.parametrize("file", some(BUNDLED, fast=("gpt2.py", "hf_llama.py")))  # fast lane: one own, one HF
def test_tempo_peak_at_most_baselines_on_the_bundled_model_files(file):
    peaks = {
        mode: trace_step(StepSpec(EXAMPLES / file, batch=2, seq=32, mode=mode)).peak()[0]
        for mode in ("baseline", "tempo")
    }
    assert peaks["tempo"] <= peaks["baseline"], peaks


@pytest.mark.parametrize("name", some(MODELS, fast=("t5", "vit")))  # fast lane: those the bundled files lack
def test_tempo_peak_at_most_baselines_on_huggingface_models(name):
    peaks = {mode: capture_step(lambda mode=mode: workload(name, mode)).peak()[0] for mode in ("baseline", "tempo")}
    assert peaks["tempo"] <= peaks["baseline"], peaks


MLP_CASES = [
    pytest.param(torch.float32, 64, 256, id="fp32-64x256"),
    pytest.param(torch.float32, 512, 1024, id="fp32-512x1024"),
    pytest.param(torch.bfloat16, 64, 256, id="bf16-64x256"),
    pytest.param(torch.bfloat16, 512, 1024, id="bf16-512x1024"),
]


@pytest.mark.parametrize("dtype, rows, width", MLP_CASES)
def test_tempo_peak_at_most_baselines_on_an_mlp_with_layernorm_and_gelu(dtype, rows, width):
    def make(mode):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, width), nn.LayerNorm(width), nn.GELU(), nn.Linear(width, 64)).to(dtype)
        patch(model, mode)
        x = torch.randn(rows, 64, dtype=dtype)
        return Workload(model, x, torch.optim.AdamW(model.parameters()), name="mlp")

    peaks = {mode: capture_step(lambda mode=mode: make(mode)).peak()[0] for mode in ("baseline", "tempo")}
    assert peaks["tempo"] <= peaks["baseline"], peaks
