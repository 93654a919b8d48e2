#!/usr/bin/env bash
# Captures the traces bundled in traces/data/ (run after scripts/setup.sh; about a minute on 2 cores):
# the main job's default step (a 2-layer slice of BERT-Large, batch 2, sequence 512, fp32) under each
# layer mode, and GPT-2 small (124M, batch 2, sequence 128) as baseline and tempo.
set -euo pipefail
cd "$(dirname "$0")/.."
out=traces/data
for mode in baseline tempo selective tempo+selective; do
  .venv/bin/memplan trace planner/workloads/bert_large_slice.py --batch 2 --seq 512 --layers "$mode" \
    -o "$out/bert_large_slice.b2s512.$mode.trace.json.gz" >/dev/null
done
for mode in baseline tempo; do
  MEMPLAN_PRESET=small .venv/bin/memplan trace examples/gpt2.py --batch 2 --seq 128 --layers "$mode" \
    -o "$out/gpt2_small.b2s128.$mode.trace.json.gz" >/dev/null
done
ls -l "$out"
