"""Record real CUDA memory snapshots of training steps: the project's own ground truth (../shared/GPU_CHECKS.md, 1).

Usage, on a CUDA machine: python benchmarks/record_snapshots.py OUT [--only NAME,...] [--jobs N]
Each recording in RECORDINGS runs in a process of its own (a fresh CUDA context, one GPU): memplan builds the model
file's workload on cuda:0 as every command does (seed 0, the step's dtype and layer mode; the distributed ones in a
one-rank NCCL process group), runs one warm-up step, then records one step (`Workload.step`: forward, loss, backward,
PyTorch's AdamW with its CUDA defaults, gradients set to None) with `torch.cuda.memory._record_memory_history`
(Python stacks) and dumps it to OUT/NAME.pickle; the cache is not emptied, as a training loop does not. Then one
more step runs from an emptied cache (as memplan's simulator starts). OUT/NAME.json says how the snapshot was made
and what torch.cuda counted: tests/test_cuda_snapshots.py reads both, so a machine without a GPU checks
`--fake --device cuda` against them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Recording:
    """One recorded training step: the model file and the step's shape, as `memplan trace` options name them."""

    model_file: str  # under the repository, e.g. examples/bert.py or examples/configs/tiny-llama.json
    batch: int
    seq: int
    dtype: str  # memplan's --dtype: float32, bfloat16 or bf16-mixed (fp32 parameters, bf16 autocast)
    layers: str = "as-built"  # memplan's --layers
    env: dict = field(default_factory=dict)  # the model file's environment (MEMPLAN_PRESET, ...)
    nproc: int = 0  # 1: the model file shards or replicates over a one-rank NCCL process group
    warmup: bool = True  # a warm-up step before the recorded one; False: the first step is recorded


SMALL_LLAMA = "examples/configs/small-llama.json"  # 4 layers of hidden 1024: SDPA's flash kernel, larger GEMMs
RECORDINGS = {
    **{
        f"{model}-tiny-{tag}": Recording(f"examples/{model}.py", 2, 128, dtype, env={"MEMPLAN_PRESET": "tiny"})
        for model in ("bert", "gpt2", "llama", "hf_bert", "hf_gpt2", "hf_llama")
        for tag, dtype in (("fp32", "float32"), ("bf16-mixed", "bf16-mixed"))
    },
    "bert-tiny-bf16": Recording("examples/bert.py", 2, 128, "bfloat16", env={"MEMPLAN_PRESET": "tiny"}),
    "bert-tiny-tempo-fp32": Recording("examples/bert.py", 2, 128, "float32", "tempo", {"MEMPLAN_PRESET": "tiny"}),
    "bert-tiny-selective-bf16-mixed": Recording(
        "examples/bert.py", 2, 128, "bf16-mixed", "selective", {"MEMPLAN_PRESET": "tiny"}
    ),
    "tiny-llama-config-fp32": Recording("examples/configs/tiny-llama.json", 2, 128, "float32"),
    "tiny-llama-config-bf16-mixed": Recording("examples/configs/tiny-llama.json", 2, 128, "bf16-mixed"),
    "small-llama-config-bf16-mixed": Recording(SMALL_LLAMA, 2, 1024, "bf16-mixed"),
    "small-llama-config-fp32": Recording(SMALL_LLAMA, 2, 1024, "float32"),
    "llama-tiny-fsdp2-fp32": Recording(
        "examples/llama_fsdp2.py", 2, 128, "float32", env={"MEMPLAN_PRESET": "tiny"}, nproc=1
    ),
    "llama-tiny-fsdp2-bf16": Recording(
        "examples/llama_fsdp2.py",
        2,
        128,
        "float32",
        env={"MEMPLAN_PRESET": "tiny", "MEMPLAN_FSDP_PRECISION": "bf16"},
        nproc=1,
    ),  # fmt: skip
    "gpt2-tiny-ddp-fp32": Recording("examples/gpt2_ddp.py", 2, 128, "float32", env={"MEMPLAN_PRESET": "tiny"}, nproc=1),
    "gpt2-tiny-first-step-fp32": Recording(
        "examples/gpt2.py", 2, 128, "float32", env={"MEMPLAN_PRESET": "tiny"}, warmup=False
    ),
    **{  # other architectures' HF configs, shrunk (tests/data/hf-configs): sliding windows, soft-capping, experts
        f"tiny-{arch}-{tag}": Recording(f"tests/data/hf-configs/tiny-{arch}.json", 2, 256, dtype)
        for arch in ("gemma2", "mistral", "phi3", "qwen2", "mixtral")
        for tag, dtype in (("fp32", "float32"), ("bf16-mixed", "bf16-mixed"))
    },
}


def counted(stats: dict) -> dict[str, int]:
    """What the caching allocator counts, now and at its peak: requested, allocated (block) and reserved bytes."""
    return {
        f"{kind}_{when}": int(stats[f"{kind}_bytes.all.{name}"])
        for kind in ("requested", "allocated", "reserved")
        for when, name in (("now", "current"), ("peak", "peak"))
    }


def record_one(name: str, out: Path, port: int) -> None:
    """Record RECORDINGS[name] in this process: OUT/NAME.pickle and OUT/NAME.json."""
    import torch
    import torch.distributed as dist

    from memplan.step import StepSpec
    from memplan.traces.inputs.model_file import build_workload, import_model_file

    recording = RECORDINGS[name]
    os.environ.update(recording.env)
    torch.cuda.set_device(0)
    if recording.nproc:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    step = StepSpec(str(ROOT / recording.model_file), recording.batch, recording.seq, recording.dtype,
                    device="cuda", mode=recording.layers)  # fmt: skip
    workload = build_workload(step, import_model_file(step.model_file))

    # Step 1: the warm-up (the optimizer's state is made), unless the first step is the one recorded.
    if recording.warmup:
        workload.step()
        torch.cuda.synchronize()

    # Step 2: recorded, from the cache the warm-up left.
    torch.cuda.reset_peak_memory_stats()
    before = counted(torch.cuda.memory_stats())
    torch.cuda.memory._record_memory_history(context="all", stacks="python", max_entries=1_000_000)
    loss = workload.step()
    torch.cuda.synchronize()
    after = counted(torch.cuda.memory_stats())
    torch.cuda.memory._dump_snapshot(str(out / f"{name}.pickle"))
    torch.cuda.memory._record_memory_history(enabled=None)

    # Step 3: from an emptied cache, as the simulator starts.
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    emptied_before = counted(torch.cuda.memory_stats())
    workload.step()
    torch.cuda.synchronize()
    emptied_after = counted(torch.cuda.memory_stats())

    properties = torch.cuda.get_device_properties(0)
    facts = {
        "recording": asdict(recording),
        "how": "memplan's build_workload on cuda:0, one warm-up Workload.step() (none when recording.warmup is "
        "false), then one step recorded with _record_memory_history(context='all', stacks='python') from the "
        "cache before it; one more step after empty_cache() gives from_empty_cache",
        "loss": float(loss),
        "recorded_step": {"at_start": before, "at_end": after},
        "from_empty_cache": {"at_start": emptied_before, "at_end": emptied_after},
        "gpu": properties.name,
        "capability": list(torch.cuda.get_device_capability(0)),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "transformers": _version("transformers"),
    }
    (out / f"{name}.json").write_text(json.dumps(facts, indent=1) + "\n")
    if recording.nproc:
        dist.destroy_process_group()


def _version(package: str) -> str | None:
    try:
        return __import__(package).__version__
    except ImportError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder for NAME.pickle and NAME.json")
    parser.add_argument("--only", default="", help="comma-separated names from RECORDINGS (default: all)")
    parser.add_argument("--jobs", type=int, default=4, help="recordings run at once, each a process of its own")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a worker: record this one name
    parser.add_argument("--port", type=int, default=29500, help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.one:
        record_one(args.one, out, args.port)
        return
    names = [name for name in args.only.split(",") if name] or list(RECORDINGS)
    unknown = set(names) - set(RECORDINGS)
    if unknown:
        sys.exit(f"record_snapshots: no recording named {', '.join(sorted(unknown))}")

    def run(indexed: tuple[int, str]) -> tuple[str, subprocess.CompletedProcess]:
        index, name = indexed
        command = [sys.executable, __file__, str(out), "--one", name, "--port", str(29600 + index)]
        return name, subprocess.run(command, capture_output=True, text=True)

    with ThreadPoolExecutor(args.jobs) as pool:
        for name, done in pool.map(run, enumerate(names)):
            if done.returncode:
                lines = done.stderr.strip().splitlines()
                print(f"{name}: FAILED: {lines[-1] if lines else done.returncode}", flush=True)
                continue
            facts = json.loads((out / f"{name}.json").read_text())
            step = facts["recorded_step"]["at_end"]
            size = (out / f"{name}.pickle").stat().st_size
            print(f"{name}: peak requested {step['requested_peak']:,}, allocated {step['allocated_peak']:,}, "
                  f"reserved {step['reserved_peak']:,}; {size:,} B", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
