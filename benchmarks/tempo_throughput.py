"""Tempo's throughput experiment (NeurIPS 2022, its BERT-Large table): the batch each layer mode fits on one GPU by
memplan's own verdict, the samples per second at that batch on the GPU, and the step time of every mode at one
equal batch.

For each model (benchmarks/throughput_models.py: BERT-Large, a Llama layer stack; bf16, sequence 512):
1. `fit_model` (what `memplan fit --gpu NAME --capture fake` runs): the largest batch of each mode whose whole step
   runs on PyTorch's caching allocator simulated at the GPU's memory less what it holds outside the allocator, on
   fake traces made on this machine;
2. each mode built on the real device at that batch, timed (warm-up steps, then the median of timed ones), in
   samples per second; a batch the device runs out of memory at is said, then the next lower tried (at most
   --retries times, each 1/16 lower);
3. every mode timed at one equal batch, the as-built mode's largest (or --equal-batch), against as-built's time.

On a GPU machine (sized to run well inside 10 minutes of an H200: the fits take most of it, on its CPU):
    python benchmarks/tempo_throughput.py --gpu H200 --out throughput.json
On any machine, at a tiny size, to check it runs (tests/test_tempo_throughput.py):
    python benchmarks/tempo_throughput.py --device cpu --tiny
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from memplan.errors import MemplanError
from memplan.gpus import gpu
from memplan.modes import AS_BUILT, FULL, JOIN, SELECTIVE, TEMPO
from memplan.planner.cost import time_workloads
from memplan.planner.jobs.fit import fit_model
from memplan.step import StepSpec
from memplan.traces.inputs.model_file import load_workload
from memplan.units import parse_size

MODEL_FILE = str(Path(__file__).resolve().parent / "throughput_models.py")
MODES = (AS_BUILT, TEMPO, SELECTIVE, TEMPO + JOIN + SELECTIVE, FULL)
MODELS = {"bert-large": "bert-tiny", "llama-stack": "llama-tiny"}  # full size -> its tiny stand-in (--tiny)


@contextlib.contextmanager
def preset(name: str):
    """MEMPLAN_PRESET set to `name` for the block (the model file reads it at each build)."""
    before = os.environ.get("MEMPLAN_PRESET")
    os.environ["MEMPLAN_PRESET"] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("MEMPLAN_PRESET", None)
        else:
            os.environ["MEMPLAN_PRESET"] = before


def fit_one(name: str, step: StepSpec, mode: str, gpu_name: str | None, memory: str | None, time_limit: float):
    """One mode's largest batch of model `name` by memplan's verdict (`fit_model` on fake traces: the caching
    allocator at the GPU's budget), and the budget as a dict."""
    with preset(name):
        size = None if memory is None else parse_size(memory)
        named = None if gpu_name is None else gpu(gpu_name)
        try:
            result = fit_model(step, size, gpu=named, modes=(mode,), capture="fake", time_limit=time_limit)
        except MemplanError as e:  # no batch fits, or the search's cap: said, and the mode not timed
            return None, {"error": str(e)}
    budget = {"memory": result.memory, **({"gpu": result.budget.as_dict()} if result.budget is not None else {})}
    return result.modes[0].batch["caching"], budget


def largest_batches(name: str, step: StepSpec, args: argparse.Namespace, progress) -> tuple[dict[str, int], dict]:
    """Each mode's largest batch by memplan's verdict, the modes fitted in --jobs processes at once (each fit is
    a CPU's work: tens of fake traces of the whole step), and the fit's budget."""
    calls = [(name, step, mode, args.gpu, args.memory, args.time_limit) for mode in args.modes]
    progress(f"{name}: fitting {', '.join(args.modes)} on fake traces, {args.jobs} at once")
    if args.jobs <= 1:
        answers = [fit_one(*call) for call in calls]
    else:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter each: no CUDA state forked
        with ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
            answers = list(pool.map(fit_one, *zip(*calls)))
    budget = next((b for batch, b in answers if batch is not None), answers[0][1])
    budget["errors"] = {mode: b["error"] for mode, (batch, b) in zip(args.modes, answers) if batch is None}
    return {mode: batch for mode, (batch, _) in zip(args.modes, answers)}, budget


def release() -> None:
    """Free what a timed workload left: Python's cycles, then the caching allocator's unused blocks."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed(step: StepSpec, repeats: int, warmup: int) -> float:
    """The median seconds of one training step of `step` on real tensors (its workload built, then freed)."""
    workload = load_workload(step)
    try:
        return time_workloads({"step": workload}, device=step.device, repeats=repeats, warmup=warmup)["step"].median
    finally:
        del workload
        release()


def time_at(step: StepSpec, batch: int, args: argparse.Namespace, progress) -> dict:
    """Samples per second at `batch` (or the next lower batch the device runs, at most --retries lower)."""
    tried = []
    for _ in range(args.retries + 1):
        if batch < 1:
            break
        progress(f"{step.mode_name}: timing batch {batch}")
        try:
            seconds = timed(step.replace(batch=batch), args.repeats, args.warmup)
        except torch.OutOfMemoryError:
            release()
            tried.append(batch)
            batch -= max(1, batch // 16)
            continue
        return {"batch": batch, "seconds": seconds, "samples_per_second": batch / seconds, "ran_out_at": tried}
    return {"batch": None, "seconds": None, "samples_per_second": None, "ran_out_at": tried}


def run_model(model: str, args: argparse.Namespace, progress) -> dict:
    """One model's fits, timings at each largest batch and at the equal batch."""
    name = MODELS[model] if args.tiny else model
    with preset(name):
        step = StepSpec(MODEL_FILE, batch=1, seq=args.seq, dtype=args.dtype, device=args.device)
        start = time.monotonic()
        largest, budget = largest_batches(name, step, args, progress)
        fit_seconds = time.monotonic() - start
        rows = {}
        for mode in args.modes:
            capped = min(largest[mode] or 0, args.max_batch)
            rows[mode] = {"largest": largest[mode], "timed": time_at(step.replace(mode=mode), capped, args, progress)}
        equal = args.equal_batch or min(rows[AS_BUILT]["timed"]["batch"] or 1, args.max_batch)
        for mode in args.modes:
            progress(f"{mode}: timing the equal batch {equal}")
            try:
                rows[mode]["equal_seconds"] = timed(step.replace(mode=mode, batch=equal), args.repeats, args.warmup)
            except torch.OutOfMemoryError:
                release()
                rows[mode]["equal_seconds"] = None
    return {"model": name, "seq": args.seq, "dtype": args.dtype, "budget": budget, "fit_seconds": fit_seconds,
            "equal_batch": equal, "modes": rows}  # fmt: skip


def table(result: dict) -> str:
    """The model's table: each mode's largest batch, what ran, samples/s and against as-built, step time at the
    equal batch and against as-built."""
    rows, base = result["modes"], result["modes"][AS_BUILT]
    lines = [
        f"{result['model']}, s {result['seq']}, {result['dtype']}, memory {result['budget'].get('memory', 0):,} B "
        f"(fit on fake traces in {result['fit_seconds']:.0f} s)",
        *(f"{mode}: not fitted: {error}" for mode, error in result["budget"]["errors"].items()),
        f"{'mode':16s} {'fits':>6s} {'ran':>6s} {'samples/s':>10s} {'vs as-built':>12s} "
        f"{'step at b=' + str(result['equal_batch']):>14s} {'vs as-built':>12s}",
    ]
    for mode, row in rows.items():
        t = row["timed"]
        rate = t["samples_per_second"]
        base_rate = base["timed"]["samples_per_second"]
        ran = "-" if t["batch"] is None else str(t["batch"])
        rate_cells = f"{'-':>10s} {'-':>12s}" if rate is None else f"{rate:10.2f} {rate / (base_rate or rate):11.3f}x"
        equal, base_equal = row["equal_seconds"], base["equal_seconds"]
        equal_cells = f"{'out of memory':>14s} {'-':>12s}" if equal is None else f"{equal * 1e3:11.1f} ms "
        if equal is not None:
            equal_cells += f"{equal / base_equal:11.3f}x" if base_equal else f"{'-':>12s}"
        fits = "-" if row["largest"] is None else str(row["largest"])
        lines.append(
            f"{mode:16s} {fits:>6s} {ran:>6s} {rate_cells} {equal_cells}"
            + (f"  (ran out at {t['ran_out_at']})" if t["ran_out_at"] else "")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gpu", default=None, help="the GPU fitted to (default with --device cuda: H200)")
    parser.add_argument("--memory", default=None, help="fit this size instead of a GPU's (--device cpu: 48MiB)")
    parser.add_argument("--tiny", action="store_true", help="the tiny stand-ins of the models (a CPU check)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps a point (the median counts)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (optimizer state, kernels)")
    parser.add_argument("--retries", type=int, default=2, help="lower batches tried after running out of memory")
    parser.add_argument("--max-batch", type=int, default=4096, help="the largest batch timed")
    parser.add_argument("--equal-batch", type=int, default=0, help="the equal batch (default: as-built's largest)")
    parser.add_argument("--time-limit", type=float, default=1.0, help="the plan solver's seconds per fit trace")
    parser.add_argument("--jobs", type=int, default=min(10, os.cpu_count() or 1), help="fits run at once")
    parser.add_argument("--out", default=None, help="write every figure here as JSON")
    args = parser.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    if AS_BUILT not in args.modes:
        args.modes.insert(0, AS_BUILT)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("tempo_throughput: no CUDA device here (--device cpu --tiny checks the script)")
        args.gpu = args.gpu or "H200"
        torch.backends.cuda.matmul.allow_tf32 = True
    elif args.memory is None and args.gpu is None:
        args.memory = "48MiB"

    def progress(message: str) -> None:
        print(f"  [{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"{device}, torch {torch.__version__}, fitted to {args.gpu or args.memory}, {time.strftime('%Y-%m-%d')}")
    results = []
    for model in [m for m in args.models.split(",") if m]:
        results.append(run_model(model, args, progress))
        print(table(results[-1]), flush=True)
    if args.out:
        document = {"device": device, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "models": results}
        Path(args.out).write_text(json.dumps(document, indent=1))


if __name__ == "__main__":
    main()
