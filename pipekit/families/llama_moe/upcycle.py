"""Upcycling a Hugging Face Llama checkpoint into pipekit's Llama-MoE (Mixtral layout on disk).

The shared decoder upcycler (`pipekit.families.decoder.upcycle`) with Llama's format as the
dense side and Mixtral's as the MoE side; `upcycle_llama` is the online path for user code.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from pipekit.checkpoint.safetensors_io import TensorRead
from pipekit.checkpoint.upcycle import upcycle_model
from pipekit.families.decoder.upcycle import decoder_upcycler
from pipekit.families.llama.args import LlamaArgs
from pipekit.families.llama.hf import LLAMA_HF
from pipekit.families.llama_moe.args import LlamaMoEArgs
from pipekit.families.llama_moe.hf_mixtral import MIXTRAL_HF
from pipekit.families.llama_moe.model import LlamaMoE
from pipekit.models.upcycling import Upcycler, UpcycleSpec

__all__ = ["LLAMA_UPCYCLER", "upcycle_llama", "upcycled_args"]

LLAMA_UPCYCLER: Upcycler = decoder_upcycler(
    LLAMA_HF, MIXTRAL_HF, "llama_moe", LlamaArgs, LlamaMoEArgs
)


def upcycled_args(dense: LlamaArgs, spec: UpcycleSpec) -> LlamaMoEArgs:
    """The Llama-MoE that `spec` makes of a dense Llama of shape `dense`."""
    return LLAMA_UPCYCLER.moe_args(dense, spec)


def upcycle_llama(
    directory: str | os.PathLike[str],
    spec: UpcycleSpec,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    parallelize: Callable[[LlamaMoE], object] | None = None,
    read_log: list[TensorRead] | None = None,
) -> tuple[LlamaMoE, LlamaMoEArgs]:
    """Online upcycling of a Hugging Face Llama directory into a `LlamaMoE` of `dtype`
    (`pipekit.checkpoint.upcycle.upcycle_model` with this family)."""
    return upcycle_model(
        directory,
        LLAMA_UPCYCLER,
        LLAMA_HF.read_args(directory),
        LlamaMoE,
        spec,
        seed=seed,
        dtype=dtype,
        device=device,
        parallelize=parallelize,
        read_log=read_log,
    )
