"""gpt-oss: args and flavors, the model (attention sinks, alternating sliding-window layers,
biased experts with a clamped SwiGLU), and its Hugging Face format."""

from pipekit.families.gpt_oss.args import GPT_OSS_FLAVORS, GptOssArgs, gpt_oss_flavor
from pipekit.families.gpt_oss.model import GptOss

__all__ = ["GPT_OSS_FLAVORS", "GptOss", "GptOssArgs", "gpt_oss_flavor"]
