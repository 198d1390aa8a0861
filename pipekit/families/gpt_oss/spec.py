"""The gpt-oss family as pipekit sees it (registered through the `pipekit.models` entry point).
Its tensor-parallel plan is the decoder's (the biases split with their projections, the sinks
with their heads: `apply_tensor_parallel`). Its Hugging Face format is `GptOssForCausalLM`'s
(`pipekit.families.gpt_oss.hf`)."""

from __future__ import annotations

from pipekit.families.decoder.model import DECODER_STRUCTURE, decoder_shape
from pipekit.families.decoder.parallelize import decoder_tensor_parallel_plan
from pipekit.families.gpt_oss.args import GPT_OSS_FLAVORS
from pipekit.families.gpt_oss.hf import GPT_OSS_HF
from pipekit.families.gpt_oss.model import GptOss
from pipekit.models.spec import ModelSpec

__all__ = ["GPT_OSS"]

GPT_OSS = ModelSpec(
    name="gpt_oss",
    flavors=GPT_OSS_FLAVORS,
    build=GptOss,
    shape=decoder_shape,
    structure=DECODER_STRUCTURE,
    hf=GPT_OSS_HF.adapter(),
    tensor_parallel_plan=decoder_tensor_parallel_plan,
)
