"""Tensor parallelism, applied from outside the model with the family's plan.

`apply_tensor_parallel(model, tp_mesh, spec)` runs `parallelize_module` on every transformer
block with the plan its family gives (`ModelSpec.tensor_parallel_plan`), on the meta device,
before data parallelism (on a pipeline stage's module too; attention sees a rank's heads, so
context parallelism composes): FSDP2 then shards the tensor-parallel DTensors over its own dims (a
2-D `dp x tp` layout) and everything else as usual. Each tensor-parallel rank computes the
whole loss from the same batch, so the trainer counts a step's tokens and loss once per
tensor-parallel group. `check_tensor_parallel` names what a model's shape does not allow
before any process group exists.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from pipekit.models.spec import ModelShape, ModelSpec

__all__ = ["apply_tensor_parallel", "check_tensor_parallel"]


def check_tensor_parallel(spec: ModelSpec, shape: ModelShape, tp: int, moe: bool) -> None:
    """ValueError (naming the fix) unless `tp` ranks can split the model's heads and layers."""
    if moe:
        raise ValueError(
            f"tp={tp} with a mixture-of-experts model: tensor parallelism of MoE layers is not "
            "supported yet; set tp = 1 (use ep for the experts)"
        )
    if spec.tensor_parallel_plan is None:
        raise ValueError(
            f"tp={tp}: model {spec.name!r} has no tensor-parallel plan; set tp = 1 (a family "
            "gives one as ModelSpec.tensor_parallel_plan)"
        )
    problems = [
        f"{name}={value}"
        for name, value in (("n_heads", shape.num_heads), ("n_kv_heads", shape.num_kv_heads))
        if value % tp
    ]
    if problems:
        raise ValueError(
            f"tp={tp} must divide the model's heads ({', '.join(problems)}): every rank holds "
            "whole query heads with their key/value heads; choose tp among their common divisors"
        )


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, spec: ModelSpec) -> nn.Module:
    """Split every transformer block of `model` over `tp_mesh` by the family's plan; returns
    `model` (changed in place)."""
    assert spec.tensor_parallel_plan is not None  # check_tensor_parallel
    for block in spec.structure.blocks_of(model):
        parallelize_module(block, tp_mesh, dict(spec.tensor_parallel_plan(block)))
    return model
