#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then runs the main job on the bundled default:
# a 2-layer slice of BERT-Large traced under every layer mode, solved and simulated, its tempo plan replayed.
# The report lands in memplan-out/ (report.md, timeline.png, address_space.png).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/memplan run -o memplan-out --seq 512 "$@"
