"""The Llama family as pipekit sees it (registered through the `pipekit.models` entry point)."""

from __future__ import annotations

from pipekit.families.decoder.model import DECODER_STRUCTURE, decoder_shape
from pipekit.families.decoder.parallelize import decoder_tensor_parallel_plan
from pipekit.families.llama.args import LLAMA_FLAVORS
from pipekit.families.llama.hf import LLAMA_HF
from pipekit.families.llama.model import Llama
from pipekit.families.llama_moe.upcycle import LLAMA_UPCYCLER
from pipekit.models.spec import ModelSpec

__all__ = ["LLAMA"]

LLAMA = ModelSpec(
    name="llama",
    flavors=LLAMA_FLAVORS,
    build=Llama,
    shape=decoder_shape,
    structure=DECODER_STRUCTURE,
    hf=LLAMA_HF.adapter(),
    upcycler=LLAMA_UPCYCLER,
    tensor_parallel_plan=decoder_tensor_parallel_plan,
)
