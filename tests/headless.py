"""Open a memplan HTML report in headless Chromium and read back the checks its page script writes into the DOM
(`#selftest`: console errors, drawn elements, the tooltip after a synthetic hover); shared by the browser test and
benchmarks/html_report.py."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def find_browser() -> str | None:
    """The first headless-capable Chromium on PATH (scripts/setup.sh installs Debian's), or None."""
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def selftest(browser: str, page: str | Path, timeout: float = 120.0) -> tuple[dict, float]:
    """The page's self-test document after it loaded in headless Chromium, and the browser's wall seconds."""
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--window-size=1400,1200",
             "--virtual-time-budget=60000"]  # fmt: skip
    with tempfile.TemporaryDirectory() as profile:
        start = time.monotonic()
        done = subprocess.run(
            [browser, *flags, f"--user-data-dir={profile}", "--dump-dom", Path(page).resolve().as_uri() + "#selftest"],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        seconds = time.monotonic() - start
    found = re.search(r'<pre id="selftest"[^>]*>(.*?)</pre>', done.stdout, re.S)
    if done.returncode or not found or not found.group(1).strip():
        raise RuntimeError(f"no self-test from {browser} (exit {done.returncode}): {done.stderr[-2000:]}")
    return json.loads(html.unescape(found.group(1))), seconds
