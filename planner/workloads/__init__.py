"""Bundled plain-torch Transformer workloads (BERT, GPT-2) whose layers memplan measures and patches."""
