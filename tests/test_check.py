"""`memplan check -- python SCRIPT ARGS`: an unmodified training script run on a fake GPU, the caching allocator
simulated as it runs (torch.cuda's statistics from it, torch.OutOfMemoryError where the GPU would raise it)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from memplan.cli import main
from memplan.gpus import gpu
from memplan.planner.report.check_text import render_check
from memplan.traces.format import load

SCRIPTS = Path(__file__).resolve().parents[1] / "examples" / "scripts"
PLAIN = str(SCRIPTS / "plain_loop.py")
RETRY = str(SCRIPTS / "retry_on_oom.py")
PADDED = SCRIPTS / "padded_batches.py"


def check(*args: str):
    return CliRunner().invoke(main, ["check", *args], catch_exceptions=False)


def test_a_plain_loop_reads_the_fake_gpus_memory_and_fits():
    """The script's own torch.cuda calls answer as the GPU would: mem_get_info gives the H100's total and what the
    allocator left free, and the max_memory_allocated it prints is memplan's peak allocated."""
    result = check("--gpu", "H100", "--json", "--", "python", PLAIN, "--steps", "5")
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert answer["fits"] and answer["finished"] == "stopped" and answer["steps_run"] == 3 and not answer["failures"]
    said = result.stderr
    total, free = (
        int(x.replace(",", "")) for x in re.search(r"GPU memory: ([\d,]+) B, ([\d,]+) B free", said).groups()
    )
    assert total == gpu("H100").memory and 0 < free < total
    printed = [int(x.replace(",", "")) for x in re.findall(r"max_memory_allocated ([\d,]+) B", said)]
    assert len(printed) == 2 and printed[-1] == answer["peak_allocated"]  # steps 0 and 1 print; step 2 is stopped
    assert answer["headroom"] == answer["memory"] - answer["peak_reserved"] - sum(
        t["bytes"] for t in answer["budget"]["outside"]
    )


def test_a_script_that_runs_out_of_memory_gets_the_verdict_with_its_step_and_op():
    result = check("--gpu", "L4", "--", "python", PLAIN, "--batch-size", "64", "--seq", "2048", "--hidden", "1024")
    assert result.exit_code == 3, result.output
    text = result.stdout
    assert "runs out of memory on L4 (21.99 GiB) at aten::" in text and ", step 1: a request of " in text
    assert "CUDA out of memory. Tried to allocate " in text and "is reserved by PyTorch but unallocated." in text


def test_a_script_that_retries_with_a_smaller_batch_settles_where_it_fits(tmp_path):
    """The script catches torch.OutOfMemoryError and halves its batch: each error is raised where the L4 would
    raise it, the program goes on, and its whole program (3 steps at the batch that fits) is the trace -o writes."""
    output = tmp_path / "program.json.gz"
    result = check("--gpu", "L4", "--json", "-o", str(output), "--", RETRY)
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    tried = [int(b) for b in re.findall(r"batch (\d+): out of memory", result.stderr)]
    assert tried == [512, 256, 128, 64] and answer["fits"]
    assert [f["caught"] for f in answer["failures"]] == [True] * 4
    assert all(f["message"].startswith("CUDA out of memory. Tried to allocate") for f in answer["failures"])
    assert answer["peak_reserved"] <= gpu("L4").memory - sum(t["bytes"] for t in answer["budget"]["outside"])
    trace = load(output)
    assert len(trace.program.steps) == 3 and trace.program.measured == 2 and trace.meta["step"] == 3


@pytest.mark.parametrize(
    "args,error",
    [
        (["--", "nothere.py"], "nothere.py: not a Python script file; memplan check runs python SCRIPT.py ARGS"),
        (["--", "python"], "python: no script to run"),
        (["--", "python", "-m"], "python -m: -m names no module"),
    ],
)
def test_a_command_that_is_not_a_script_is_one_error(args, error):
    result = CliRunner().invoke(main, ["check", *args])
    assert result.exit_code == 1 and result.output.strip().splitlines()[-1] == f"Error: {error}"


def test_a_script_that_fails_on_its_own_is_one_error(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("import torch\nx = torch.ones(2, device='cuda')\nraise ValueError('no data folder here')\n")
    result = CliRunner().invoke(main, ["check", "--", "python", str(script)])
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == f"Error: {script}: ValueError: no data folder here"


def test_an_hf_trainer_script_runs_unmodified(tmp_path):
    """A Trainer script with TrainingArguments from its command line: its optimizer steps are counted, the loss it
    logs reads 0 by the data rule (and is counted), and the program fits."""
    script = str(SCRIPTS / "hf_trainer.py")
    args = ["--output_dir", str(tmp_path), "--max_steps", "5", "--per_device_train_batch_size", "4",
            "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]  # fmt: skip
    result = check("--gpu", "H100", "--json", "--", "python", script, *args)
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert answer["fits"] and answer["steps_run"] == 3 and answer["finished"] == "stopped"
    assert answer["data_dependent"].get("aten._local_scalar_dense", 0) > 0
    assert answer["peak_allocated"] > 0


def test_a_script_that_watches_its_own_memory_gets_the_fake_gpus_answers(tmp_path):
    """_record_memory_history, reset_peak_memory_stats, max_memory_allocated, mem_get_info and _dump_snapshot, as an
    unmodified script calls them: the snapshot it dumps is the program so far, and memplan imports it back."""
    snapshot = tmp_path / "memory.pickle"
    result = check("--gpu", "H100", "--json", "--", "python", str(SCRIPTS / "memory_report.py"), "--snapshot",
                   str(snapshot))  # fmt: skip
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    printed = re.findall(r"max_memory_allocated ([\d,]+) B, free ([\d,]+) of ([\d,]+) B", result.stderr)
    assert len(printed) == 2 and all(int(total.replace(",", "")) == gpu("H100").memory for *_, total in printed)
    assert int(printed[-1][0].replace(",", "")) <= answer["peak_allocated"]
    imported = CliRunner().invoke(
        main, ["import", str(snapshot), "-o", str(tmp_path / "memory.trace.json.gz"), "--json"]
    )
    assert imported.exit_code == 0 and json.loads(imported.stdout)["buffers"] > 0


FSDP2_SCRIPT = str(SCRIPTS / "fsdp2_train.py")


@pytest.fixture(scope="module")
def fsdp2_single():
    """The FSDP2 script checked as one process (`--nproc 1`): its answer, read by each world size's case."""
    return json.loads(check("--gpu", "H100", "--json", "--nproc", "1", "--", FSDP2_SCRIPT).stdout)


@pytest.mark.parametrize("ranks", [2, 8])
def test_an_fsdp2_torchrun_script_runs_its_ranks_on_the_fake_process_group(ranks, fsdp2_single):
    """`torchrun --nproc-per-node N SCRIPT`: each rank in a process of its own on the fake process group (the script
    asks for NCCL), the first and last compared; FSDP2 shards the parameters, so more ranks hold less each, and NCCL's
    buffers are among the outside terms."""
    script = FSDP2_SCRIPT
    result = check("--gpu", "H100", "--json", "--", "torchrun", f"--nproc-per-node={ranks}", script)
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert answer["fits"] and answer["world_size"] == ranks and answer["ranks"] == [0, ranks - 1]
    assert answer["alike"] is True and answer["steps_run"] == 3
    assert any(t["name"].startswith("NCCL") for t in answer["budget"]["outside"])
    assert answer["peak_allocated"] < fsdp2_single["peak_allocated"]  # the shards: less per rank than one process holds


@pytest.mark.parametrize(
    "command,error",
    [
        (["torchrun", "--nproc-per-node", "x", "a.py"], "--nproc-per-node 'x': a number of processes"),
        (["torchrun", "--nnodes", "2", "--nproc-per-node", "2", "a.py"], "--nnodes 2: memplan check runs one node"),
        (["torchrun", "--nproc-per-node", "2"], "the launcher names no script"),
    ],
)
def test_a_launcher_command_it_cannot_run_is_one_error(command, error):
    result = CliRunner().invoke(main, ["check", "--", *command])
    assert result.exit_code == 1 and error in result.output.strip().splitlines()[-1]


@pytest.mark.slow
def test_accelerates_batch_search_settles_at_most_at_fits_answer_for_the_same_step():
    """accelerate's find_executable_batch_size, from just above the batch `memplan fit` gives for the same step (the
    script is its model file too), steps down as the fake H100 raises out-of-memory errors and settles at fit's
    answer or a little below: its failed attempts (AdamW's state made among the larger batch's leftovers) are its
    program's history, which a fresh program does not have."""
    script = str(SCRIPTS / "find_batch_size.py")
    fitted = CliRunner().invoke(main, ["fit", script, "--gpu", "H100", "--seq", "1024", "--layers", "as-built",
                                       "--capture", "fake", "--json"])  # fmt: skip
    assert fitted.exit_code == 0, fitted.output
    answer = json.loads(fitted.stdout)["modes"][0]["caching"]["batch"]
    result = check("--gpu", "H100", "--steps", "50", "--json", "--", "python", script, "--start", str(answer + 1))
    assert result.exit_code == 0, result.output
    tried = [int(b) for b in re.findall(r"trying batch (\d+)", result.stderr)]
    settled = int(re.search(r"three steps run at batch (\d+)", result.stderr).group(1))
    assert (
        tried[0] == answer + 1 and settled == tried[-1] and len(json.loads(result.stdout)["failures"]) == len(tried) - 1
    )
    assert 0.95 * answer <= settled <= answer


def test_cpu_data_decides_the_shapes_the_fake_gpu_sees(tmp_path):
    """CPU work runs for real under check: a DataLoader (two worker processes, pinned memory) pads each batch to its
    longest sequence on the CPU, so the batches the script prints are those of a plain run of it (on this CPU), and
    the program copies exactly those batches to the GPU (ids int64, mask bool). The loss the script branches on
    reads 0 by the data rule, and the line is named, once a step."""
    plain = subprocess.run([sys.executable, str(PADDED), "--steps", "3"], capture_output=True, text=True, check=True)
    shapes = re.findall(r"step \d+: batch \((\d+), (\d+)\), (\d+) tokens", plain.stdout)
    assert len(shapes) == 3
    output = tmp_path / "program.json.gz"
    result = check("--gpu", "H100", "--json", "-o", str(output), "--", "python", str(PADDED), "--workers", "2")
    assert result.exit_code == 0, result.output
    assert re.findall(r"step \d+: batch \((\d+), (\d+)\), (\d+) tokens", result.stderr) == shapes
    copies = [int(size) for size, op in zip(load(output).program.trace.size, load(output).program.trace.op)
              if op == "aten::_to_copy"]  # fmt: skip
    for batch, longest, _ in shapes:
        assert {int(batch) * int(longest) * 8, int(batch) * int(longest)} <= set(copies)
    answer = json.loads(result.stdout)
    line = next(n for n, text in enumerate(PADDED.read_text().splitlines(), 1) if "if loss.item() >" in text)
    assert [(Path(b["where"].rsplit(":", 1)[0]).name, b["where"].rsplit(":", 1)[1], b["times"]) for b in
            answer["branches"]] == [("padded_batches.py", str(line), 3)]  # fmt: skip
    assert answer["cpu"]["real_ops"] > 0 and not answer["cpu"]["over_limit"]
    assert f"padded_batches.py:{line} (3 times)" in render_check(answer)


def test_a_cpu_tensor_over_the_limit_is_fake_and_counted_and_a_models_weights_stay_fake(tmp_path):
    """--cpu-limit: a CPU factory larger than the limit is fake from the start, an op's real output larger than it is
    made fake as it returns, each counted by op; a module's parameters and buffers, built in its __init__ on the CPU
    or registered later from a real tensor, are fake (they will move to the GPU), while the script's small CPU
    tensors are real."""
    script = tmp_path / "big.py"
    script.write_text(
        "import torch\n"
        "from torch._subclasses.fake_tensor import FakeTensor\n"
        "kind = lambda t: 'fake' if isinstance(t, FakeTensor) else 'real'\n"
        "small, big = torch.arange(10), torch.arange(1 << 20)\n"
        "grown = torch.ones(1000).repeat(1000)\n"
        "model = torch.nn.Linear(8, 8)\n"
        "model.register_buffer('scale', torch.ones(8))\n"
        "print('small', kind(small), 'big', kind(big), 'grown', kind(grown), 'weight', kind(model.weight),\n"
        "      'buffer', kind(model.scale))\n"
        "print('sum', int(small.sum()))\n"
        "model = model.cuda()\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(3):\n"
        "    model(torch.ones(2, 8).cuda()).sum().backward()\n"
        "    optimizer.step()\n"
    )
    result = check("--gpu", "H100", "--cpu-limit", "1MiB", "--json", "--", "python", str(script))
    assert result.exit_code == 0, result.output
    assert "small real big fake grown fake weight fake buffer fake" in result.stderr and "sum 45" in result.stderr
    answer = json.loads(result.stdout)
    assert answer["cpu"]["limit"] == 1 << 20 and answer["cpu"]["over_limit"] == {"aten.arange": 1, "aten.repeat": 1}
    assert "CPU tensors over the limit of 1.0 MiB made fake (--cpu-limit): aten.arange x1, aten.repeat x1" in (
        render_check(answer)
    )
    assert answer["branches"] == []


ACCELERATE = str(SCRIPTS / "accelerate_loop.py")
TINY_LLAMA = str(SCRIPTS.parent / "configs" / "tiny-llama.json")


def test_an_accelerate_loop_runs_unmodified_and_its_printed_peak_is_memplans():
    """An Accelerate loop (prepare, accumulate, backward, bf16 from its command line): the optimizer steps counted
    are the real ones (accelerate skips the step between accumulated micro-batches), and the max_memory_allocated it
    prints after its last whole step is the program's peak allocated."""
    args = ["--config", TINY_LLAMA, "--seq", "32", "--mixed-precision", "bf16", "--accumulate", "2", "--steps", "6"]
    result = check("--gpu", "H100-80GB", "--json", "--", "python", ACCELERATE, *args)
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert answer["fits"] and answer["finished"] == "stopped" and answer["steps_run"] == 3
    printed = [int(x.replace(",", "")) for x in re.findall(r"max_memory_allocated ([\d,]+) B", result.stderr)]
    assert len(printed) == 2 and printed[-1] == answer["peak_allocated"]  # steps 0 and 1 print; step 2 is stopped


@pytest.mark.slow
def test_the_accelerate_loops_peaks_are_those_of_memplans_own_trace_of_the_same_step(tmp_path):
    """Where the two are the same program (fp32, no accumulation: a forward whose outputs are held through the step,
    the loss, backward, AdamW), the Accelerate loop's peaks under check are those of memplan's own fake CUDA trace of
    the config's step, simulated on the caching allocator. (With bf16, accelerate keeps an fp32 copy of the logits,
    which memplan's model-file step does not make.)"""
    trace = tmp_path / "step.json.gz"
    traced = CliRunner().invoke(main, ["trace", TINY_LLAMA, "--fake", "--device", "cuda", "--batch", "2", "--seq", "32",
                                       "--layers", "as-built", "-o", str(trace)])  # fmt: skip
    assert traced.exit_code == 0, traced.output
    simulated = CliRunner().invoke(main, ["simulate", str(trace), "--json"])
    assert simulated.exit_code == 0, simulated.output
    caching = json.loads(simulated.stdout)["caching"]
    args = ["--config", TINY_LLAMA, "--seq", "32", "--accumulate", "1", "--mixed-precision", "no"]
    result = check("--gpu", "H100-80GB", "--json", "--", "python", ACCELERATE, *args)
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert (answer["peak_allocated"], answer["peak_reserved"]) == (caching["peak_allocated"], caching["peak_reserved"])


def test_the_accelerate_loop_runs_plainly_on_the_cpu():
    """The same script, no memplan: python runs it on this CPU at a tiny size, bf16 autocast and all."""
    args = ["--config", TINY_LLAMA, "--seq", "16", "--mixed-precision", "bf16", "--steps", "2"]
    done = subprocess.run([sys.executable, ACCELERATE, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert re.findall(r"step (\d+): loss \d", done.stdout) == ["0", "1"] and "max_memory_allocated" not in done.stdout


@pytest.mark.slow
def test_accelerate_launch_runs_two_ranks_of_the_accelerate_loop():
    """`accelerate launch --num_processes 2`: two ranks on the fake process group, DDP wrapped by prepare, the
    DataLoader sharded (its generator's state broadcast moves nothing: each rank keeps its own)."""
    args = ["--config", TINY_LLAMA, "--seq", "32", "--mixed-precision", "bf16"]
    result = check("--gpu", "H100-80GB", "--json", "--", "accelerate", "launch", "--num_processes", "2", ACCELERATE,
                   *args)  # fmt: skip
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert answer["fits"] and answer["world_size"] == 2 and answer["ranks"] == [0, 1] and answer["alike"] is True
    assert answer["steps_run"] == 3 and any(t["name"].startswith("NCCL") for t in answer["budget"]["outside"])


SPAWN = str(SCRIPTS / "spawn_ddp.py")
SMALL_SPAWN = ["--world-size", "2", "--hidden", "64", "--vocab", "1024", "--seq", "32"]


@pytest.mark.slow
def test_a_script_that_spawns_its_own_ranks_runs_each_on_the_fake_process_group():
    """`--nproc 2` for a script that calls torch.multiprocessing.spawn: each rank is a process memplan starts, whose
    spawn runs that rank's function there (init_process_group joins the fake process group, DDP all-reduces nothing);
    the first and last ranks compared, NCCL's buffers among the outside terms."""
    result = check("--gpu", "H100-80GB", "--nproc", "2", "--json", "--", "python", SPAWN, *SMALL_SPAWN)
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert answer["fits"] and answer["world_size"] == 2 and answer["ranks"] == [0, 1] and answer["alike"] is True
    assert answer["steps_run"] == 3 and answer["finished"] == "stopped" and answer["peak_allocated"] > 0
    assert any(t["name"].startswith("NCCL") for t in answer["budget"]["outside"])


@pytest.mark.parametrize(
    "nproc,error",
    [
        ([], "Error: this script spawns 2 ranks; give --nproc 2"),
        (["--nproc", "3"], "Error: rank 0 of 3: this script spawns 2 ranks; give --nproc 2 (--nproc 3 was given)"),
    ],
)
def test_a_script_that_spawns_ranks_it_was_not_told_of_is_one_error(nproc, error):
    result = CliRunner().invoke(main, ["check", *nproc, "--", "python", SPAWN, *SMALL_SPAWN])
    assert result.exit_code == 1 and result.output.strip().splitlines()[-1] == error
    assert sum(line.startswith("Error:") for line in result.output.splitlines()) == 1


@pytest.mark.slow
def test_the_spawning_script_runs_plainly_on_the_cpu():
    """The same script, no memplan: two CPU processes, gloo, DDP."""
    args = [*SMALL_SPAWN, "--steps", "2"]
    done = subprocess.run([sys.executable, SPAWN, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert re.findall(r"step (\d+): loss \d", done.stdout) == ["0", "1"]


NOT_FOLLOWED = """
import torch
from torch import nn
from torch.utils.cpp_extension import load_inline

@torch.library.custom_op("memplan_test::{op}", mutates_args=())
def fused_act(x: torch.Tensor) -> torch.Tensor:
    return x.relu()

try:
    twice = load_inline(name="my_kernels", cpp_sources="", cuda_sources="", functions=["twice"]).twice
except {extension_caught}:
    twice = lambda x: x * 2

model = torch.compile(nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).cuda())
head = nn.Linear(64, 64).cuda()
head.compile()

@torch.compile(mode="max-autotune")
def loss_of(x):
    return x.square().mean()

optimizer = torch.optim.AdamW([*model.parameters(), *head.parameters()])
for _ in range(5):
    hidden = head(model(torch.randn(8, 64, device="cuda")))
    try:
        hidden = fused_act(hidden)
    except {op_caught}:
        hidden = hidden.relu()
    loss_of(twice(hidden)).backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def test_compiled_code_runs_eager_and_what_cannot_run_is_named(tmp_path):
    """torch.compile (a module, Module.compile, a decorator with options) returns what it was given: the program runs
    eager and the answer says so; an extension load_inline would build and a custom op with no fake kernel are not
    run, and a script that catches their errors and goes on has them named in its answer."""
    from memplan.planner.report.check_text import render_check

    script = tmp_path / "compiled.py"
    script.write_text(NOT_FOLLOWED.format(op="act_caught", extension_caught="ImportError",
                                          op_caught="NotImplementedError"))  # fmt: skip
    result = check("--gpu", "H100-80GB", "--json", "--", "python", str(script))
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert answer["fits"] and answer["steps_run"] == 3
    assert answer["compiled_eager"] == ["Sequential", "Linear", "loss_of"]
    assert answer["not_run"] == ["extension my_kernels", "op memplan_test::act_caught"]
    text = render_check(answer)
    assert "torch.compile ran eager (compiled graphs need real tensors): Sequential, Linear, loss_of" in text
    assert "the program went on without: extension my_kernels, op memplan_test::act_caught" in text


@pytest.mark.parametrize(
    "caught,error",
    [
        ({"op": "act_uncaught1", "extension_caught": "ValueError", "op_caught": "ValueError"},
         "extension my_kernels (torch.utils.cpp_extension.load_inline) is not built under memplan check: its kernels "
         "would need real tensors"),
        ({"op": "act_uncaught2", "extension_caught": "ImportError", "op_caught": "ValueError"},
         "op memplan_test::act_uncaught2 has no fake (meta) kernel, so it cannot run on fake tensors under memplan "
         "check (give it one with torch.library.register_fake)"),
    ],
)  # fmt: skip
def test_an_extension_or_op_that_cannot_run_is_one_error(tmp_path, caught, error):
    script = tmp_path / "uncaught.py"
    script.write_text(NOT_FOLLOWED.format(**caught))
    result = CliRunner().invoke(main, ["check", "--", "python", str(script)])
    assert result.exit_code == 1 and result.output.strip().splitlines()[-1] == f"Error: {script}: {error}"


NUMPY_METRIC = """
import torch
model = torch.nn.Linear(16, 4).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    out = model(torch.randn(8, 16, device="cuda"))
    out.square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    for refused in (lambda: out.numpy(), lambda: out.detach().numpy(), lambda: out.detach().cpu().bfloat16().numpy()):
        try:
            refused()
        except (RuntimeError, TypeError) as e:
            print("refused:", str(e).split(".")[0])
    predictions = out.detach().cpu().numpy()
    print("metric", predictions.shape, predictions.dtype, float((predictions.argmax(-1) == 0).mean()))
"""


def test_numpy_of_a_fake_tensor_reads_zeros_by_the_data_rule_and_refuses_what_pytorch_refuses(tmp_path):
    """A metric computed in numpy from the model's output (`out.detach().cpu().numpy()`) reads the data rule's zeros
    in the output's shape and dtype, counted as a read; what PyTorch refuses (a tensor that needs grad, one on the GPU,
    bfloat16) is refused with PyTorch's words."""
    script = tmp_path / "numpy_metric.py"
    script.write_text(NUMPY_METRIC)
    result = check("--gpu", "H100", "--json", "--", "python", str(script))
    assert result.exit_code == 0, result.output
    assert result.stderr.count("metric (8, 4) float32 1.0") == 2
    refusals = [line for line in result.stderr.splitlines() if line.startswith("refused:")][:3]
    assert refusals == ["refused: Can't call numpy() on Tensor that requires grad",
                        "refused: can't convert cuda:0 device type tensor to numpy",
                        "refused: Got unsupported ScalarType BFloat16"]  # fmt: skip
    assert json.loads(result.stdout)["data_dependent"]["Tensor.numpy"] == 2
