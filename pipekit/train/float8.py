"""FP8 training of the linear layers through torchao (`[training] float8`).

`apply_float8(module, recipe, structure, device_type)` swaps the model's `nn.Linear` layers for
torchao's `Float8Linear`: inputs, weights and output gradients are cast to float8 with
per-tensor ("tensorwise") or per-row ("rowwise") scales before each matmul, while the weights
stay in their own dtype (state-dict names and values unchanged: checkpoints, resume and
Hugging Face export see the same model). It runs on the meta device before tensor, expert and
data parallelism, as the other transforms do.

Left in high precision: the output layer (the logits want it), the routers' gates (their scores
pick experts), and any linear layer whose dims are not multiples of 16 (the float8 GEMM's
alignment). The grouped experts are parameters, not linear layers: they stay in the model's
dtype.

On CUDA (sm89+) the float8 GEMMs run on the tensor cores, and under FSDP2 the "tensorwise"
recipe all-gathers float8 weights. Elsewhere torchao emulates the casts and runs the matmuls in
high precision: the numerics of FP8 training, without its speed (what pipekit's CPU tests run).
"""

from __future__ import annotations

import dataclasses
import logging

from torch import nn

from pipekit.models.spec import ModelStructure

__all__ = ["FLOAT8_RECIPES", "apply_float8", "check_float8"]

logger = logging.getLogger(__name__)

FLOAT8_RECIPES = ("none", "tensorwise", "rowwise")
"""`[training] float8`'s choices: off, or torchao's recipe of that name."""

_ALIGNMENT = 16
"""The float8 GEMM needs both dims of a weight to be multiples of this."""

_ROUTER_GATES = ("router.gate", "router.noise_gate")


def check_float8(recipe: str, tensor_parallel: int) -> None:
    """ValueError naming the fix when `recipe` cannot run in this layout."""
    if recipe not in FLOAT8_RECIPES:
        raise ValueError(f"float8={recipe!r} is not one of {', '.join(FLOAT8_RECIPES)}")
    if recipe != "none" and tensor_parallel > 1:
        raise ValueError(
            f"float8={recipe!r} with tp={tensor_parallel}: pipekit's tensor-parallel plans do "
            "not use torchao's float8 styles yet; set tp = 1 or float8 = 'none'"
        )


def apply_float8(
    module: nn.Module, recipe: str, structure: ModelStructure, device_type: str
) -> list[str]:
    """Swap `module`'s eligible linear layers for float8 ones, in place; their names."""
    if recipe == "none":
        return []
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if device_type == "cuda":
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=recipe == "tensorwise")
    else:
        config = dataclasses.replace(config, emulate=True)
    converted: list[str] = []

    def eligible(layer: nn.Module, name: str) -> bool:
        keep = (
            isinstance(layer, nn.Linear)
            and name != structure.output
            and not name.endswith(_ROUTER_GATES)
            and layer.in_features % _ALIGNMENT == 0
            and layer.out_features % _ALIGNMENT == 0
        )
        if keep:
            converted.append(name)
        return keep

    convert_to_float8_training(module, config=config, module_filter_fn=eligible)
    return converted
