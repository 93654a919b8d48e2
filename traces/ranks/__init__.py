"""Distributed ranks: launching them, torch.distributed under a fake capture, what they communicate, rank families."""
