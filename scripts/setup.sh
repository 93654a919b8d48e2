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
# Compile the C++ replay allocator now, so the first replay does not wait for it.
if .venv/bin/python -c "import planner.replay.build" 2>/dev/null; then
  .venv/bin/python -m planner.replay.build
fi
