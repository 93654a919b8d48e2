"""The step recorder against what a step really does: a real GPU snapshot of a program no one here wrote (rebuilt
from the facts ../shared gives of it), storages a program rebinds, an unrecorded step's allocations (replayed
from the plan), fake tensors against real ones, and a model far larger than this machine."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from lanes import diagonal, named
from step_traces import buffer_events, bytes_by_category
from torch import nn

from memplan.modes import MODES, mode
from memplan.planner.problem import problem_from_trace
from memplan.planner.replay.cpu_session import CPUPlanAllocator
from memplan.planner.replay.runner import replay
from memplan.planner.replay.schedule import schedule_from
from memplan.solvers import solve
from memplan.step import StepSpec
from memplan.traces.capture import CaptureError, capture_step
from memplan.traces.inputs.model_file import load_workload
from memplan.traces.inputs.trace_model import trace_step
from memplan.traces.inputs.workload import Workload

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SNAPSHOTS = Path("traces") / "cuda-snapshots"
GPU_PEAK_CTX128 = 7_013_335_044  # ../shared/traces/cuda-snapshots/PROGRAMS.md: the ctx128 snapshot's peak allocated


# --- a real program's GPU snapshot --------------------------------------------------------------


def cs336_step(fake: bool, batch: int = 4, seq: int = 128):
    """The CS336 step (examples/cs336_lm.py, our rebuild of the program behind the snapshot) at context 128,
    batch 4, fp32, as the snapshot's (its MEMPLAN_PRESET as the test set it)."""
    return trace_step(StepSpec(EXAMPLES / "cs336_lm.py", batch=batch, seq=seq, fake=fake))


@pytest.fixture
def cs336(shared, monkeypatch):
    """The step whose real GPU snapshot is ../shared's gpt2_medium_ctx128_training.pickle; skipped without it."""
    snapshot = shared / SNAPSHOTS / "gpt2_medium_ctx128_training.pickle"
    if not snapshot.is_file():
        pytest.skip(f"needs the CS336 GPU snapshot {snapshot} (the shared folder holds no CUDA snapshots)")
    for name in ("MEMPLAN_PRESET", "CS336_AUTOCAST"):  # the snapshot's shape and precision
        monkeypatch.delenv(name, raising=False)
    return cs336_step


def old_state_dies_inside_the_step(trace) -> bool:
    """The course's AdamW replaces m and v every step: the state held before the recorded step dies inside it."""
    old_state = [i for i in range(len(trace)) if trace.alloc[i] == 0 and trace.category[i] == "optimizer"]
    return bool(old_state) and all(trace.free[i] < trace.end for i in old_state)


@pytest.mark.slow
def test_cs336_fake_step_peaks_within_one_percent_of_the_gpu_snapshot_and_the_real_step_allocates_alike(
    cs336, monkeypatch
):
    """The fake step peaks within 1% of the GPU snapshot's; the course's AdamW replaces m and v every step, so the
    old ones die inside the recorded step. And the real step of the same program allocates as the fake one does:
    a program no one here wrote (rebuilt op by op), whose backward formulas take other paths for tensor subclasses
    (gather's, max's and indexing's write into zeros in place only for real tensors) and whose initialisation reads
    scalars (trunc_normal_'s `.item()`) that fake tensors answer by rule: its kernels' own buffers aside, the same
    sizes in the same order (labels may differ where a formula makes its zeros another way for subclasses), so the
    fake step's peak is the real one's. Those paths do not depend on the shape: the real and fake steps are compared
    at the program's tiny preset (a real GPT-2-medium CPU step holds 7 GB and took minutes), where a real step's
    peak is the fake one's but for kernels' own scratch."""
    fake = cs336(True)
    peak, _ = fake.peak()
    assert abs(peak - GPU_PEAK_CTX128) <= 0.01 * GPU_PEAK_CTX128, (peak, GPU_PEAK_CTX128)
    assert old_state_dies_inside_the_step(fake)
    assert fake.meta["data_dependent"]
    monkeypatch.setenv("MEMPLAN_PRESET", "tiny")
    real, fake = cs336(False, batch=2, seq=32), cs336(True, batch=2, seq=32)
    assert real.meta["model"] == fake.meta["model"] == "cs336-tiny"
    assert old_state_dies_inside_the_step(real) and old_state_dies_inside_the_step(fake)
    assert fake.meta["data_dependent"]
    assert [event[0] for event in buffer_events(fake)] == [event[0] for event in buffer_events(real)]
    internal = sum(int(real.size[i]) for i in range(len(real)) if real.internal[i])
    assert 0 <= real.peak()[0] - fake.peak()[0] <= internal


# --- storages the program rebinds ---------------------------------------------------------------


class RunningMean(nn.Module):
    """A linear layer that rebinds a registered buffer every call (as a running statistic does)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(32, 32)
        self.register_buffer("mean", torch.zeros(32))

    def forward(self, x):
        self.mean = 0.9 * self.mean + 0.1 * x.detach().mean(0)
        return self.linear(x - self.mean)


class ReplacingMomentum(torch.optim.Optimizer):
    """SGD with momentum whose state tensor is replaced, not updated in place, each step."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                momentum = 0.9 * self.state[p].get("m", torch.zeros_like(p)) + p.grad
                self.state[p]["m"] = momentum
                p.sub_(group["lr"] * momentum)


def rebinding_workload() -> Workload:
    torch.manual_seed(0)
    model = RunningMean()
    return Workload(model, torch.randn(8, 32), ReplacingMomentum(model.parameters()), name="rebinding")


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
def test_storages_a_program_rebinds_are_freed_where_it_drops_them(fake):
    trace = capture_step(rebinding_workload, fake=fake)
    before = [i for i in range(len(trace)) if trace.alloc[i] == 0]
    state = [i for i in before if trace.category[i] == "optimizer"]
    buffer = [i for i in before if trace.module[i] == "model"]  # `mean`, the one tensor the root module holds
    assert len(state) == 2 and len(buffer) == 1  # weight and bias momenta
    for i in state:  # replaced during optimizer.step(): freed inside the step, before its end
        assert trace.free[i] < trace.end
    backward_begins = min(int(trace.alloc[i]) for i in trace.recorded if trace.phase[i] == "backward")
    assert trace.free[buffer[0]] < backward_begins  # the old `mean` dies when forward rebinds it


def test_a_workload_built_before_recording_is_refused():
    built = rebinding_workload()
    with pytest.raises(CaptureError, match="existed before recording began"):
        capture_step(lambda: built)


def test_a_module_outside_the_workload_counts_as_parameters():
    """A frozen teacher used inside the loss holds memory the step needs: its parameters are in the trace."""
    teacher = []

    def build():
        torch.manual_seed(0)
        frozen = nn.Linear(32, 32).requires_grad_(False)
        teacher.append(frozen)
        model = nn.Linear(32, 32)
        return Workload(
            model,
            torch.randn(8, 32),
            torch.optim.SGD(model.parameters(), lr=0.1),
            loss_fn=lambda out, x: (out - frozen(x)).pow(2).mean(),
            name="distill",
        )

    trace = capture_step(build)
    named = [i for i in range(len(trace)) if trace.module[i].startswith("Linear")]
    assert sorted(int(trace.size[i]) for i in named) == [32 * 4, 32 * 32 * 4]
    assert {trace.category[i] for i in named} == {"parameter"}
    assert "unknown" not in trace.category


# --- a traced step allocates what an untraced one does ------------------------------------------

HF_DECODERS = {
    "hf_mistral": "from transformers import MistralConfig as Config, MistralForCausalLM as Model",
    "hf_qwen2": "from transformers import Qwen2Config as Config, Qwen2ForCausalLM as Model",
}
HF_DECODER_FILE = """import torch
{imports}


def build(batch_size, seq_len, dtype, device):
    config = Config(vocab_size=1024, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    ids = torch.randint(0, 1024, (batch_size, seq_len), generator=torch.Generator().manual_seed(0)).to(device)
    return {{"model": Model(config).train(), "inputs": {{"input_ids": ids, "labels": ids}}}}
"""


@pytest.fixture(scope="module")
def model_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("models")
    files = {name: EXAMPLES / f"{name}.py" for name in ("bert", "gpt2", "llama", "hf_llama", "hf_gpt2", "hf_bert")}
    for name, imports in HF_DECODERS.items():
        files[name] = folder / f"{name}.py"
        files[name].write_text(HF_DECODER_FILE.format(imports=imports))
    return files


SERVED = ["bert", "gpt2", "llama", "hf_llama", "hf_gpt2", "hf_mistral", "hf_qwen2"]


@pytest.mark.parametrize("name, mode", diagonal(named(SERVED), named(MODES)))  # fast lane: each model and mode once
def test_the_plan_of_a_traced_step_serves_untraced_steps_exactly(model_files, name, mode):
    def make():
        return load_workload(StepSpec(model_files[name], batch=2, seq=16, mode=mode))

    trace = capture_step(make)
    plan = solve(problem_from_trace(trace), method="greedy", time_limit=5.0)
    schedule = schedule_from(plan, trace)
    report = replay(schedule, make, CPUPlanAllocator(schedule), steps=2)
    assert report.size_mismatch == report.extra == report.missing == 0
    assert report.fallback_count == 0 and report.outside_bytes == 0
    assert report.peak_bytes == plan.arena
    assert report.bitwise_equal, report.first_difference


# --- fake tensors -------------------------------------------------------------------------------


# every mode on memplan's own models; on HuggingFace's, one of each kind of change
# (the fast lane: a diagonal of each, every model and every mode once)
RESIDENT_MODES = tuple(name for name in MODES if not mode(name).offloads)
OFFLOADING_MODES = tuple(name for name in MODES if mode(name).offloads)
FAKE_CASES = diagonal(named(("bert", "gpt2", "llama")), named(RESIDENT_MODES)) + diagonal(
    named(("hf_llama", "hf_gpt2", "hf_bert", "hf_mistral", "hf_qwen2")), named(("as-built", "tempo+selective", "full"))
)


@pytest.mark.parametrize("name, mode", FAKE_CASES)
def test_fake_and_real_traces_allocate_the_same_buffers_in_the_same_order(model_files, name, mode):
    """Every buffer an op returns is in both, with its size, labels and place in the order of allocations and
    frees, and so is the state; the real trace also holds kernels' own buffers (scratch, wrapped Python
    numbers), marked internal, which fake tensors cannot see."""

    def trace(fake: bool):
        return trace_step(StepSpec(model_files[name], batch=2, seq=16, fake=fake, mode=mode))

    real, fake = trace(False), trace(True)
    assert real.meta["internal_marked"] and real.internal.any() and not fake.internal.any()
    # tempo's norms select their exact channels with nonzero: none, by the rule as for these weights; HuggingFace's
    # mask helpers see an eager step of an unpadded batch (traces/fake/hf_masks.py), also under checkpointing
    assert buffer_events(fake) == buffer_events(real)
    assert bytes_by_category(fake)["parameter"] == bytes_by_category(real)["parameter"]


@pytest.mark.parametrize("name, mode_name", diagonal(named(("bert", "gpt2", "llama")), named(OFFLOADING_MODES)))
def test_fake_offload_traces_peak_as_real_ones_do(model_files, name, mode_name):
    """Known gap (docs/limits.md): under fake tensors an offloaded storage brought back in backward is marked
    internal, so a fake offload trace is not yet the real one buffer for buffer; its peak is the real one's within
    the real trace's wrapped Python numbers (12 B) or 10 KiB (selective+offload, measured 10,112 B)."""

    def trace(fake: bool):
        return trace_step(StepSpec(model_files[name], batch=2, seq=16, fake=fake, mode=mode_name))

    real, fake = trace(False), trace(True)
    assert 0 <= real.peak()[0] - fake.peak()[0] <= 10 * 1024
    assert bytes_by_category(fake)["parameter"] == bytes_by_category(real)["parameter"]


@pytest.mark.parametrize("p, train", [(0.1, True), (0.0, True), (1.0, True), (0.1, False)])
def test_fake_dropout_on_the_cpu_allocates_its_outputs_as_the_cpu_kernel_does(p, train):
    """The CPU kernel allocates the mask before the output (the meta kernel the other way round); what it
    frees before returning is its own scratch, which fake tensors do not hold."""
    from memplan.traces.fake.mode import FakeCapture
    from memplan.traces.recorder import recording

    def outputs(fake: bool) -> list[int]:
        with recording(torch.device("cpu"), fake=fake) as recorder:
            with FakeCapture(recorder, "cpu") if fake else contextlib.nullcontext():
                x = torch.empty(8, 128)
                recorder.begin_step()
                kept = torch.ops.aten.native_dropout(x, p, train)
                events = recorder.end_step()
        del kept
        pairs = list(zip(events.key.tolist(), events.size.tolist()))
        freed = {key for key, size in pairs if size < 0}
        return [size for key, size in pairs if size > 0 and key not in freed]

    assert outputs(fake=True) == outputs(fake=False) == [8 * 128, 8 * 128 * 4]  # bool mask, then the output


def test_fake_cuda_tensors_get_the_optimizers_foreach_kernels_only_inside_the_capture():
    """`--fake --device cuda` runs torch's AdamW through its foreach kernels, as CUDA does (a fake tensor is not
    a type torch.optim trusts with them), and only inside the capture."""
    from torch.optim.optimizer import _default_to_fused_or_foreach

    from memplan.traces.fake.mode import FOREACH_TYPES, FakeCapture
    from memplan.traces.recorder import recording

    with recording(torch.device("cuda"), fake=True) as recorder, FakeCapture(recorder, "cuda"):
        on_cuda, on_cpu = torch.empty(4, device="cuda"), torch.empty(4)
        assert _default_to_fused_or_foreach([on_cuda], False) == (False, True)
        assert _default_to_fused_or_foreach([on_cpu], False) == (False, False)  # the CPU has no foreach kernels
    assert all(t.__name__ != "FakeTensor" for t in FOREACH_TYPES)


def test_fake_cuda_dropout_allocates_the_mask_first_and_claims_only_cuda_storages():
    """CUDA's dropout allocates the mask before the output (the CPU kernel the other way round)."""
    from memplan.traces.fake.mode import FakeCapture
    from memplan.traces.recorder import recording

    with recording(torch.device("cuda"), fake=True) as recorder, FakeCapture(recorder, "cuda"):
        x = torch.empty(8, 128, device="cuda")
        recorder.begin_step()
        output, mask = torch.ops.aten.native_dropout(x, 0.1, True)
        torch.ones(3, device="cpu")  # not the CUDA trace's
        events = recorder.end_step()
    assert events.size.tolist() == [8 * 128, 8 * 128 * 4]  # bool mask, then the fp32 output
    assert (output.shape, output.dtype, mask.dtype) == (x.shape, torch.float32, torch.bool)


def test_moving_a_fake_model_keeps_what_the_program_attached_to_its_parameters():
    """module_to keeps each fake parameter object, as Module.to keeps real ones: their attributes and gradient hooks
    (a sequence-parallel layer's flag and gradient all-reduce) stay (tests/test_fake_module_to.py: the rest)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memplan.traces.fake.mode import module_to

    seen = []
    with FakeTensorMode():
        layer = nn.Linear(4, 4)
        layer.weight.flagged = True
        layer.weight.register_hook(lambda grad: seen.append(tuple(grad.shape)))
        weight = layer.weight
        module_to(layer, dtype=torch.bfloat16)
        assert layer.weight is weight and weight.dtype == torch.bfloat16 and weight.flagged
        layer(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
    assert seen == [(4, 4)]


@pytest.mark.slow
def test_fake_trace_of_a_7b_llama_has_the_models_own_state_bytes(monkeypatch):
    """HF Llama at the 7B shape, bf16, batch 1, sequence 2048: ~54 GB of training state, none allocated."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setenv("MEMPLAN_PRESET", "7b")
    trace = trace_step(StepSpec(EXAMPLES / "hf_llama.py", batch=1, seq=2048, dtype="bfloat16", fake=True))
    with FakeTensorMode():
        params = list(LlamaForCausalLM(LlamaConfig()).parameters())
    param_bytes = sum(p.numel() for p in params) * 2  # bf16
    got = bytes_by_category(trace)
    assert got["parameter"] == param_bytes + 64 * 4  # and the rotary inverse frequencies (fp32 buffer)
    assert got["gradient"] == param_bytes
    assert got["optimizer"] == 2 * param_bytes + 4 * len(params)  # exp_avg, exp_avg_sq, fp32 step
    assert trace.peak()[0] > 50 * 2**30


def test_trace_command_fake_writes_a_fake_trace(tmp_path):
    from click.testing import CliRunner

    from memplan.cli import main
    from memplan.traces.format import load

    out = tmp_path / "llama.json.gz"
    result = CliRunner().invoke(
        main, ["trace", str(EXAMPLES / "llama.py"), "--fake", "--seq", "16", "-o", str(out), "--json"]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["fake"] is True and summary["data_dependent"] == {}
    trace = load(out)
    assert trace.meta["fake"] and (trace.addr == -1).all()
    assert set(trace.category) >= {"parameter", "optimizer", "gradient", "activation", "temporary"}


@pytest.mark.slow  # 3-10 s: out of the fast lane, which stays under 3 minutes
def test_a_fake_trace_leaves_memplans_own_tables_real():
    """A fresh process whose first trace is fake imports the model file and memplan's layers outside fake
    tensors: the GELU tables stay real, and a real trace after it counts no storage it cannot name."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from memplan.step import StepSpec\n"
        "from memplan.traces.inputs.trace_model import trace_step\n"
        "trace_step(StepSpec('examples/gpt2.py', batch=2, seq=16, mode='tempo', fake=True))\n"
        "from memplan.planner.layers import gelu\n"
        "assert type(gelu.TABLES['tanh'].main) is torch.Tensor, type(gelu.TABLES['tanh'].main)\n"
        "real = trace_step(StepSpec('examples/gpt2.py', batch=2, seq=16, mode='tempo'))\n"
        "assert 'unknown' not in real.category, sorted(set(real.category))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_plan_replays_exactly_when_torch_has_several_threads():
    """Capture and replay run CPU steps on one intra-op thread: with two, worker threads allocate
    per-thread scratch in a varying order and the plan missed 426 of 1,046 allocations."""
    torch.set_num_threads(2)
    try:

        def make():
            return load_workload(StepSpec(EXAMPLES / "llama.py", batch=2, seq=16))

        trace = capture_step(make)
        assert torch.get_num_threads() == 2  # restored after the capture
        plan = solve(problem_from_trace(trace), method="greedy", time_limit=5.0)
        schedule = schedule_from(plan, trace)
        report = replay(schedule, make, CPUPlanAllocator(schedule), steps=2)
    finally:
        torch.set_num_threads(1)
    assert report.fallback_count == 0 and report.size_mismatch == 0 and report.peak_bytes == plan.arena
