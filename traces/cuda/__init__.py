"""The CUDA model: a fake CUDA device on any torch build, SDPA's kernel choice and buffers, CUDA streams."""
