"""The upcycling contract: what a dense model becomes (`UpcycleSpec`, Llama 3 meets MoE) and how
a dense family says it can become a mixture-of-experts family (`Upcycler`, on its `ModelSpec`).

The machinery that reads dense checkpoints block by block and fills or writes the MoE lives in
`pipekit.checkpoint.upcycle`; a family's upcycler plugs its names and layouts into it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipekit.config.job_config import UpcycleConfig

__all__ = ["UpcycleSpec", "Upcycler"]


@dataclass(frozen=True)
class UpcycleSpec:
    """What the dense model becomes: N copies (G pieces each) of every chosen FFN, top-k."""

    num_experts: int
    """Copies of each dense FFN (N); the MoE has N x granularity experts."""
    top_k: int
    """Copies each token is routed to (k); the MoE routes to k x granularity experts."""
    granularity: int = 1
    """Pieces each copy is cut into along the FFN hidden dim (G)."""
    capacity_factor: float | None = None
    """Expert capacity factor; None: dropless."""
    moe_every: int = 1
    """Every k-th layer (layers k-1, 2k-1, ...) becomes MoE; 1: all of them."""
    router: str = "topk_softmax"
    """Router of the MoE layers; only topk_softmax keeps the first forward equal to the dense."""
    router_init_std: float = 0.02
    """Std of the router's truncated-normal init (seeded by the job seed and layer name)."""

    @classmethod
    def from_config(cls, section: UpcycleConfig) -> UpcycleSpec:
        """The spec a job's `[model.upcycle]` section describes (ValueError naming the bad
        key)."""
        layers = section.layers
        if layers != "all" and not (isinstance(layers, int) and layers >= 1):
            raise ValueError(f'layers={layers!r} must be "all" or an integer k >= 1')
        return cls(
            num_experts=section.num_experts,
            top_k=section.top_k,
            granularity=section.granularity,
            capacity_factor=section.capacity_factor or None,
            moe_every=1 if layers == "all" else layers,
            router=section.router,
            router_init_std=section.router_init_std,
        )

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"upcycling needs num_experts >= 1 and 1 <= top_k <= num_experts; got "
                f"num_experts={self.num_experts}, top_k={self.top_k}"
            )
        problems = [
            f"{name}={value} must be {rule}"
            for name, value, rule, ok in (
                ("granularity", self.granularity, ">= 1", self.granularity >= 1),
                ("moe_every", self.moe_every, ">= 1 (every k-th layer)", self.moe_every >= 1),
                ("router_init_std", self.router_init_std, "> 0", self.router_init_std > 0),
                (
                    "capacity_factor",
                    self.capacity_factor,
                    "> 0, or None for dropless",
                    self.capacity_factor is None or self.capacity_factor > 0,
                ),
            )
            if not ok
        ]
        if problems:
            raise ValueError(f"upcycling: {'; '.join(problems)}")

    @property
    def total_experts(self) -> int:
        return self.num_experts * self.granularity

    @property
    def routed_experts(self) -> int:
        """Experts each token is routed to (k x G)."""
        return self.top_k * self.granularity

    def expert_hidden_dim(self, ffn_dim: int) -> int:
        """Hidden units of one expert; the dense FFN must split into G equal pieces."""
        if ffn_dim % self.granularity:
            raise ValueError(
                f"granularity={self.granularity} must divide the dense FFN hidden dim {ffn_dim}; "
                f"choose a divisor of {ffn_dim}"
            )
        return ffn_dim // self.granularity


@dataclass(frozen=True)
class Upcycler:
    """How a dense model family becomes a mixture-of-experts family (registered with the dense
    family's `ModelSpec`)."""

    moe_model: str
    """Registry name of the upcycled family."""
    moe_args: Callable[[Any, UpcycleSpec], Any]
    """(dense model args, spec) -> the upcycled model's args, with experts of the dense FFN's
    activation."""
    sources: Callable[..., dict[str, Any]]
    """(dense `SafetensorsCheckpoint`, upcycled args, spec, seed) -> a
    `pipekit.checkpoint.upcycle.BlockSource` for every parameter; ValueError for args whose
    experts are not copies of the dense FFN (another `MoEArgs.activation`)."""
    check_dense: Callable[..., None]
    """(dense checkpoint, dense args) -> CheckpointError unless the checkpoint is a dense model
    of those args; reads only config.json and the file headers (job validation uses it)."""
    hf_layout: Callable[..., tuple[dict[str, Any], dict[str, Any]]]
    """(sources, upcycled args) -> the upcycled family's Hugging Face tensors as
    `PendingTensor`s, produced on demand, and its config.json (offline upcycling)."""
