"""Replay of a plan through a real allocator (C++ core behind the CPU and CUDA allocators)."""
