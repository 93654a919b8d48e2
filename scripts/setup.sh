#!/usr/bin/env bash
# Creates .venv and installs memplan with its test and HuggingFace extras.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[test,hf]"
# Compile the C++ parts now (plan allocator, CUDA plugin when a toolkit is there, solver kernels),
# so no command waits for them; without a compiler this stops with what to install.
.venv/bin/python -m memplan.planner.replay.build
# The HTML report's browser test (tests/test_html_report.py) drives a headless Chromium: install Debian's when
# it is missing and we can (root with apt-get); otherwise that test skips and says why.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium
fi
