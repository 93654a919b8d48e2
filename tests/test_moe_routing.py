"""Mixtures of experts under fake tensors (memplan.routing, traces/fake/known_values.py): the routing rules' choices,
and fake traces of Mixtral (its experts' loop and its grouped GEMMs) and Switch-Transformers that equal real ones buffer
for buffer when the real router is made to choose as the rule does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from lanes import diagonal, named, some
from step_traces import buffer_events, state_bytes

import memplan
from memplan.cli import main
from memplan.modes import MODES
from memplan.planner.report.trace_text import render_trace
from memplan.routing import Routing, RoutingError
from memplan.step import StepError, StepSpec
from memplan.traces.inputs.trace_model import trace_step
from memplan.traces.summary import summarize

torch.set_num_threads(1)

MIXTRAL_CONFIG = Path(__file__).resolve().parent / "data" / "hf-configs" / "tiny-mixtral.json"
# The real step's router is made to choose as the rule does: a forward hook writes the rule's choices into what the
# router returns (through .data, so autograd keeps the router's own op), made before the step as the fake one's are.
# Under fake tensors the hook leaves the router alone: the rule chooses there.
MIXTRAL_FILE = """import json
import torch
from transformers import MixtralConfig, MixtralForCausalLM
from memplan.routing import Routing
from memplan.traces.fake.mode import is_fake


def build(batch_size, seq_len, dtype, device):
    fields = json.loads(open({config!r}).read())
    fields = {{k: v for k, v in fields.items() if k not in ("model_type", "architectures")}}
    config = MixtralConfig(**fields, experts_implementation={experts!r}, use_cache=False)
    model = MixtralForCausalLM(config).train()
    chosen = Routing.parse({rule!r}).choices((batch_size * seq_len,), config.num_experts_per_tok,
                                             config.num_local_experts).to(device)

    def route(router, inputs, outputs):
        if not is_fake(outputs[2]):
            outputs[2].data.copy_(chosen)

    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(route)
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    return {{"model": model, "inputs": {{"input_ids": ids.to(device), "labels": ids.to(device)}}}}
"""
# Switch-Transformers' top-1 router takes the argmax of its classifier's logits, then drops the tokens past each
# expert's capacity in a sequence (6 here: the worst rule drops 10 of each sequence's 16).
SWITCH_FILE = """import torch
from transformers import SwitchTransformersConfig, SwitchTransformersForConditionalGeneration
from transformers.models.switch_transformers.modeling_switch_transformers import SwitchTransformersTop1Router
from memplan.routing import Routing
from memplan.traces.fake.mode import is_fake


def build(batch_size, seq_len, dtype, device):
    config = SwitchTransformersConfig(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                      num_decoder_layers=2, num_heads=4, num_experts=4, num_sparse_encoder_layers=1,
                                      num_sparse_decoder_layers=1, expert_capacity=6, decoder_start_token_id=0)
    model = SwitchTransformersForConditionalGeneration(config).train()
    chosen = Routing.parse({rule!r}).choices((batch_size, seq_len), 1, config.num_experts)[..., 0]
    logits = (10.0 * torch.nn.functional.one_hot(chosen, config.num_experts)).to(device)

    def route(classifier, inputs, output):
        if not is_fake(output):
            output.data.copy_(logits)

    for module in model.modules():
        if isinstance(module, SwitchTransformersTop1Router):
            module.classifier.register_forward_hook(route)
    ids = torch.randint(2, config.vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    return {{"model": model, "inputs": {{"input_ids": ids.to(device), "labels": ids.to(device)}}}}
"""
MODELS = {
    "mixtral-eager": (MIXTRAL_FILE, {"config": str(MIXTRAL_CONFIG), "experts": "eager"}),
    "mixtral": (MIXTRAL_FILE, {"config": str(MIXTRAL_CONFIG), "experts": None}),  # transformers' default: grouped GEMMs
    "switch": (SWITCH_FILE, {}),
}
RULES = {"balanced": "balanced", "worst": "worst", "loads": "loads=3,1,1,1"}
# Op labels that differ where fake tensors take another path to the same bytes: topk's backward makes its zeros with
# new_zeros for a tensor subclass (zeros for real tensors), and a Python number written into a tensor (x[..., 0] = 0)
# is lifted by fake tensor mode (aten::empty) where a real step wraps it outside any op (python scalar).
LABELS_APART = {("aten::zeros", "aten::new_zeros"), ("python scalar", "aten::empty")}


def model_file(folder: Path, model: str, rule: str) -> Path:
    source, fields = MODELS[model]
    path = folder / f"{model}-{rule.replace('=', '-').replace(',', '-')}.py"
    path.write_text(source.format(rule=rule, **fields))
    return path


# --- the rules -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["balanced", "worst", "loads=3,1,1,1", "loads=0,1,1,0", "loads=1,2,3,4,5,6,7,8"])
@pytest.mark.parametrize("leading, k", [((37,), 2), ((2, 16), 1), ((3, 5), 4), ((1,), 1)])
def test_every_token_takes_k_different_experts_and_every_expert_its_count(rule, leading, k):
    routing = Routing.parse(rule)
    experts = len(routing.loads) if routing.loads else 8
    tokens = leading[0] * (leading[1] if len(leading) > 1 else 1)
    if routing.loads and max(routing.loads) / sum(routing.loads) > 1 / k:
        with pytest.raises(RoutingError, match="a token chooses an expert once"):
            routing.choices(leading, k, experts)
        return
    chosen = routing.choices(leading, k, experts)
    assert chosen.shape == (*leading, k) and chosen.dtype == torch.long
    flat = chosen.reshape(tokens, k)
    assert all(len(set(row)) == k for row in flat.tolist())
    counts = routing.counts(tokens, k, experts)
    assert torch.bincount(flat.reshape(-1), minlength=experts).tolist() == counts and sum(counts) == tokens * k


def test_the_rules_counts():
    assert Routing.parse("balanced").counts(7, 2, 3) == [5, 5, 4]  # 14 choices: the first experts one more
    assert Routing.parse("worst").counts(32, 2, 4) == [32, 32, 0, 0]  # every token to experts 0 and 1
    assert Routing.parse("loads=3,1,1,1").counts(32, 2, 4) == [32, 11, 11, 10]  # 32, 10.67 x3: largest remainder
    assert Routing.parse("loads=1,1,1,5").counts(32, 1, 4) == [4, 4, 4, 20]


def test_balanced_gives_every_sequence_its_share_of_every_expert():
    """Tokens are dealt position by position across the batch, so a router that drops the tokens past an expert's
    capacity in each sequence (Switch-Transformers) drops none of a balanced routing's."""
    chosen = Routing.parse("balanced").choices((4, 16), 1, 4)[..., 0]
    for sequence in chosen:
        assert torch.bincount(sequence, minlength=4).tolist() == [4, 4, 4, 4]


@pytest.mark.parametrize(
    "text, words",
    [
        ("fair", "choose balanced, worst or loads="),
        ("loads=", "choose balanced, worst or loads="),
        ("loads=1,x", "numbers, one per expert"),
        ("loads=0,0", "not all 0"),
        ("loads=1,-1", "not negative"),
        ("loads=1,nan", "finite"),
    ],
)
def test_a_bad_rule_is_one_line(text, words):
    with pytest.raises(RoutingError, match=words):
        Routing.parse(text)
    with pytest.raises(RoutingError, match=words):
        StepSpec(MIXTRAL_CONFIG, fake=True, routing=text)


# --- fake against real ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model, rule", diagonal(named(MODELS), RULES))  # about 8 s each
def test_fake_and_real_moe_traces_are_equal_buffer_for_buffer(tmp_path, model, rule):
    """The real step's router is made to choose as the rule does; the fake step's follows the rule by itself: the
    same buffers, of the same sizes, in the same order of allocations and frees, with the same module, phase and
    category (op labels apart only in LABELS_APART), the same state, and no value read by the zero rule."""
    path = model_file(tmp_path, model, rule)
    real = trace_step(StepSpec(path, batch=2, seq=16))
    fake = trace_step(StepSpec(path, batch=2, seq=16, fake=True, routing=rule))
    real_events, fake_events = buffer_events(real), buffer_events(fake)
    assert [(e[0], *e[2:]) for e in fake_events] == [(e[0], *e[2:]) for e in real_events]
    apart = {(r[1], f[1]) for r, f in zip(real_events, fake_events) if r[1] != f[1]}
    assert apart <= LABELS_APART, apart
    assert fake.meta["data_dependent"] == {} and fake.meta["routing"]["lost"] == {}
    assert {call["rule"] for call in fake.meta["routing"]["routers"]} == {rule}


def expert_inputs(trace, experts: str, hidden_bytes: int) -> list[int]:
    """Tokens of each expert's input in the recorded step's forward through `experts`: Mixtral's experts' loop
    gathers each expert's tokens (tokens x hidden bytes), then their routing weights (tokens x 4 bytes), both by
    index ops."""
    sizes = [
        int(trace.size[i])
        for i in trace.recorded
        if (trace.module[i], trace.op[i], trace.phase[i]) == (experts, "aten::index", "forward")
    ]
    tokens = [size // hidden_bytes for size in sizes[::2]]
    assert sizes[::2] == [n * hidden_bytes for n in tokens] and sizes[1::2] == [4 * n for n in tokens]
    return tokens


@pytest.mark.parametrize(
    "rule, batch, seq",
    [
        pytest.param("loads=3,1,1,1", 2, 16),
        pytest.param("balanced", 4, 2048),  # an expert mask of 81,920 values, from zeros made when needed
        pytest.param("balanced", 2, 16, marks=pytest.mark.slow),
        pytest.param("worst", 2, 16, marks=pytest.mark.slow),
    ],
)
def test_each_expert_of_the_loop_takes_the_tokens_the_rule_gives_it(tmp_path, rule, batch, seq):
    """Mixtral's experts' loop under fake tensors: each expert hit gathers as many tokens as the rule gives it,
    and the trace's meta says the rule's counts."""
    path = model_file(tmp_path, "mixtral-eager", rule)
    trace = trace_step(StepSpec(path, batch=batch, seq=seq, fake=True, routing=rule))
    counts = Routing.parse(rule).counts(batch * seq, 2, 4)
    hidden = json.loads(MIXTRAL_CONFIG.read_text())["hidden_size"]
    assert expert_inputs(trace, "model.model.layers.0.mlp.experts", 4 * hidden) == [n for n in counts if n]
    (call,) = trace.meta["routing"]["routers"]
    assert (call["op"], call["experts"], call["k"], call["tokens"]) == ("aten.topk", 4, 2, batch * seq)
    assert call["per_expert"] == counts and trace.meta["data_dependent"] == {}
    assert f"token choices per expert {', '.join(map(str, counts))}" in render_trace(summarize(trace))


@pytest.mark.parametrize("mode", some(MODES, fast={"tempo+full"}))  # about 5 s each
def test_fp32_fake_mixtral_traces_in_every_layer_mode(mode):
    """Mixtral's default experts (grouped GEMMs, whose meta function takes bf16 alone) in fp32 on a fake CUDA step:
    every layer mode traces, its experts are routed by the rule, and every parameter holds its AdamW state (two
    fp32 moments; the parameters' bytes also count RoPE's two small buffers)."""
    trace = trace_step(StepSpec(MIXTRAL_CONFIG, batch=2, seq=32, fake=True, device="cuda", mode=mode))
    assert trace.meta["dtype"] == "float32" and trace.meta["routing"]["lost"] == {}
    assert [call["per_expert"] for call in trace.meta["routing"]["routers"]] == [[32, 32, 32, 32]]
    state = state_bytes(trace)
    assert 0 <= 2 * state["parameter"] - state["optimizer"] < 1024


# --- where the rule is chosen ---------------------------------------------------------------------------------------


def test_the_python_api_takes_the_rule(tmp_path):
    """memplan.record(fake=True, routing=...) builds and steps the model under fake tensors routed by the rule."""
    from transformers import MixtralConfig, MixtralForCausalLM

    fields = json.loads(MIXTRAL_CONFIG.read_text())
    fields = {k: v for k, v in fields.items() if k not in ("model_type", "architectures")} | {"num_hidden_layers": 1}
    config = MixtralConfig(**fields, experts_implementation="eager", use_cache=False)
    with memplan.record(fake=True, routing="worst") as recording:
        model = MixtralForCausalLM(config).train()
        optimizer = torch.optim.AdamW(model.parameters())
        ids = torch.zeros(1, 8, dtype=torch.long)
        with recording.step(model, optimizer):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
    (call,) = recording.trace.meta["routing"]["routers"]
    assert call["rule"] == "worst" and call["per_expert"] == [8, 8, 0, 0]
    with pytest.raises(StepError, match="routes fake tensors"):
        memplan.trace_model_file(MIXTRAL_CONFIG, batch=1, seq=8, routing="worst")


def test_the_command_line_takes_the_rule_and_refuses_what_it_cannot_follow(tmp_path):
    def trace(*options):
        return CliRunner().invoke(main, ["trace", str(MIXTRAL_CONFIG), "--seq", "8", "-o", str(tmp_path / "t.json"),
                                         "--json", *options])  # fmt: skip

    result = trace("--fake", "--routing", "loads=1,1,1,1")
    assert result.exit_code == 0, result.output
    (call,) = json.loads(result.stdout)["routing"]["routers"]
    assert call["per_expert"] == [8, 8, 8, 8]
    for options, words in [
        (["--routing", "worst"], "routes fake tensors"),  # a real step routes by its router's values
        (["--fake", "--routing", "loads=1,1"], "no router of the step chooses among 2 experts"),
        (["--fake", "--routing", "loads=5,1,1,1"], "more than a top-2 router can give one expert"),
    ]:
        (tmp_path / "t.json").unlink(missing_ok=True)
        result = trace(*options)
        assert result.exit_code == 1 and result.output.strip().splitlines()[-1].startswith("Error:"), result.output
        assert words in result.output and not (tmp_path / "t.json").exists()


THRESHOLD_ROUTER_FILE = """import torch
from torch import nn


class Experts(nn.Module):
    '''Each token goes to the experts whose score passes a threshold: a router memplan does not follow.'''

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(16, 4)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        chosen = self.router(x) > 0
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tokens = torch.nonzero(chosen[:, e])[:, 0]
            out = out.index_add(0, tokens, expert(x[tokens]))
        return out.sum()


def build(batch_size, seq_len, dtype, device):
    return {"model": Experts(), "inputs": torch.randn(batch_size * seq_len, 16)}
"""


def test_a_router_memplan_does_not_follow_is_said_in_one_line(tmp_path):
    (tmp_path / "threshold.py").write_text(THRESHOLD_ROUTER_FILE)
    trace = trace_step(StepSpec(tmp_path / "threshold.py", batch=1, seq=8, fake=True))
    assert trace.meta["data_dependent"]["aten.nonzero"] == 8 and trace.meta["routing"]["routers"] == []
    text = render_trace(summarize(trace))
    assert "a mixture of experts whose router memplan does not follow runs no expert" in text
