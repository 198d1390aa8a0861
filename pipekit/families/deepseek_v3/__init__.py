"""DeepSeek-V3: args and flavors, the model (multi-head latent attention, shared and routed
experts with a bias-balanced sigmoid router), and its Hugging Face format."""

from pipekit.families.deepseek_v3.args import (
    DEEPSEEK_V3_FLAVORS,
    DeepSeekV3Args,
    deepseek_v3_flavor,
)
from pipekit.families.deepseek_v3.model import DeepSeekV3

__all__ = ["DEEPSEEK_V3_FLAVORS", "DeepSeekV3", "DeepSeekV3Args", "deepseek_v3_flavor"]
