"""Checkpoints read by shape under a fake capture (traces/fake/checkpoints.py): torch.load, safetensors and
from_pretrained of local files give fake tensors of the stored layout, allocated where they are loaded, without
reading the tensor data; under `memplan check` a checkpoint saved tiny loads at full size, and a script that needs a
missing file or the network fails with its own error in one line."""

from __future__ import annotations

import gc
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from memplan.cli import main
from memplan.traces.capture import recording_session
from memplan.traces.fake.mode import is_fake

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "examples" / "scripts" / "finetune_checkpoint.py")
CONFIGS = ROOT / "examples" / "configs"
GiB = 1 << 30


def _config(name: str):
    fields = json.loads((CONFIGS / name).read_text())
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def _allocated(session) -> list[int]:
    """The sizes of the program's CUDA allocations so far, in order."""
    return [int(s) for s in session.program_so_far().trace.size]


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype, t.stride(), t.storage_offset()


def _saved_state(path: Path) -> dict:
    """A real checkpoint: a model's state dict (one tensor shared, one a view, one in float8), an optimizer's state
    after a step, and plain values."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 16)).sum().backward()
    optimizer.step()
    weights = dict(model.state_dict())
    weights |= {
        "tied": weights["0.weight"],
        "rows": weights["0.weight"][1:3],
        "f8": torch.zeros(4, 4).to(torch.float8_e4m3fn),
    }
    state = {"model": weights, "optimizer": optimizer.state_dict(), "epoch": 7, "name": "run-1"}
    torch.save(state, path)
    return torch.load(path)


def _storages(state: dict) -> list[int]:
    """The bytes of each storage the tensors of a loaded checkpoint hold (once each)."""
    tensors = [*state["model"].values(), *(t for s in state["optimizer"]["state"].values() for t in s.values())]
    return list({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("weights_only", [True, False])
def test_torch_load_gives_fake_cuda_tensors_of_the_stored_layout_allocated_as_on_a_gpu(tmp_path, weights_only):
    path = tmp_path / "state.pt"
    real = _saved_state(path)
    storages = _storages(real)
    with recording_session("cuda", fake=True) as session:
        loaded = torch.load(path, map_location="cuda", weights_only=weights_only)
        weights, key = loaded["model"], session._recorder.storage_key
        assert weights.keys() == real["model"].keys()
        for name, tensor in weights.items():
            assert is_fake(tensor) and tensor.device.type == "cuda"
            assert _layout(tensor) == _layout(real["model"][name]), name
        assert key(weights["0.weight"]) == key(weights["tied"]) == key(weights["rows"])  # one storage, as stored
        assert (loaded["epoch"], loaded["name"]) == (7, "run-1")
        assert loaded["optimizer"]["param_groups"] == real["optimizer"]["param_groups"]
        for i, state in loaded["optimizer"]["state"].items():
            assert {k: _layout(v) for k, v in state.items()} == {
                k: _layout(v) for k, v in real["optimizer"]["state"][i].items()
            }
        # each storage allocated once on the (fake) GPU, at its stored size
        assert sorted(_allocated(session)) == sorted(storages)
        del loaded, weights, name, tensor, state
        gc.collect()
        torch.empty(8, device="cuda")
    trace = session.program.trace
    assert all(f < trace.alloc[-1] for f in trace.free[:-1])  # dropped, the loaded storages are freed


def test_torch_load_keeps_the_stored_device_without_a_map_location(tmp_path):
    path = tmp_path / "state.pt"
    real = _saved_state(path)
    with recording_session("cuda", fake=True) as session:
        loaded = torch.load(path)
        assert all(is_fake(t) and t.device.type == "cpu" for t in loaded["model"].values())
        assert {k: _layout(t) for k, t in loaded["model"].items()} == {k: _layout(t) for k, t in real["model"].items()}
        assert _allocated(session) == []  # on the CPU: nothing on the GPU
        on_gpu = torch.load(path, map_location=lambda storage, location: storage.cuda())
        assert all(t.device.type == "cuda" for t in on_gpu["model"].values())
        assert sorted(_allocated(session)) == sorted(_storages(real))


def _sparse_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], int]], metadata=None) -> int:
    """A safetensors file of these tensors (name -> dtype, shape, bytes per element) whose data region is a hole: a
    real header, the file as long as the header says, and nothing written (a sparse file). Its length."""
    header, offset = {}, 0
    for name, (dtype, shape, size) in tensors.items():
        nbytes = size * int(torch.tensor(shape).prod()) if shape else size
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata is not None:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + offset)
    return 8 + len(text) + offset


def test_safetensors_are_read_by_their_header(tmp_path):
    """A 4 GiB safetensors file that is a hole past its header: safe_open, load_file, get_slice and torch.load of
    the path give fake tensors of the stored shapes on the device asked for, the CUDA ones allocated. (safe_open is
    named through its module: a name the program bound before the capture began is safetensors' own.)"""
    path = tmp_path / "big.safetensors"
    _sparse_safetensors(path, {"embed": ("BF16", (262144, 8192), 2), "norm": ("F32", (8192,), 4)}, {"format": "pt"})
    with recording_session("cuda", fake=True) as session:
        with safetensors.safe_open(path, framework="pt", device="cuda") as f:
            assert f.keys() == ["embed", "norm"] and f.metadata() == {"format": "pt"}
            embed = f.get_tensor("embed")
            part = f.get_slice("embed")[:1024, ::2]
            assert f.get_slice("norm").get_dtype() == "F32" and f.get_slice("embed").get_shape() == [262144, 8192]
        assert is_fake(embed) and embed.device.type == "cuda" and embed.dtype == torch.bfloat16
        assert tuple(part.shape) == (1024, 4096) and part.is_contiguous()
        assert _allocated(session) == [4 * GiB, 1024 * 4096 * 2]
        on_cpu = load_file(path)
        assert {k: (tuple(t.shape), t.dtype, t.device.type) for k, t in on_cpu.items()} == {
            "embed": ((262144, 8192), torch.bfloat16, "cpu"),
            "norm": ((8192,), torch.float32, "cpu"),
        }
        assert torch.load(path, map_location="cuda")["norm"].device.type == "cuda"
        with pytest.raises(safetensors.SafetensorError, match="File does not contain tensor"):
            safetensors.safe_open(path, framework="pt").get_tensor("lm_head")
        os.truncate(path, os.path.getsize(path) - 1)
        with pytest.raises(safetensors.SafetensorError, match="MetadataIncompleteBuffer"):
            load_file(path)
    real = tmp_path / "real.safetensors"
    save_file({"w": torch.ones(3, 5)}, real)
    assert torch.equal(load_file(real)["w"], torch.ones(3, 5))  # after the capture: safetensors' own again


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A tiny Llama in bf16 saved with save_pretrained (real weights, on the CPU)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config("tiny-llama.json"), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def _checkpoints(tiny: Path, tmp_path: Path, kind: str) -> Path:
    """The tiny Llama as save_pretrained wrote it, in shards with an index, or as pytorch_model.bin."""
    if kind == "safetensors":
        return tiny
    model = AutoModelForCausalLM.from_pretrained(tiny)
    folder = tmp_path / kind
    if kind == "sharded":
        model.save_pretrained(folder, max_shard_size="100KB")
        assert (folder / "model.safetensors.index.json").exists()
    else:
        folder.mkdir()
        model.config.save_pretrained(folder)
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return folder


@pytest.mark.parametrize("kind", ["safetensors", "sharded", "bin"])
def test_from_pretrained_builds_the_model_of_the_stored_shapes_with_fake_parameters(tiny_llama, tmp_path, kind):
    """from_pretrained of a local folder under a fake capture: the parameters the real load gives, by name, shape and
    dtype, each fake; moved to the GPU they are allocated there at their stored bytes."""
    folder = _checkpoints(tiny_llama, tmp_path, kind)
    real = {k: (tuple(p.shape), p.dtype) for k, p in AutoModelForCausalLM.from_pretrained(folder).named_parameters()}
    with recording_session("cuda", fake=True) as session:
        model = AutoModelForCausalLM.from_pretrained(folder)
        params = dict(model.named_parameters())
        assert {k: (tuple(p.shape), p.dtype) for k, p in params.items()} == real
        assert all(is_fake(p) for p in params.values())
        model.to("cuda")
        assert all(p.device.type == "cuda" for p in model.parameters())
        buffers = {b.untyped_storage().nbytes() for b in model.buffers()}  # rotary inv_freq: not in the checkpoint
        stored = sum(p.numel() * p.element_size() for p in params.values())
        moved = [s for s in _allocated(session) if s not in buffers]
        assert sum(moved) == stored and len(moved) == len(params)


def _check(*args: str):
    return CliRunner().invoke(main, ["check", *args], catch_exceptions=False)


def _loaded_line(text: str) -> tuple[int, int, str]:
    """The script's line `loaded DIR: N parameters, B B, [dtypes]`."""
    found = re.search(r"loaded .*: ([\d,]+) parameters, ([\d,]+) B, (\[.*\])", text)
    return int(found.group(1).replace(",", "")), int(found.group(2).replace(",", "")), found.group(3)


def test_a_checkpoint_saved_tiny_is_fine_tuned_under_check_as_plainly(tiny_llama):
    """The example script loads the tiny checkpoint with from_pretrained and trains: under `memplan check` its model
    has the real load's parameters, bytes and dtypes (what it prints), its CUDA program holds them, and plainly on the
    CPU it runs too."""
    real = AutoModelForCausalLM.from_pretrained(tiny_llama)
    stored = sum(p.numel() * p.element_size() for p in real.parameters())
    expected = (sum(p.numel() for p in real.parameters()), stored, "['torch.bfloat16']")
    result = _check("--gpu", "H100", "--json", "--", "python", SCRIPT, "--checkpoint", str(tiny_llama), "--seq", "32")
    assert result.exit_code == 0, result.output
    answer = json.loads(result.stdout)
    assert answer["fits"] and answer["steps_run"] == 3 and _loaded_line(result.stderr) == expected
    assert answer["peak_allocated"] >= 4 * stored  # weights, gradients and AdamW's two moments on the GPU
    plain = subprocess.run([sys.executable, SCRIPT, "--checkpoint", str(tiny_llama), "--seq", "32", "--steps", "1"],
                           capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    assert _loaded_line(plain.stdout) == expected and "step 0: loss" in plain.stdout


def _llama_8b_checkpoint(folder: Path) -> int:
    """A Llama-3-8B checkpoint as save_pretrained lays it out (config.json, model.safetensors in bf16) whose data is a
    hole (a sparse file of its full length); its length."""
    config = _config("llama-3-8b.json")
    config.dtype = torch.bfloat16
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tensors = {k: ("BF16", tuple(t.shape), 2) for k, t in model.state_dict().items()}
    folder.mkdir()
    config.save_pretrained(folder)
    return _sparse_safetensors(folder / "model.safetensors", tensors, {"format": "pt"})


MEASURE = """
import json, resource, sys
from memplan.gpus import gpu
from memplan.planner.jobs.check import CheckOptions, check_program

def read():
    return int(dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())["rchar"])

before, rss = read(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
result = check_program(CheckOptions(tuple(sys.argv[1:]), gpu("H200"), steps=1))
print(json.dumps({"read": read() - before, "rss": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) * 1024,
                  "fits": result.fits, "peak": result.peak_allocated}))
"""


@pytest.mark.slow
def test_a_checkpoint_saved_tiny_is_loaded_by_shape_only_at_a_large_one(tmp_path):
    """Issue 48's acceptance: the same script on a Llama-3-8B checkpoint (16 GB in bf16, a sparse file: reading its
    data would read zeros) under `memplan check`: the model is built at its full size from the header alone, the
    process reads far less than the file and grows by far less than it in memory, and the fine-tuning step is judged
    (weights, gradients and AdamW's moments: over 64 GB on the H200)."""
    folder = tmp_path / "llama-3-8b"
    size = _llama_8b_checkpoint(folder)
    assert size > 16 * 10**9
    command = [sys.executable, "-c", MEASURE, "python", SCRIPT, "--checkpoint", str(folder), "--seq", "64"]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT.parent)})
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert _loaded_line(done.stdout + done.stderr)[:2] == (8_030_261_248, 16_060_522_496)
    assert measured["read"] < 256 * 2**20 and measured["rss"] < GiB
    assert measured["fits"] and measured["peak"] > 4 * 16_060_522_496


@pytest.mark.parametrize(
    "source,error",
    [
        ("import torch\ntorch.load('{tmp}/nothere.pt', map_location='cuda')\n",
         "FileNotFoundError: [Errno 2] No such file or directory: '{tmp}/nothere.pt'"),
        ("from safetensors.torch import load_file\nload_file('{tmp}/nothere.safetensors')\n",
         "FileNotFoundError: [Errno 2] No such file or directory: '{tmp}/nothere.safetensors'"),
        ("from transformers import AutoModelForCausalLM\nAutoModelForCausalLM.from_pretrained('memplan/none')\n",
         "OSError: We couldn't connect to 'https://huggingface.co' to load the files"),
    ],
)  # fmt: skip
def test_a_missing_file_or_a_download_is_the_scripts_own_error_in_one_line(tmp_path, monkeypatch, source, error):
    """HuggingFace's hub is offline under check (unless the user set it): a model to download fails at once."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    script = tmp_path / "train.py"
    script.write_text(source.format(tmp=tmp_path))
    result = CliRunner().invoke(main, ["check", "--", "python", str(script)])
    assert result.exit_code == 1
    last = result.output.strip().splitlines()[-1]
    assert last.startswith(f"Error: {script}: {error.format(tmp=tmp_path)}"), last
    assert "HF_HUB_OFFLINE" not in os.environ
