"""memplan: a static memory planner and allocator simulator for training Transformers."""
