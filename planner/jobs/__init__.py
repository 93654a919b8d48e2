"""Jobs that chain the stages for a command: run (the main job), fit, and solving a file."""
