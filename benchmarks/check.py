"""Wall time and host memory of `memplan check` on a Llama-3-8B-shaped HF training script (issue 48's target: under
2 minutes and under 4 GiB of host memory for bf16, sequence 4096, 3 steps, a fake H100).

Usage: .venv/bin/python benchmarks/check.py [--precision bf16|bf16-mixed|fp32] [--seq N] [--gpu NAME]
Runs `memplan check --gpu GPU --steps 3 --json -- python examples/scripts/hf_loop.py --config
examples/configs/llama-3-8b.json ...` in a child process and prints its answer, its wall time and the child's peak
resident memory (getrusage's ru_maxrss).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="bf16", choices=["bf16", "bf16-mixed", "fp32"])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--gpu", default="H100")
    args = parser.parse_args()
    command = [sys.executable, "-m", "memplan.cli", "check", "--gpu", args.gpu, "--steps", "3", "--json", "--",
               "python", str(ROOT / "examples" / "scripts" / "hf_loop.py"), "--config",
               str(ROOT / "examples" / "configs" / "llama-3-8b.json"), "--seq", str(args.seq), "--precision",
               args.precision]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    if done.returncode not in (0, 3):
        sys.exit(f"memplan check failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    answer = json.loads(done.stdout)
    verdict = "fits" if answer["fits"] else f"runs out of memory ({answer['failures'][-1]['where']})"
    shape = f"Llama-3-8B, {args.precision}, seq {args.seq}, {answer['steps_run']} steps, fake {answer['gpu']}"
    print(f"{shape}: {verdict}, peak reserved {answer['peak_reserved']:,} B")
    print(f"wall {seconds:.1f} s (target < 120), host peak RSS {rss / 2**30:.2f} GiB (target < 4)")


if __name__ == "__main__":
    main()
