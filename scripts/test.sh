#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), checks lint and format (ruff), then runs the whole test suite.
# setup.sh (pip, about a minute) runs again only when pyproject.toml or setup.sh changed since it last succeeded:
# the install is editable, so source changes need no reinstall (C++ parts rebuild on first use).
# The fast lane: scripts/test.sh -m "not slow". With no arguments, the whole suite runs on two workers (pytest-xdist,
# one per core), then the tests marked serial alone: they time the solver against an idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.setup-done
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ]; then
  bash scripts/setup.sh
  touch "$stamp"
fi
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
.venv/bin/python -m pytest -q -n 2 -m "not serial"
exec .venv/bin/python -m pytest -q -m serial
