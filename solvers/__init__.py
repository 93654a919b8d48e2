"""Offset assignment: lower bounds, greedy heuristics, an exact search, CP-SAT, and the `auto` portfolio."""

from memplan.solvers.portfolio import METHODS, CapacityError, Progress, solve

__all__ = ["METHODS", "CapacityError", "Progress", "solve"]
