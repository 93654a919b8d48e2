"""Traces: the memplan-trace/1 format, capture of a training step, import of CUDA snapshots."""

from memplan.traces.format import CATEGORIES, FORMAT, PHASES, Trace, load, make_trace, save

__all__ = ["CATEGORIES", "FORMAT", "PHASES", "Trace", "load", "make_trace", "save"]
