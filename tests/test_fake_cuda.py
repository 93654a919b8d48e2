"""`--fake --device cuda` on this CPU-only torch: CUDA's autocast policy, AdamW's foreach path, cuBLAS's workspaces,
the step window, and a runtime that is gone once the capture ends (traces/cuda/fake_device.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

import memplan
from memplan.gpus import DEFAULT_GPU, cublas_workspace_size, gpu
from memplan.planner.simulate.caching_allocator import simulate_caching
from memplan.step import StepSpec
from memplan.traces.cuda.fake_device import needs_runtime
from memplan.traces.inputs.snapshot import read_snapshot, snapshot_to_trace
from memplan.traces.inputs.trace_model import trace_step

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GPT2 = EXAMPLES / "gpt2.py"


def fake_step(device: str, **changes):
    return trace_step(StepSpec(GPT2, batch=2, seq=64, fake=True, device=device, **changes))


def optimizer_ops(trace) -> set[str]:
    return {trace.op[i] for i in range(len(trace)) if trace.phase[i] == "optimizer" and trace.alloc[i] > 0}


def test_a_fake_cuda_step_runs_here_and_leaves_no_cuda_behind():
    trace = fake_step("cuda")
    assert trace.meta["device"] == "cuda" and trace.meta["fake"]
    assert trace.meta["gpu"] == DEFAULT_GPU == "H100-80GB"
    # the runtime is gone: torch.cuda and the autograd engine are this build's again, a CPU step still trains
    assert torch.cuda.is_available() == (not needs_runtime() and torch.cuda.is_available())
    if needs_runtime():
        assert torch.cuda.current_device.__module__ == "torch.cuda"
        with pytest.raises((RuntimeError, AssertionError)):
            torch.cuda.current_device()
    x = torch.ones(3, requires_grad=True)
    (x * x).sum().backward()
    assert x.grad.tolist() == [2.0, 2.0, 2.0]


def test_adamw_takes_its_foreach_path_on_fake_cuda_and_its_loop_on_fake_cpu():
    cuda, cpu = optimizer_ops(fake_step("cuda")), optimizer_ops(fake_step("cpu"))
    assert any(op.startswith("aten::_foreach_") for op in cuda), cuda
    assert not any(op.startswith("aten::_foreach_") for op in cpu), cpu


def test_each_thread_that_runs_a_matmul_takes_one_cublas_workspace():
    """The forward's thread and the autograd engine's CUDA thread: two handles, two workspaces, made in the
    warm-up step and alive through the recorded one (ATen's size rule for the GPU: 32 MiB on sm90); the forward's
    fused-bias addmm (nn.Linear with a bias) takes cuBLASLt's 1 MiB beside them, as a real H200 step did."""
    trace = fake_step("cuda")
    workspaces = [i for i in range(len(trace)) if trace.category[i] == "workspace"]
    cublas = gpu(DEFAULT_GPU).cublas_workspace_bytes
    assert sorted(int(trace.size[i]) for i in workspaces) == [1024 * 1024, cublas, cublas]
    assert cublas == 32 * 1024 * 1024
    assert all(trace.alloc[i] == 0 and trace.free[i] == trace.end for i in workspaces)
    assert trace.meta["cublas_workspace"] == 32 * 1024 * 1024
    assert trace.meta["cublaslt_workspace"] == 1024 * 1024
    assert "workspace" not in set(fake_step("cpu").category)


@pytest.mark.parametrize(
    ("config", "capability", "expected"),
    [
        (None, (9, 0), 4096 * 1024 * 8),
        (None, (8, 0), 4096 * 1024 * 2 + 16 * 1024 * 8),  # 8,519,680 B, as the shared snapshots' GPUs took
        (":4096:2:16:8", (9, 0), 8_519_680),
        (":16:8", (9, 0), 16 * 1024 * 8),
    ],
)
def test_the_cublas_workspace_follows_atens_rule(monkeypatch, config, capability, expected):
    if config is None:
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    else:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", config)
    assert cublas_workspace_size(capability) == expected


# CUDA's autocast policy (torch's autocast kernels, AutocastCUDA; the table of torch.amp's documentation): ops that
# run in the lower precision, ops that run in fp32 whatever their input, and ops that promote to the widest input.
LOWER = {
    "matmul": lambda x, w: x @ w,
    "linear": lambda x, w: nn.functional.linear(x, w),
    "bmm": lambda x, w: torch.bmm(x[None], w[None]),
    "addmm": lambda x, w: torch.addmm(x, x, w),
    "baddbmm": lambda x, w: torch.baddbmm(x[None], x[None], w[None]),
    "einsum": lambda x, w: torch.einsum("ij,jk->ik", x, w),
}
FLOAT32 = {
    "softmax": lambda x, w: torch.softmax(x, -1),
    "log_softmax": lambda x, w: torch.log_softmax(x, -1),
    "layer_norm": lambda x, w: nn.functional.layer_norm(x, (x.shape[-1],)),
    "exp": lambda x, w: torch.exp(x),
    "sum": lambda x, w: torch.sum(x, -1),
    "cumsum": lambda x, w: torch.cumsum(x, -1),
    "mse_loss": lambda x, w: nn.functional.mse_loss(x, w),
    "pow": lambda x, w: torch.pow(x, 2),
}
PROMOTE = {"cat": lambda x, w: torch.cat([x.bfloat16(), w]), "stack": lambda x, w: torch.stack([x.bfloat16(), w])}


def autocast_outputs(device: str) -> dict[str, torch.dtype]:
    """Each op's output dtype under the program's own `torch.autocast(device, bfloat16)` inside a fake step on
    `device`: the lower-precision ops on fp32 inputs, the others on bf16 ones (which fp32 ops upcast)."""
    found = {}
    with memplan.record(fake=True, device=device) as recording:
        x = torch.randn(16, 16, device=device)
        w = torch.randn(16, 16, device=device)
        with torch.autocast(device, dtype=torch.bfloat16):
            for name, op in LOWER.items():
                found[name] = op(x, w).dtype
            for name, op in {**FLOAT32, **PROMOTE}.items():
                found[name] = op(x.bfloat16(), w).dtype
        model = nn.Linear(2, 2).to(device)
        with recording.step(model, torch.optim.SGD(model.parameters())):
            model(torch.ones(1, 2, device=device)).sum().backward()
    return found


def test_a_programs_own_cuda_autocast_follows_cudas_policy():
    cuda = autocast_outputs("cuda")
    assert {name: cuda[name] for name in LOWER} == dict.fromkeys(LOWER, torch.bfloat16)
    assert {name: cuda[name] for name in FLOAT32} == dict.fromkeys(FLOAT32, torch.float32)
    assert {name: cuda[name] for name in PROMOTE} == dict.fromkeys(PROMOTE, torch.float32)
    # CPU autocast's policy is not CUDA's: what the snapshots' bf16 steps missed before
    cpu = autocast_outputs("cpu")
    assert {name for name in FLOAT32 if cpu[name] != torch.float32} == set(FLOAT32) - {"mse_loss"}


def test_cuda_autocast_casts_a_weight_once_per_region():
    """CUDA autocast caches the bf16 copy of a leaf weight for the whole region: a weight used twice is cast once."""
    with memplan.record(fake=True, device="cuda") as recording:
        layer = nn.Linear(64, 64, bias=False).cuda()
        optimizer = torch.optim.SGD(layer.parameters())
        x = torch.randn(8, 64, device="cuda")
        with recording.step(layer, optimizer), torch.autocast("cuda", dtype=torch.bfloat16):
            (layer(x) + layer(x)).float().sum().backward()
    trace = recording.trace
    casts = [i for i in range(len(trace)) if trace.op[i] == "aten::_to_copy" and trace.size[i] == 64 * 64 * 2]
    assert len(casts) == 1


def test_torch_cuda_calls_of_a_program_work_inside_a_fake_cuda_step():
    with memplan.record(fake=True, device="cuda") as recording:
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1 and torch.cuda.current_device() == 0
        assert torch.cuda.get_device_capability() == (9, 0) and torch.cuda.is_bf16_supported()
        assert torch.cuda.get_device_name() == "NVIDIA H100 80GB HBM3"
        stream, event = torch.cuda.Stream(), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream), torch.cuda.device(0):
            event.record()
        torch.cuda.synchronize()
        torch.cuda.manual_seed(0)
        torch.cuda.reset_peak_memory_stats()
        model = nn.Linear(4, 4).cuda()
        optimizer = torch.optim.AdamW(model.parameters())
        scaler = torch.amp.GradScaler("cuda")
        with recording.step(model, optimizer), torch.autocast("cuda", dtype=torch.float16):
            loss = model(torch.ones(2, 4, device="cuda")).float().sum()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    assert recording.trace.meta["device"] == "cuda"
    assert {"forward", "backward", "optimizer"} <= set(recording.trace.phase)


def test_tensors_from_data_pinned_batches_and_a_second_move_of_the_model_on_fake_cuda():
    """What a training framework does before its step (HuggingFace's Trainer: its loss accumulator from a Python
    number, the data loader's pinned batches, accelerate moving the model again after the optimizer is made)."""
    with memplan.record(fake=True, device="cuda") as recording:
        total = torch.tensor(0.0, device="cuda")
        weight = torch.tensor([[1.0, 2.0]], device=torch.device("cuda", 0), requires_grad=True)
        assert total.device.type == "cuda" and weight.is_leaf and weight.requires_grad and weight.shape == (1, 2)
        batch = torch.ones(2, 4, dtype=torch.long).pin_memory()
        assert batch.device.type == "cpu" and batch.shape == (2, 4)
        model = nn.Linear(4, 4).cuda()
        optimizer = torch.optim.AdamW(model.parameters())
        held = model.weight
        model.to("cuda")  # already there: the parameters stay the optimizer's
        assert model.weight is held
        with recording.step(model, optimizer):
            model(batch.to("cuda").float()).sum().backward()
            optimizer.step()
    assert "gradient" in recording.trace.category and "optimizer" in recording.trace.category


def test_checkpointing_keeps_its_rng_state_on_a_fake_cuda_step():
    from torch.utils.checkpoint import checkpoint

    with memplan.record(fake=True, device="cuda") as recording:
        model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1), nn.Linear(8, 8)).cuda()
        optimizer = torch.optim.SGD(model.parameters())
        with recording.step(model, optimizer):
            checkpoint(model, torch.ones(4, 8, device="cuda"), use_reentrant=False).sum().backward()
    assert "backward" in set(recording.trace.phase)


def test_a_fake_cuda_step_follows_the_named_gpus_rules():
    """An A100 (sm80): its cuBLAS workspace (8,519,680 B), its name and capability inside the step."""
    trace = fake_step("cuda", gpu="a100-80gb")
    assert trace.meta["gpu"] == "A100-80GB" and trace.meta["cublas_workspace"] == 8_519_680
    assert {int(trace.size[i]) for i in range(len(trace)) if trace.category[i] == "workspace"} == {
        8_519_680,
        1024 * 1024,
    }  # and cuBLASLt's
    with memplan.record(fake=True, device="cuda", gpu="L4") as recording:
        assert torch.cuda.get_device_capability() == (8, 9)
        assert torch.cuda.get_device_properties().total_memory == gpu("L4").memory
        model = nn.Linear(4, 4).cuda()
        with recording.step(model, torch.optim.SGD(model.parameters())):
            model(torch.ones(1, 4, device="cuda")).sum().backward()
    assert recording.trace.meta["gpu"] == "L4"


def test_the_first_step_window_holds_the_optimizer_state_the_step_creates():
    steady, first = fake_step("cuda"), fake_step("cuda", warmup=False)
    made = [i for i in range(len(first)) if first.category[i] == "optimizer" and first.alloc[i] > 0]
    assert made and all(first.phase[i] == "optimizer" for i in made)
    assert all(steady.alloc[i] == 0 for i in range(len(steady)) if steady.category[i] == "optimizer")
    assert first.meta["warmup"] is False and steady.meta["warmup"] is True
    # the cuBLAS workspaces too are made inside the first step, by its first matmul on each thread
    assert all(first.alloc[i] > 0 for i in range(len(first)) if first.category[i] == "workspace")


def test_the_step_holds_its_output_until_it_ends():
    """A loop's `output = model(x)` keeps the logits through backward and the optimizer's step."""
    trace = fake_step("cuda")
    logits = 2 * 64 * 1024 * 4  # batch x seq x vocabulary (examples/gpt2.py's tiny default) in fp32
    output = next(i for i in range(len(trace)) if trace.size[i] == logits and trace.module[i] == "model.head")
    optimizer_end = max(int(trace.free[i]) for i in range(len(trace)) if trace.phase[i] == "optimizer")
    assert trace.free[output] > optimizer_end


def cs336_snapshots() -> dict[str, tuple[str, int, str]]:
    """examples/cs336_lm.py's table of the shared snapshots and the model files that rebuild their programs."""
    spec = importlib.util.spec_from_file_location("cs336_lm_table", EXAMPLES / "cs336_lm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SNAPSHOTS


@pytest.mark.slow
@pytest.mark.parametrize("snapshot", sorted(cs336_snapshots()))
def test_a_fake_cuda_trace_predicts_each_shared_gpu_snapshot(shared, monkeypatch, snapshot):
    """From this CPU machine: the peak allocated within 1% of the real GPU's, the simulated reserved within 2%."""
    path = shared / "traces" / "cuda-snapshots" / snapshot
    if not path.is_file():
        pytest.skip(f"needs the GPU snapshot {path}")
    model_file, seq, autocast = cs336_snapshots()[snapshot]
    monkeypatch.delenv("MEMPLAN_PRESET", raising=False)
    monkeypatch.setenv("CS336_AUTOCAST", autocast)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")  # the programs' torch: 8,519,680 B per handle
    recorded = read_snapshot(path)
    real_peak = snapshot_to_trace(recorded, str(path)).peak()[0]
    real_reserved = sum(segment.size for segment in recorded.segments)
    trace = trace_step(StepSpec(EXAMPLES / model_file, batch=4, seq=seq, device="cuda", fake=True))
    assert abs(trace.peak()[0] / real_peak - 1) <= 0.01, (trace.peak()[0], real_peak)
    reserved = simulate_caching(trace).peak_reserved
    assert abs(reserved / real_reserved - 1) <= 0.02, (reserved, real_reserved)


@pytest.mark.slow  # a fresh process: 3-10 s
@pytest.mark.skipif(not needs_runtime(), reason="a CUDA build has its own CUDA device")
def test_a_process_whose_engine_started_without_the_device_gets_one_line():
    """The autograd engine sizes its device queues at a process's first backward: a fake CUDA step after a backward
    run before memplan's device existed is a one-line error naming the fix, not an internal assert."""
    import subprocess
    import sys

    program = (
        "import torch, memplan\n"
        "x = torch.ones(2, requires_grad=True); x.sum().backward()\n"
        "try:\n"
        "    with memplan.record(fake=True, device='cuda'): pass\n"
        "except memplan.MemplanError as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith("--fake --device cuda: this process ran a backward before")
    assert "memplan.traces.cuda.fake_device.install()" in done.stdout


def test_a_model_deep_copied_inside_a_fake_capture_is_in_the_trace():
    """`copy.deepcopy(model)` (an EMA, a DPO reference model) under fake tensors: a copy in the same capture."""
    import copy

    with memplan.record(fake=True) as recording:
        model = nn.Linear(16, 16)
        reference = copy.deepcopy(model)
        optimizer = torch.optim.SGD(model.parameters())
        with recording.step(model, optimizer):
            (model(torch.ones(2, 16)) - reference(torch.ones(2, 16))).sum().backward()
    trace = recording.trace
    at_start = [i for i in range(len(trace)) if trace.alloc[i] == 0]
    weights = [i for i in at_start if trace.size[i] == 16 * 16 * 4]
    assert len(weights) == 2  # the model's weight and its copy's
