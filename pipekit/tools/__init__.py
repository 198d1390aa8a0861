"""Command-line tools around a training job's outputs (`python -m pipekit.tools.<name>`)."""
