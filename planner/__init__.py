"""Everything between a trace and a verified plan: problem, plans, simulators, replay, layers, workloads."""
