"""Measurements: `python -m pipekit.bench <name>` prints a table and a final RESULT line."""
