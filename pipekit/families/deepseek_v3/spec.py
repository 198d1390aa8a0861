"""The DeepSeek-V3 family as pipekit sees it (registered through the `pipekit.models` entry
point); on disk it is Hugging Face's DeepseekV3ForCausalLM layout. It has no tensor-parallel plan
yet: a job with tp > 1 is refused before launch."""

from __future__ import annotations

from pipekit.families.decoder.model import DECODER_STRUCTURE, decoder_shape
from pipekit.families.deepseek_v3.args import DEEPSEEK_V3_FLAVORS
from pipekit.families.deepseek_v3.hf import DEEPSEEK_V3_HF
from pipekit.families.deepseek_v3.model import DeepSeekV3
from pipekit.models.spec import ModelSpec

__all__ = ["DEEPSEEK_V3"]

DEEPSEEK_V3 = ModelSpec(
    name="deepseek_v3",
    flavors=DEEPSEEK_V3_FLAVORS,
    build=DeepSeekV3,
    shape=decoder_shape,
    structure=DECODER_STRUCTURE,
    hf=DEEPSEEK_V3_HF.adapter(),
)
