"""`python -m pipekit.check --config x.toml`: a job's model under every parallel layout against
one process (float64, loss and every gradient), before training it."""

from pipekit.check.layouts import LAYOUTS, Layout, PlannedLayout, plan_layout, run_layouts

__all__ = ["LAYOUTS", "Layout", "PlannedLayout", "plan_layout", "run_layouts"]
