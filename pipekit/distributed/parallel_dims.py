"""Degrees of parallelism, validated against the world size, and the DeviceMesh they describe.

`ParallelDims.from_config` is pure arithmetic (no process group), so a bad config fails before
any rank waits on another. `build_mesh` then lays the ranks out in torchtitan's order
`pp, dp_replicate, dp_shard, cp, tp` (tp innermost: neighbouring ranks, i.e. one node, talk the
most) and keeps only the dims with degree > 1, plus these flattened helper meshes:

- `dp`          = dp_replicate x dp_shard: which slice of the global batch a rank reads;
- `dp_shard_cp` = dp_shard x cp: the dim FSDP shards parameters over (cp ranks hold the same
  parameters, so they share their shards too);
- `dp_cp`       = dp_replicate x dp_shard x cp: the ranks whose gradients are summed and whose
  token counts make the global count of the loss normalisation.

A helper exists when at least one of its dims is in the mesh. Slicing a flattened dim back out
of the root mesh is deprecated in torch, so every mesh is kept here and read with `mesh(name)`.

Expert parallelism adds no rank: the `ep` experts' ranks are borrowed from the ranks that hold
tokens of their own, the data-parallel, context-parallel and (under sequence parallelism, which
MoE with tp requires) tensor-parallel ranks (MoE parallel folding), so `ep` must divide
dp_replicate x dp_shard x cp x tp and does not enter the product. Its meshes are built with
the MoE layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipekit._torch_private import flatten_mesh
from pipekit.config.job_config import ParallelismConfig

__all__ = ["MESH_DIM_ORDER", "ParallelDims"]

MESH_DIM_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Outermost to innermost; their product is the world size."""

_CONFIG_KEYS = {"pp": "pipeline_parallel_degree"}
"""Mesh dims whose config key is spelled out."""

_CONFIG_ORDER = ("dp_replicate", "dp_shard", "cp", "tp", "pp")

_FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
    "cp_tp": ("cp", "tp"),
    "dp_cp_tp": ("dp_replicate", "dp_shard", "cp", "tp"),
}


@dataclass(frozen=True)
class ParallelDims:
    """Resolved degrees (all >= 1) whose product is `world_size`; after `build_mesh`, its meshes."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    etp: int = 1
    """Expert tensor parallelism: each expert's hidden dim over this many of the token ranks."""
    _meshes: dict[str, DeviceMesh] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size {self.world_size} must be >= 1")
        for name in (*MESH_DIM_ORDER, "ep", "etp"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"parallelism.{name}={getattr(self, name)} must be >= 1 once resolved; "
                    "use -1 (in the config) for 'the rest of the world size'"
                )
        product = math.prod(getattr(self, name) for name in MESH_DIM_ORDER)
        if product != self.world_size:
            raise ValueError(
                f"{_product_text(self._degrees())} = {product} != world size "
                f"{self.world_size}; set dp_shard=-1 (or another degree) to take the rest, or "
                f"launch {product} processes"
            )
        ranks_for_experts = self.dp_replicate * self.dp_shard * self.cp * self.tp
        if ranks_for_experts % (self.ep * self.etp):
            degree = f"ep={self.ep}" if self.etp == 1 else f"ep x etp = {self.ep * self.etp}"
            raise ValueError(
                f"parallelism.{degree} must divide dp_replicate x dp_shard x cp x tp = "
                f"{ranks_for_experts} (experts borrow the ranks that hold tokens); choose "
                f"among the divisors of {ranks_for_experts}"
            )

    @classmethod
    def from_config(cls, config: ParallelismConfig, world_size: int) -> ParallelDims:
        """Resolve the one degree that may be -1 to the rest of `world_size`, then validate."""
        degrees = {name: getattr(config, _CONFIG_KEYS.get(name, name)) for name in MESH_DIM_ORDER}
        for name, degree in (*degrees.items(), ("ep", config.ep), ("etp", config.etp)):
            if degree == 0 or degree < -1:
                raise ValueError(
                    f"parallelism.{_CONFIG_KEYS.get(name, name)}={degree} is invalid; use a "
                    "degree >= 1, or -1 for 'the rest of the world size'"
                )
        if config.ep == -1:
            raise ValueError(
                "parallelism.ep=-1 is not supported: ep is not part of the world-size product; "
                "set it to a divisor of dp_replicate x dp_shard x cp x tp"
            )
        unresolved = [name for name, degree in degrees.items() if degree == -1]
        if len(unresolved) > 1:
            raise ValueError(
                "parallelism: only one degree may be -1, got "
                f"{', '.join(_CONFIG_KEYS.get(name, name) for name in unresolved)}; "
                f"set all but one of them (world size {world_size})"
            )
        if unresolved:
            known = {name: degree for name, degree in degrees.items() if degree != -1}
            known_product = math.prod(known.values())
            if world_size % known_product:
                raise ValueError(
                    f"{_product_text(known)} = {known_product} does not divide world size "
                    f"{world_size}, so {_CONFIG_KEYS.get(unresolved[0], unresolved[0])}=-1 cannot "
                    "take the rest; choose degrees "
                    f"whose product divides {world_size}"
                )
            degrees[unresolved[0]] = world_size // known_product
        return cls(**degrees, ep=config.ep, world_size=world_size, etp=max(config.etp, 1))

    @staticmethod
    def smallest_world_size(config: ParallelismConfig) -> int:
        """The fewest ranks these degrees run on (a degree of -1 taking the least it can:
        enough data-parallel shards for `ep` to divide the ranks that hold tokens)."""
        degrees = {name: getattr(config, _CONFIG_KEYS.get(name, name)) for name in MESH_DIM_ORDER}
        fixed = {name: max(degree, 1) for name, degree in degrees.items()}
        token_ranks = math.prod(fixed[name] for name in ("dp_replicate", "dp_shard", "cp", "tp"))
        ep = max(config.ep, 1) * max(config.etp, 1)
        unresolved = [name for name, degree in degrees.items() if degree == -1]
        if unresolved and unresolved[0] != "pp":
            fixed[unresolved[0]] = ep // math.gcd(ep, token_ranks)
        return math.prod(fixed.values())

    def _degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_DIM_ORDER}

    @property
    def dp_degree(self) -> int:
        """Data-parallel ranks (replicas x shards): the global batch is split this many ways."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp_degree > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Whether parameters are sharded: over dp_shard x cp ranks (cp ranks share shards)."""
        return self.dp_shard * self.cp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        """Whether the experts are split over ranks (expert and/or expert tensor parallelism)."""
        return self.ep * self.etp > 1

    def dp_rank(self, mesh: DeviceMesh | None) -> int:
        """This rank's index among the `dp_degree` data-parallel ranks: which batch slice it reads.

        `mesh` is the world mesh from `build_mesh`; None (no mesh, e.g. a world of one) gives 0.
        """
        if mesh is None or not self.dp_enabled:
            return 0
        coordinate = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate(), strict=True))
        return coordinate.get("dp_replicate", 0) * self.dp_shard + coordinate.get("dp_shard", 0)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the world mesh and its flattened helpers; needs the default process group.

        Only dims with degree > 1 are kept; a world where every degree is 1 gets a 1-D
        `dp_shard` mesh of size 1, so there is always a mesh and a `dp` helper.
        """
        if not dist.is_initialized():
            raise RuntimeError(
                "ParallelDims.build_mesh needs the default process group; call "
                "pipekit.distributed.process_group.init_distributed() first (run under torchrun)"
            )
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"ParallelDims was resolved for world size {self.world_size} but the process "
                f"group has {dist.get_world_size()} ranks; resolve it with the group's world size"
            )
        shape = {name: degree for name, degree in self._degrees().items() if degree > 1}
        shape = shape or {"dp_shard": 1}
        world_mesh = init_device_mesh(
            device_type, tuple(shape.values()), mesh_dim_names=tuple(shape)
        )
        self._meshes.clear()
        self._meshes.update({name: world_mesh[name] for name in shape})
        for name, members in _FLATTENED.items():
            present = tuple(dim for dim in members if dim in shape)
            if present:
                self._meshes[name] = flatten_mesh(world_mesh[present], name)
        self._meshes["world"] = world_mesh
        return world_mesh

    def mesh(self, name: str) -> DeviceMesh:
        """The mesh of one dim, flattened helper, or `world`, built by `build_mesh`."""
        if not self._meshes:
            raise RuntimeError("no mesh yet: call ParallelDims.build_mesh(device_type) first")
        if name not in self._meshes:
            raise KeyError(
                f"no mesh named {name!r} (its degree is 1, so it is not a mesh dim); "
                f"available: {sorted(self._meshes)}"
            )
        return self._meshes[name]

    def has_mesh(self, name: str) -> bool:
        """Whether `build_mesh` made a mesh named `name` (a dim of degree > 1 or a helper)."""
        return name in self._meshes


def _product_text(degrees: dict[str, int]) -> str:
    """`dp_replicate=1 x dp_shard=2 x ...`, in the config's order, for error messages."""
    names = [name for name in _CONFIG_ORDER if name in degrees]
    return " x ".join(f"{_CONFIG_KEYS.get(name, name)}={degrees[name]}" for name in names)
