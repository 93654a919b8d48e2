"""planner.cost: a training step's FLOPs (matmul against FlopCounterMode, what each layer mode recomputes and
which layer it is charged to, fake against real tensors, compile budgets) and its measured time."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from torch.utils.flop_counter import FlopCounterMode

from memplan.planner.cost import CostError, StepFlops, count_step_flops, time_step
from memplan.step import StepError, StepSpec
from memplan.traces.inputs.model_file import load_workload

ROOT = Path(__file__).resolve().parents[1]
TINY_GPT2 = ROOT / "examples" / "gpt2.py"  # 2 layers x 64
LAYERS, HIDDEN, HEADS = 4, 64, 4
BATCH, SEQ = 2, 32
MODES = ("baseline", "tempo", "selective", "full")
MODEL_FILE = f"""from memplan.planner.workloads.gpt2 import GPT2Config, build_workload


def build(batch_size, seq_len, dtype, device):
    return build_workload(batch_size, seq_len, dtype, device, config=GPT2Config(layers={LAYERS}))
"""


def attention_matmuls() -> int:
    """One layer's attention core: QKᵀ and probs·V, each a batched matmul of 2·b·a·s·s·(h/a) FLOPs."""
    return 2 * (2 * BATCH * HEADS * SEQ * SEQ * (HIDDEN // HEADS))


def layer_forward_matmuls() -> int:
    """One GPT-2 layer's forward matmuls: QKV (h -> 3h), output projection (h -> h), MLP (h -> 4h -> h), and
    the attention core."""
    tokens = BATCH * SEQ
    return 2 * tokens * HIDDEN * (3 * HIDDEN + HIDDEN + 4 * HIDDEN + 4 * HIDDEN) + attention_matmuls()


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    """A model file of a 4-layer tiny GPT-2."""
    path = tmp_path_factory.mktemp("cost") / "gpt2_4.py"
    path.write_text(MODEL_FILE)
    return path


@pytest.fixture(scope="module")
def counts(gpt2) -> dict[str, StepFlops]:
    """The 4-layer GPT-2's step FLOPs in each of MODES, on real tensors."""
    return {mode: count_step_flops(StepSpec(gpt2, batch=BATCH, seq=SEQ, mode=mode)) for mode in MODES}


def layer_growth(counts: dict[str, StepFlops], mode: str) -> list[int]:
    """What each layer's FLOPs grow by in `mode` against baseline."""
    return [counts[mode].by_module[f"layers.{i}"] - counts["baseline"].by_module[f"layers.{i}"] for i in range(LAYERS)]


def test_matmul_flops_equal_flop_counter_mode(gpt2, counts):
    workload = load_workload(StepSpec(gpt2, batch=BATCH, seq=SEQ, mode="baseline"))
    workload.step()  # the warm-up count_step_flops runs too
    with FlopCounterMode(display=False) as counter:
        workload.step()
    assert counts["baseline"].matmul == counter.get_total_flops() > 0
    assert counts["baseline"].total == counts["baseline"].matmul + counts["baseline"].elementwise


def test_selective_recomputes_the_attention_core_in_its_layer(counts):
    assert counts["selective"].matmul - counts["baseline"].matmul == LAYERS * attention_matmuls()
    growth = layer_growth(counts, "selective")
    assert all(g > attention_matmuls() for g in growth)  # the softmax and dropout are recomputed too
    assert sum(growth) == counts["selective"].total - counts["baseline"].total  # all of it charged to the layers


def test_full_recomputes_about_one_forward_of_each_layer_in_that_layer(counts):
    assert counts["full"].matmul - counts["baseline"].matmul == LAYERS * layer_forward_matmuls()
    growth = layer_growth(counts, "full")
    # the forward's elementwise work too (bar what checkpointing need not rerun: the last residual add)
    assert all(layer_forward_matmuls() < g < 1.05 * layer_forward_matmuls() for g in growth)
    assert sum(growth) == counts["full"].total - counts["baseline"].total


def test_tempo_recomputes_elementwise_work_only(counts):
    # Tempo's LayerNorm sums its weight and bias gradients over the tokens as matmuls with a ones vector (2·b·s·h
    # FLOPs each; baseline's LayerNorm backward does it inside one op): 2 per layer and the final LayerNorm.
    layer_norms = 2 * LAYERS + 1
    assert counts["tempo"].matmul - counts["baseline"].matmul == layer_norms * 2 * (2 * BATCH * SEQ * HIDDEN)
    assert counts["tempo"].elementwise > counts["baseline"].elementwise
    assert all(g > 0 for g in layer_growth(counts, "tempo"))


@pytest.mark.slow
def test_fake_tensors_count_what_real_ones_do(gpt2, counts):
    for mode in ("tempo", "full"):
        fake = count_step_flops(StepSpec(gpt2, batch=BATCH, seq=SEQ, mode=mode, fake=True))
        assert fake == counts[mode]


@pytest.mark.slow
def test_compile_budget_zero_recomputes_more_than_budget_one():
    step = StepSpec(TINY_GPT2, batch=2, seq=16)
    eager = count_step_flops(step)
    kept = count_step_flops(step.replace(compile=1.0))
    recomputed = count_step_flops(step.replace(compile=0.0))
    assert recomputed.matmul > kept.matmul == eager.matmul
    assert kept.total == pytest.approx(eager.total, rel=0.05)  # decomposed ops write a few more elements
    assert kept.by_module == {}  # compiled graphs run no modules
    assert count_step_flops(step.replace(compile=0.0, fake=True)) == recomputed


def test_time_step_gives_the_median_of_its_runs():
    timed = time_step(StepSpec(TINY_GPT2, batch=2, seq=16), repeats=3, warmup=1)
    assert len(timed.runs) == 3 and all(run > 0 for run in timed.runs)
    assert timed.median == statistics.median(timed.runs)


def test_bad_options_are_one_line_errors():
    with pytest.raises(StepError, match="--dtype 'float33': choose one of float32, bfloat16"):
        StepSpec(TINY_GPT2, batch=2, seq=16, dtype="float33")
    with pytest.raises(CostError, match="repeats 0"):
        time_step(StepSpec(TINY_GPT2, batch=2, seq=16), repeats=0)
