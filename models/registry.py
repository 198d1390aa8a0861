"""The one place where model families are registered for the trainer and tools."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from pipekit.checkpoint.upcycle import Upcycler, UpcycleSpec

__all__ = ["ModelSpec", "get_model_spec", "register_model", "resolve_model"]


@dataclass(frozen=True)
class ModelSpec:
    """How to build a model family and move its weights in and out of Hugging Face layout."""

    name: str
    flavor: Callable[[str], Any]
    """Named flavor -> model args (raises ValueError listing the known flavors)."""
    build: Callable[[Any], nn.Module]
    """Model args -> module (call under `torch.device("meta")`, then `init_weights`)."""
    read_hf_args: Callable[[str], Any] | None = None
    """Hugging Face checkpoint directory -> model args (None: no Hugging Face layout yet)."""
    load_hf: Callable[[str, nn.Module, Any], None] | None = None
    """Copy a Hugging Face checkpoint into a materialised model."""
    save_hf: Callable[[nn.Module, Any, str], None] | None = None
    """Write a model (full, unsharded tensors) in Hugging Face layout."""
    check_hf_layout: Callable[[Any], None] | None = None
    """Raise ValueError (naming the fix) when models with these args have no Hugging Face
    layout, so a job finds out before it trains rather than when it exports."""
    upcycler: Upcycler | None = None
    """How a dense model of this family becomes a mixture of experts (None: it cannot)."""


_MODELS: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec) -> None:
    _MODELS[spec.name] = spec


def get_model_spec(name: str) -> ModelSpec:
    """The registered family `name`, with an error listing the known ones."""
    if not _MODELS:
        _register_builtin()
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {sorted(_MODELS)}")
    return _MODELS[name]


def resolve_model(
    name: str, flavor: str, upcycle: UpcycleSpec | None = None
) -> tuple[ModelSpec, Any]:
    """The family and args a job builds: `name`'s `flavor`, or the MoE `upcycle` makes of it."""
    spec = get_model_spec(name)
    args = spec.flavor(flavor)
    if upcycle is None:
        return spec, args
    if spec.upcycler is None:
        dense = sorted(known for known, candidate in _MODELS.items() if candidate.upcycler)
        raise ValueError(f"model {name!r} cannot be upcycled; upcycle one of {dense}")
    return get_model_spec(spec.upcycler.moe_model), spec.upcycler.moe_args(args, upcycle)


def _register_builtin() -> None:
    from models.llama import Llama, llama_flavor
    from models.llama.hf_config import read_hf_llama_args
    from models.llama.state_dict_adapter import load_hf_llama, save_hf_llama
    from models.llama_moe import LlamaMoE, llama_moe_flavor
    from models.llama_moe.hf_mixtral import (
        check_mixtral_compatible,
        load_hf_mixtral,
        read_hf_mixtral_args,
        save_hf_mixtral,
    )
    from models.llama_moe.upcycle import LLAMA_UPCYCLER

    register_model(
        ModelSpec(
            name="llama",
            flavor=llama_flavor,
            build=Llama,
            read_hf_args=read_hf_llama_args,
            load_hf=load_hf_llama,
            save_hf=lambda model, args, directory: save_hf_llama(
                model, args, directory, overwrite=True
            ),
            upcycler=LLAMA_UPCYCLER,
        )
    )
    register_model(
        ModelSpec(
            name="llama_moe",
            flavor=llama_moe_flavor,
            build=LlamaMoE,
            read_hf_args=read_hf_mixtral_args,  # Mixtral layout: every layer MoE
            load_hf=load_hf_mixtral,
            save_hf=lambda model, args, directory: save_hf_mixtral(
                model, args, directory, overwrite=True
            ),
            check_hf_layout=check_mixtral_compatible,
        )
    )
