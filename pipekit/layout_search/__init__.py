"""Which layout is fastest and fits: `python -m pipekit.layout_search --config x.toml
--world-size N --device h100`, and `[parallelism] layout = "auto"`."""

from pipekit.layout_search.candidates import Layout, SearchSpace, apply_layout
from pipekit.layout_search.devices import DEVICE_PROFILES, DeviceProfile, device_profile
from pipekit.layout_search.search import Candidate, LayoutSearch, SearchResult, search_layouts
from pipekit.layout_search.step_time import StepPrediction

__all__ = [
    "DEVICE_PROFILES",
    "Candidate",
    "DeviceProfile",
    "Layout",
    "LayoutSearch",
    "SearchResult",
    "SearchSpace",
    "StepPrediction",
    "apply_layout",
    "device_profile",
    "search_layouts",
]
