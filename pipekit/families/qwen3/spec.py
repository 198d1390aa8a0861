"""The Qwen3 and Qwen3-MoE families as pipekit sees them (registered through the
`pipekit.models` entry point). A dense Qwen3 upcycles into a Qwen3-MoE."""

from __future__ import annotations

from pipekit.families.decoder.model import DECODER_STRUCTURE, decoder_shape
from pipekit.families.decoder.upcycle import decoder_upcycler
from pipekit.families.qwen3.args import QWEN3_FLAVORS, QWEN3_MOE_FLAVORS, Qwen3Args, Qwen3MoEArgs
from pipekit.families.qwen3.hf import QWEN3_HF, QWEN3_MOE_HF
from pipekit.families.qwen3.model import Qwen3, Qwen3MoE
from pipekit.families.qwen3.parallelize import qwen3_tensor_parallel_plan
from pipekit.models.spec import ModelSpec

__all__ = ["QWEN3", "QWEN3_MOE"]

QWEN3 = ModelSpec(
    name="qwen3",
    flavors=QWEN3_FLAVORS,
    build=Qwen3,
    shape=decoder_shape,
    structure=DECODER_STRUCTURE,
    hf=QWEN3_HF.adapter(),
    upcycler=decoder_upcycler(QWEN3_HF, QWEN3_MOE_HF, "qwen3_moe", Qwen3Args, Qwen3MoEArgs),
    tensor_parallel_plan=qwen3_tensor_parallel_plan,
)

QWEN3_MOE = ModelSpec(
    name="qwen3_moe",
    flavors=QWEN3_MOE_FLAVORS,
    build=Qwen3MoE,
    shape=decoder_shape,
    structure=DECODER_STRUCTURE,
    hf=QWEN3_MOE_HF.adapter(),
    tensor_parallel_plan=qwen3_tensor_parallel_plan,
)
