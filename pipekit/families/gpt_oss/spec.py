"""The gpt-oss family as pipekit sees it (registered through the `pipekit.models` entry point).
It has no tensor-parallel plan yet (the sinks would have to split with the heads): a job with
tp > 1 is refused before launch. Its Hugging Face format is `GptOssForCausalLM`'s
(`pipekit.families.gpt_oss.hf`)."""

from __future__ import annotations

from pipekit.families.decoder.model import DECODER_STRUCTURE, decoder_shape
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
)
