"""Memory planning before launch: `python -m pipekit.plan --config x.toml --world-size N`."""

from pipekit.plan.activations import ActivationProfile, profile_activations
from pipekit.plan.layout import RankLayout, rank_layouts
from pipekit.plan.memory import MemoryPlan, RankMemory, plan_memory

__all__ = [
    "ActivationProfile",
    "MemoryPlan",
    "RankLayout",
    "RankMemory",
    "plan_memory",
    "profile_activations",
    "rank_layouts",
]
