"""Program inputs: the Workload type, model files, HuggingFace configs, `memplan.record`'s arguments, CUDA snapshots."""
