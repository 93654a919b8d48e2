#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), checks lint and format (ruff), then runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
exec .venv/bin/python -m pytest -q "$@"
