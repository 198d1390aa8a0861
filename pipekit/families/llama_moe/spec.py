"""The Llama-MoE family as pipekit sees it (registered through the `pipekit.models` entry
point); on disk it is Hugging Face's Mixtral layout."""

from __future__ import annotations

from pipekit.families.decoder.model import DECODER_STRUCTURE, decoder_shape
from pipekit.families.decoder.parallelize import decoder_tensor_parallel_plan
from pipekit.families.llama_moe.args import LLAMA_MOE_FLAVORS
from pipekit.families.llama_moe.hf_mixtral import MIXTRAL_HF
from pipekit.families.llama_moe.model import LlamaMoE
from pipekit.models.spec import ModelSpec

__all__ = ["LLAMA_MOE"]

LLAMA_MOE = ModelSpec(
    name="llama_moe",
    flavors=LLAMA_MOE_FLAVORS,
    build=LlamaMoE,
    shape=decoder_shape,
    structure=DECODER_STRUCTURE,
    hf=MIXTRAL_HF.adapter(),
    tensor_parallel_plan=decoder_tensor_parallel_plan,
)
