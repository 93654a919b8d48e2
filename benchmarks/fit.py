"""`memplan fit` at full size on fake traces: BERT-Large (24 layers) at 11 and 16 GiB, and HF Llama at the 7B
shape at 24, 40 and 80 GB.

Every figure is `planner.jobs.fit.fit_model`'s answer, checked by direct traces of the whole model (batch b fits,
b+1 does not, under the caching allocator simulated at the memory size and under a plan), on fake tensors:
nothing is allocated, so the 24-layer steps and the 7B steps trace in seconds on this machine. Weights,
gradients and AdamW state are in the model dtype (no fp32 master copy); there is no CUDA context or library
workspace. HF Llama runs as built (baseline): memplan's layer modes do not patch its modules yet.

Example: .venv/bin/python benchmarks/fit.py                 # both tables (about 15 minutes on 2 cores)
         .venv/bin/python benchmarks/fit.py --only llama    # the 7B rows
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from memplan.planner.jobs.fit import FitError, fit_model
from memplan.planner.layers import MODES
from memplan.units import parse_size

ROOT = Path(__file__).resolve().parents[1]

PAPER = (
    "Tempo paper (REFERENCE §2): BERT-Large pre-training up to 2x batch (4x RTX 2080 Ti 11 GB; "
    "4x V100 16 GB); README fine-tuning s=384: 2080 Ti fp32 4->6, fp16 8->11; V100 fp32 8->13, fp16 16->22"
)
BERT = {
    "file": ROOT / "examples" / "bert.py",
    "preset": "large",
    "memories": ("11GiB", "16GiB"),
    "dtypes": ("float32", "bfloat16"),
    "seqs": (128, 512),
    "modes": MODES,
}
LLAMA = {
    "file": ROOT / "examples" / "hf_llama.py",
    "preset": "7b",
    "memories": ("24GB", "40GB", "80GB"),
    "dtypes": ("bfloat16",),
    "seqs": (2048,),
    "modes": ("baseline",),
}


def fit_cell(spec: dict, memory: str, dtype: str, seq: int, mode: str, time_limit: float) -> tuple[str, str, int]:
    """One model, memory, dtype, sequence and mode: (caching batch, plan batch, traces), or why none fits."""

    def progress(message: str) -> None:
        print(f"    {message}", file=sys.stderr, flush=True)

    try:
        result = fit_model(
            str(spec["file"]),
            parse_size(memory),
            modes=(mode,),
            seq=seq,
            dtype=dtype,
            time_limit=time_limit,
            capture="fake",
            progress=progress,
        )
    except FitError as e:
        if "batch 1 needs" not in str(e):
            raise
        return "0", "0", 1  # batch 1 does not fit under either allocator model
    fit = result.modes[0]
    return str(fit.batch["caching"]), str(fit.batch["plan"]), fit.traces


def table(spec: dict, time_limit: float, start: float) -> list[list[str]]:
    """Rows dtype, seq, mode, then per memory (caching, plan) batches, then the traces taken."""
    os.environ["MEMPLAN_PRESET"] = spec["preset"]
    rows = []
    for dtype in spec["dtypes"]:
        for seq in spec["seqs"]:
            for mode in spec["modes"]:
                row, traces = [dtype, str(seq), mode], 0
                for memory in spec["memories"]:
                    caching, plan, n = fit_cell(spec, memory, dtype, seq, mode, time_limit)
                    row += [caching, plan]
                    traces += n
                    print(
                        f"  [{time.monotonic() - start:5.0f} s] {spec['file'].name} {dtype} s={seq} {mode} "
                        f"{memory}: caching {caching}, plan {plan}",
                        file=sys.stderr,
                        flush=True,
                    )
                rows.append(row + [str(traces)])
    return rows


def show(spec: dict, rows: list[list[str]]) -> None:
    header = ["dtype", "seq", "mode"] + [f"{a} {m}" for m in spec["memories"] for a in ("caching", "plan")] + ["traces"]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=("bert", "llama"), help="one of the two tables")
    ap.add_argument("--time-limit", type=float, default=2.0, help="seconds per solve [2]")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    start = time.monotonic()
    for name, spec in (("bert", BERT), ("llama", LLAMA)):
        if args.only not in (None, name):
            continue
        rows = table(spec, args.time_limit, start)
        print(
            f"largest batch, {spec['file'].name} MEMPLAN_PRESET={spec['preset']}, fake traces of the whole model "
            "(0: batch 1 does not fit):"
        )
        show(spec, rows)
    if args.only in (None, "bert"):
        print(PAPER)
    print(f"wall time {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
