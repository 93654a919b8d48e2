"""What each command does, chaining the stages: trace, run (the main job), fit, solve a file, and the
commands over files (import, simulate, plot, compare)."""
