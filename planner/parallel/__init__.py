"""Megatron-style tensor and sequence parallelism for the bundled GPT-2, its communication and its memory formulas."""
