"""A parameter held by two modules (a tied embedding and output head) has one module label in the trace: the
first name `named_parameters()` gives it, for the parameter and for its optimizer state alike."""

import textwrap

import pytest

from memplan.step import StepSpec
from memplan.traces.trace_model import trace_step

TIED = """
import torch
from torch import nn


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.emb.weight  # tied: one Parameter, two modules

    def forward(self, ids):
        return self.head(torch.relu(self.body(self.emb(ids))))


def build(batch_size, seq_len, dtype, device):
    ids = torch.randint(0, 64, (batch_size, seq_len), device=device)
    return {"model": Tied(), "inputs": ids}  # default optimizer: AdamW
"""
EMB = 64 * 16 * 4  # bytes of the tied fp32 weight


@pytest.mark.parametrize("fake", [False, True])
def test_a_tied_parameter_and_its_optimizer_state_share_one_module_label(tmp_path, fake):
    path = tmp_path / "tied.py"
    path.write_text(textwrap.dedent(TIED))
    trace = trace_step(StepSpec(path, batch=2, seq=4, fake=fake))
    resident = [(c, m, int(s)) for c, m, s, a in zip(trace.category, trace.module, trace.size, trace.alloc) if a == 0]
    tied = {(c, m) for c, m, s in resident if s == EMB and c in ("parameter", "optimizer")}
    # the weight once, and AdamW's exp_avg and exp_avg_sq for it: all under model.emb, its named_parameters() name
    assert tied == {("parameter", "model.emb"), ("optimizer", "model.emb")}
    assert sum(1 for c, m, s in resident if s == EMB and c == "optimizer") == 2
    params = {m for c, m, _ in resident if c == "parameter"}
    state = {m for c, m, _ in resident if c == "optimizer"}
    assert params == state == {"model.emb", "model.body"}  # model.head holds nothing of its own
