"""Memory planning before launch: `python -m pipekit.memory_plan --config x.toml --world-size N`."""

from pipekit.memory_plan.activations import ActivationProfile, profile_activations
from pipekit.memory_plan.layout import RankLayout, rank_layouts
from pipekit.memory_plan.memory import MemoryPlan, RankMemory, plan_memory

__all__ = [
    "ActivationProfile",
    "MemoryPlan",
    "RankLayout",
    "RankMemory",
    "plan_memory",
    "profile_activations",
    "rank_layouts",
]
