"""The README's example of recording your own training loop runs as printed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_record_example_runs(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    (example,) = [b for b in blocks if "memplan.record(model, optimizer" in b]
    code = "import torch\ntorch.set_num_threads(1)\n" + example
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"peak live [\d,]+ B, plan arena [\d,]+ B \((optimal|feasible)\)", done.stdout)
    assert (tmp_path / "mine.trace.json.gz").exists()
