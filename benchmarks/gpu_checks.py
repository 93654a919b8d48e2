"""GPU checks (../shared/GPU_CHECKS.md) on a CUDA machine: capture against PyTorch's own counters, the CUDA
replay plugin, the memory-saving layers on CUDA, and a rank on NCCL. Prints every figure it compares.

Usage: python benchmarks/gpu_checks.py [capture] [replay] [layers] [parallel] [llama] [host] [cuda-traces]
       [--out DIR] [--jobs N]
With no part named, all of them. Captures and replays run memplan's CLI in processes of their own: a capture
starts from a fresh CUDA context, and the replay plugin must be installed before CUDA starts. The fidelity
check against the shared snapshots is benchmarks/fidelity.py, which adds a real CUDA row on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from memplan.planner.layers import MODES, patch
from memplan.planner.layers.memory import LlamaLayerShape
from memplan.planner.simulate.caching_allocator import simulate_caching
from memplan.planner.simulate.fidelity import reproduced, sizes_in_order
from memplan.planner.workloads import bert
from memplan.step import StepSpec
from memplan.traces.format import load
from memplan.traces.inputs.model_file import load_workload

ROOT = Path(__file__).resolve().parents[1]
BERT = str(ROOT / "examples" / "bert.py")
# (model file, preset, batch, seq) the capture check traces in every mode and dtype: the bundled BERT
# at two sizes; with --all-models, every other bundled single-process model file at its tiny preset too.
CAPTURE_SHAPES = [("bert", "tiny", 2, 128), ("bert", "base", 8, 512)]
OTHER_MODELS = [(name, "tiny", 2, 128) for name in ("gpt2", "llama", "hf_bert", "hf_gpt2", "hf_llama")]
DTYPES = ("float32", "bfloat16", "bf16-mixed")
PARTS = ["capture", "replay", "layers", "parallel", "llama", "host", "cuda-traces"]
# tests/data/cuda-traces: name -> (model file, its arguments to `memplan trace --device cuda`, ranks or 0)
CUDA_TRACES = {
    "llama-offload-bf16-mixed-s512": ("llama", ["--layers", "offload", "--dtype", "bf16-mixed", "--seq", "512"], 0),
    "llama-bf16-mixed-s512": ("llama", ["--dtype", "bf16-mixed", "--seq", "512"], 0),
    "llama-adamw-8bit": ("llama", ["--optimizer", "adamw-8bit"], 0),
    "llama-adamw": ("llama", [], 0),
    "gpt2-ddp-nccl1": ("gpt2_ddp", [], 1),
    "llama-fsdp2-nccl1": ("llama_fsdp2", ["--batch", "2", "--seq", "128"], 1),
}


def memplan(*args: str, preset: str = "tiny", env: dict | None = None) -> dict:
    """Run `memplan ARGS --json` in a process of its own; its JSON summary (or the error, one line)."""
    command = [sys.executable, "-m", "memplan.cli", *args, "--json"]
    done = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "MEMPLAN_PRESET": preset, **(env or {})}
    )
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return {"error": lines[-1] if lines else f"exit {done.returncode}"}
    return json.loads(done.stdout)


def share(value: int, reference: int) -> str:
    return f"{value:>14,} ({value - reference:+,})"


def check_capture(
    out: Path, jobs: int, shapes: list[tuple[str, str, int, int]], modes: list[str], dtypes: list[str]
) -> None:
    """1 and 2. Every layer mode and dtype of the model files traced on CUDA; the trace against what PyTorch
    counted over the same step (requested bytes), the simulator against it (block and reserved bytes, from an
    empty cache), and the --fake --device cuda prediction against the real trace."""
    configs = [(f, p, b, s, mode, dtype) for f, p, b, s in shapes for mode in modes for dtype in dtypes]

    def trace(config) -> tuple[tuple, dict, Path, Path]:
        model, preset, batch, seq, mode, dtype = config
        path = out / f"{model}-{preset}.{mode.replace('+', '-')}.{dtype}.trace.json.gz"
        fake = path.with_name("fake-" + path.name)
        model_file = str(ROOT / "examples" / f"{model}.py")
        args = ["trace", model_file, "--device", "cuda", "--layers", mode, "--dtype", dtype]
        args += ["--batch", str(batch), "--seq", str(seq)]
        memplan(*args, "--fake", "-o", str(fake), preset=preset)
        return config, memplan(*args, "-o", str(path), preset=preset), path, fake

    print("\n## 1. Capture on CUDA: the trace against torch.cuda's counters of the same step")
    print("peak requested: trace peak live vs requested_bytes.all.peak; peak allocated (blocks) and reserved:")
    print("caching-allocator simulator on the trace vs allocated_bytes / reserved_bytes peaks (cache emptied first)")
    with ThreadPoolExecutor(jobs) as pool:
        results = list(pool.map(trace, configs))
    for (model, preset, batch, seq, mode, dtype), summary, path, fake in results:
        label = f"{model} {preset} b={batch} s={seq} {mode} {dtype}"
        if "error" in summary:
            print(f"{label}: FAILED: {summary['error']}")
            continue
        measured = summary["cuda_measured"]
        trace = load(path)
        simulated = simulate_caching(trace)
        at_start = int(trace.size[trace.alloc == 0].sum())
        predicted = load(fake) if fake.exists() else None
        real_sizes = sizes_in_order(trace)
        prediction = (
            f"  --fake --device cuda peak {share(predicted.peak()[0], summary['peak_bytes'])}  in order "
            f"{reproduced(real_sizes, sizes_in_order(predicted)):,}/{len(real_sizes):,} of the real trace's allocations"
            if predicted is not None
            else "  --fake --device cuda: FAILED"
        )
        print(
            f"{label}\n"
            f"  at start  requested {share(at_start, measured['requested_at_start'])}  "
            f"real {measured['requested_at_start']:,}\n"
            f"  peak requested      {share(summary['peak_bytes'], measured['peak_requested'])}  "
            f"real {measured['peak_requested']:,}\n"
            f"  peak allocated sim  {share(simulated.peak_allocated, measured['peak_allocated'])}  "
            f"real {measured['peak_allocated']:,}\n"
            f"  peak reserved sim   {share(simulated.peak_reserved, measured['peak_reserved'])}  "
            f"real {measured['peak_reserved']:,} (real at start {measured['reserved_at_start']:,}, "
            f"sim at start {int(simulated.reserved[0]):,})\n{prediction}",
            flush=True,
        )


def step_seconds(model_file: str, preset: str, batch: int, seq: int, dtype: str, steps: int) -> list[float]:
    """Wall time of each of `steps` training steps on PyTorch's default caching allocator, after a warm-up."""
    os.environ["MEMPLAN_PRESET"] = preset
    workload = load_workload(StepSpec(model_file, batch, seq, dtype, device="cuda"))
    workload.step()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        workload.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


# (model file, preset, batch, seq, dtype) the replay check plans and replays on CUDA
REPLAYS = [
    ("bert", "tiny", 2, 128, "float32"),
    ("bert", "base", 8, 512, "float32"),
    ("bert", "tiny", 2, 128, "bfloat16"),
    ("bert", "base", 8, 512, "bf16-mixed"),
    ("llama", "tiny", 2, 128, "bf16-mixed"),
    ("hf_llama", "tiny", 2, 128, "bf16-mixed"),
    ("hf_gpt2", "tiny", 2, 128, "float32"),
]


def check_replay(out: Path, steps: int, only: set[str]) -> None:
    """3. Plans of the model files' steps replayed through the CUDA plugin: fallbacks, peak against the arena,
    bitwise equality, and step time against PyTorch's caching allocator."""
    print("\n## 3. Replay through the CUDA plugin")
    for model, preset, batch, seq, dtype in REPLAYS:
        model_file, name = str(ROOT / "examples" / f"{model}.py"), f"{model}-{preset}-{dtype}"
        if only and name not in only:
            continue
        trace, plan = out / f"replay-{name}.trace.json.gz", out / f"replay-{name}.plan.json"
        shape = ["--batch", str(batch), "--seq", str(seq), "--dtype", dtype]
        traced = memplan("trace", model_file, "--device", "cuda", *shape, "-o", str(trace), preset=preset)
        solved = memplan("solve", str(trace), "-o", str(plan), preset=preset) if "error" not in traced else traced
        if "error" in solved:
            print(f"{name}: FAILED before replay: {solved['error']}")
            continue
        report = memplan(
            "replay", str(plan), model_file, "--device", "cuda", "--trace", str(trace), "--steps", str(steps), *shape,
            preset=preset,
        )  # fmt: skip
        if "error" in report:
            print(f"{name}: replay FAILED: {report['error']}")
            continue
        plain = step_seconds(model_file, preset, batch, seq, dtype, steps)
        print(
            f"{name} b={batch} s={seq}: {report['steps']} steps, arena {report['arena_bytes']:,} B "
            f"(bound {report['bound']:,}), fallbacks {report['fallback_count']}, peak {report['peak_bytes']:,} B "
            f"(peak - arena {report['peak_bytes'] - report['arena_bytes']:+,}), bitwise equal "
            f"{report['bitwise_equal']} {report['first_difference'] or ''}\n"
            f"  median step: plan {statistics.median(report['plan_step_seconds']) * 1e3:.2f} ms, "
            f"cudaMalloc/cudaFree {statistics.median(report['reference_step_seconds']) * 1e3:.2f} ms, "
            f"PyTorch's caching allocator {statistics.median(plain) * 1e3:.2f} ms",
            flush=True,
        )


TOLERANCES = {torch.float32: (1e-4, 1e-6), torch.bfloat16: (2**-7, 2**-7)}  # the CPU tests' (rtol, atol)


def print_gradient_match(label: str, base: dict, other: dict, dtype: torch.dtype) -> None:
    """One line: the largest gradient difference of `other` from `base` and how many are within TOLERANCES."""
    rtol, atol = TOLERANCES[dtype]
    worst = max(((other[k] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item() for k, g in base.items())
    failed = [k for k, g in base.items() if not torch.allclose(other[k], g, rtol=rtol, atol=atol)]
    print(
        f"{label}: largest |diff| / max|grad| over parameters {worst:.2e}; "
        f"{len(base) - len(failed)}/{len(base)} within rtol {rtol:g} atol {atol:g}"
        + (f" (first outside: {failed[0]})" if failed else ""),
        flush=True,
    )


def gradients(mode: str, config: bert.BertConfig, batch: int, seq: int, dtype: torch.dtype) -> dict:
    """Parameter gradients of one forward and backward of the BERT under `mode`, with the same dropout masks."""
    workload = bert.build_workload(batch_size=batch, seq_len=seq, dtype=dtype, device="cuda", config=config)
    patch(workload.model, mode)
    torch.manual_seed(7)
    workload.loss_fn(workload.forward(), workload.inputs).backward()
    return {name: p.grad for name, p in workload.model.named_parameters() if p.grad is not None}


def check_layers(batch: int, steps: int) -> None:
    """4. Each mode's gradients against the baseline's on BERT-Large at s=512 (the CPU tests' tolerances),
    then memory per layer against the formulas and step times (benchmarks/layers.py on CUDA)."""
    print("\n## 4. Layers on CUDA: gradients against the baseline, BERT-Large shape, s=512")
    for dtype in TOLERANCES:
        base = gradients("baseline", bert.LARGE, batch, 512, dtype)
        for mode in (m for m in MODES if m != "baseline"):
            other = gradients(mode, bert.LARGE, batch, 512, dtype)
            print_gradient_match(f"{mode:>16} {str(dtype):>15} b={batch}", base, other, dtype)
        del base, other
        torch.cuda.empty_cache()
    layers = [sys.executable, str(ROOT / "benchmarks" / "layers.py"), "--device", "cuda", "--seqs", "512"]
    timing = ["--steps", str(steps), "--time-shape", "512", str(batch), "1024", "16", "24", "--time-dtype", "bf16"]
    subprocess.run([*layers, *timing], check=False)


def check_llama(steps: int) -> None:
    """6. HuggingFace Llama's layers on CUDA (RMSNorm, SwiGLU, checkpointing): each mode's gradients against the
    model as built, then bytes per layer against LlamaLayerShape and step times (benchmarks/layers.py --llama)."""
    from layers import llama_workload

    print("\n## 6. HF Llama layers on CUDA: gradients against the model as built, h 1024, 8 heads, 4 k/v heads")
    shape = LlamaLayerShape(s=512, b=2, h=1024, a=8, k=4, f=2816, p=4, device="cuda")
    for dtype in TOLERANCES:
        grads = {}
        for mode in MODES:
            workload = llama_workload(shape, 2, mode, dtype, "cuda")
            workload.loss_fn(workload.forward(), workload.inputs).backward()
            grads[mode] = {k: p.grad for k, p in workload.model.named_parameters() if p.grad is not None}
        base = grads.pop("as-built")
        for mode, other in grads.items():
            print_gradient_match(f"{mode:>16} {str(dtype):>15}", base, other, dtype)
        del grads, base
        torch.cuda.empty_cache()
    command = [sys.executable, str(ROOT / "benchmarks" / "layers.py"), "--llama", "--device", "cuda"]
    subprocess.run([*command, "--steps", str(steps)], check=False)


PARALLEL_FILES = {  # model file: its environment
    "gpt2_parallel.py": {},
    "llama_fsdp2.py": {},
    "llama_fsdp2.py bf16": {"MEMPLAN_FSDP_PRECISION": "bf16"},
    "gpt2_ddp.py": {},
}


def check_parallel(out: Path) -> None:
    """5. The distributed model files (tensor + sequence parallel GPT-2, FSDP2 Llama, DDP GPT-2) as one rank on
    NCCL: the trace's peak against what the caching allocator counted over the same step."""
    for label, env in PARALLEL_FILES.items():
        model_file = label.split()[0]
        print(f"\n## 5. Distributed: examples/{label}, --nproc 1 on NCCL")
        path = out / f"{label.replace(' ', '-')}.trace.json.gz"
        summary = memplan("trace", str(ROOT / "examples" / model_file), "--nproc", "1", "--device", "cuda",
                          "-o", str(path), env=env)  # fmt: skip
        if "error" in summary:
            print(f"FAILED: {summary['error']}")
            continue
        print(json.dumps(summary, indent=1)[:1500])


def check_host(steps: int) -> None:
    """A baseline and a tempo step (fused kernels) at GPT-2 small's shape, bf16: each step's wall time, and
    torch.profiler's host (CPU) and GPU (kernel) time of one step: a step whose host time exceeds its kernels' is
    host-bound, the GPU waiting on Python."""
    from tempo_kernels import build  # this folder's: the same model as its step-time benchmark

    print("\n## Host cost: wall, host and GPU kernel time of a step, GPT-2 small (12 layers, b 8, s 1024, bf16)")
    shape = argparse.Namespace(layers=12, seq=1024, batch=8, vocab=1024, dtype="bf16", device="cuda")
    for mode in ("baseline", "tempo"):
        workload = build(mode, shape)
        for _ in range(3):  # the optimizer's state, the kernels compiled
            workload.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            workload.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as profile:
            workload.step()
            torch.cuda.synchronize()
        events = profile.key_averages()
        totals = [line.strip() for line in events.table(row_limit=1).splitlines() if "time total" in line]
        reads = sum(e.count for e in events if e.key in ("aten::nonzero", "aten::_local_scalar_dense", "aten::item"))
        print(f"{mode}: wall {wall * 1e3:.1f} ms a step; {'; '.join(totals)}; host reads {reads}")
        print(events.table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))
        del workload
        torch.cuda.empty_cache()


def check_cuda_traces(out: Path) -> None:
    """The real CUDA traces tests/data/cuda-traces keeps (its README.md), written to OUT/cuda-traces under the
    same names: tests/test_cuda_traces.py compares a fake trace made on any machine with each."""
    print("\n## Real CUDA traces of the actions and NCCL ranks (tests/data/cuda-traces)")
    folder = out / "cuda-traces"
    folder.mkdir(parents=True, exist_ok=True)
    for name, (model, arguments, ranks) in CUDA_TRACES.items():
        path = folder / f"{name}.json.gz"
        launch = ["--nproc", str(ranks)] if ranks else []
        summary = memplan("trace", str(ROOT / "examples" / f"{model}.py"), "--device", "cuda", *launch, *arguments,
                          "-o", str(path))  # fmt: skip
        if "error" in summary:
            print(f"{name}: FAILED: {summary['error']}")
            continue
        if ranks:
            (folder / f"{name}.rank0.json.gz").replace(path)
        trace = load(path)
        measured = trace.meta.get("cuda_measured", {}).get("peak_requested", 0)  # none on a fake trace
        print(f"{name}: peak {trace.peak()[0]:,} B, requested_bytes.all.peak {measured:,} B -> {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="*", help=f"any of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--out", default="gpu-checks", help="folder for the traces and plans")
    parser.add_argument("--jobs", type=int, default=4, help="captures run at once (each a process of its own)")
    parser.add_argument("--all-models", action="store_true", help="capture every bundled model file, not BERT alone")
    parser.add_argument("--modes", default=",".join(MODES), help="the layer modes the capture check traces")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="the dtypes the capture check traces")
    parser.add_argument("--replays", default="", help="MODEL-PRESET-DTYPE names of REPLAYS to run (default: all)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of the replay and the layers")
    parser.add_argument("--batch", type=int, default=8, help="batch of the layers' BERT-Large at s=512")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_checks: no CUDA device here")
    parts = args.parts or PARTS
    if set(parts) - set(PARTS):
        sys.exit(f"gpu_checks: parts are {', '.join(PARTS)}, not {', '.join(sorted(set(parts) - set(PARTS)))}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    properties = torch.cuda.get_device_properties(0)
    print(f"{properties.name}, {properties.total_memory / 2**30:.1f} GiB, torch {torch.__version__}, CUDA "
          f"{torch.version.cuda}")  # fmt: skip
    if "capture" in parts:
        shapes = CAPTURE_SHAPES + OTHER_MODELS * args.all_models
        check_capture(out, args.jobs, shapes, args.modes.split(","), args.dtypes.split(","))
    if "replay" in parts:
        check_replay(out, args.steps, {name for name in args.replays.split(",") if name})
    if "layers" in parts:
        check_layers(args.batch, args.steps)
    if "parallel" in parts:
        check_parallel(out)
    if "llama" in parts:
        check_llama(args.steps)
    if "host" in parts:
        check_host(args.steps)
    if "cuda-traces" in parts:
        check_cuda_traces(out)


if __name__ == "__main__":
    main()
