"""What tempo does to every causal LM the installed transformers ships, built tiny from its default config with
eager attention (tests/hf_tiny.py): the modules it swaps, what it leaves as built and why, and the bytes each
Transformer layer holds for backward, as built and under tempo (saved-tensor hooks, storages counted once).

    .venv/bin/python benchmarks/architectures.py            # every architecture, then the summary
    .venv/bin/python benchmarks/architectures.py llama gemma2 gpt_oss
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from hf_tiny import architectures, build, step  # noqa: E402

from memplan.planner.layers import patch  # noqa: E402


def per_layer(held: dict) -> float:
    """Mean bytes a Transformer layer holds for backward."""
    layers = [n for path, n in held.items() if path != "outside"]
    return statistics.mean(layers) if layers else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kinds", nargs="*", help="model types (default: every causal LM transformers ships)")
    kinds = parser.parse_args().kinds or architectures()
    torch.set_num_threads(1)
    swapped, savings, skipped = Counter(), [], 0
    for kind in kinds:
        try:
            model = build(kind, attention="eager")
            before = per_layer(step(model)[3])
        except Exception as error:  # noqa: BLE001 - the model itself does not run at these sizes
            skipped += 1
            print(f"{kind:28} skipped: {type(error).__name__}: {str(error).splitlines()[0][:90]}")
            continue
        report = patch(model, "tempo")
        after = per_layer(step(model)[3])
        if before != before:  # NaN: no list of Transformer layers to count per layer
            print(f"{kind:28} no list of Transformer layers: {', '.join(sorted({s.original for s in report.swapped}))}")
            continue
        savings.append(1 - after / before)
        kinds_swapped = sorted(
            {swap.replacement.split()[0].replace("memplan_tempo", "attention") for swap in report.swapped}
        )
        swapped.update(kinds_swapped)
        print(
            f"{kind:28} per layer {before:>9,.0f} B -> {after:>9,.0f} B ({-savings[-1]:+7.1%})  "
            f"{', '.join(kinds_swapped) or 'nothing swapped'}"
        )
        for note in report.notes:
            print(f"{'':28}   {note}")
    ran = len(kinds) - skipped
    print(f"\n{ran} architectures ran, {skipped} skipped; the share of them where tempo swapped:")
    for name, count in swapped.most_common():
        print(f"  {name:18} {count:4} ({count / ran:.0%})")
    print(
        f"per-layer bytes held under tempo against as built: median {-statistics.median(savings):+.1%}, "
        f"best {-max(savings):+.1%}, worst {-min(savings):+.1%}"
    )


if __name__ == "__main__":
    main()
