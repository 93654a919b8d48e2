"""Simulators: PyTorch's caching allocator (and its alloc conf), a plan's footprint, and the check of the
caching-allocator simulator against a real CUDA snapshot."""
