"""FSDP2 units that return views train exactly, and FSDP2 does not warn about them.

`nn.Linear` with a bias returns a view on a 3-D input (the rows are multiplied flat and viewed
back), so a model with a biased output projection, or a block that ends in one, hands FSDP2 a
view; FSDP2 warns, and an in-place op on that view would drop the hook that all-gathers the
unit's parameters for backward. pipekit hands FSDP2 an alias that is no view instead. Checked
on one group of 2 ranks: (1) blocks and a head that end in biased Linears, whose outputs the
forward and the loss change in place, under sharding and under replication: every gradient
equals one process's and no warning; (2) the example model with a biased output projection,
one step each under FSDP, context and expert parallelism: each equals one process's step
(float64, 1e-10) and FSDP2 does not warn. Without the alias, (1) fails in backward when
sharded and leaves the gradients unreduced when replicated, and both warn."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import examples.custom_model.model as custom
from pipekit.config.job_config import ParallelismConfig
from pipekit.distributed.fsdp import apply_data_parallel
from pipekit.distributed.parallel_dims import ParallelDims
from pipekit.models import ModelSpec
from pipekit.testing import (
    data_parallel_step,
    full_gradient,
    max_relative_difference,
    parity_batch,
    reference_step,
    run_on_ranks,
)

TOLERANCE = 1e-10
VIEW_WARNING = "FSDP2-wrapped module"
"""How FSDP2's warning about a unit that returned a view begins."""
DIM, ROWS, SEQ_LEN = 8, 4, 16
ARGS = custom.TinyGPTArgs(dim=32, n_layers=2, n_heads=2, vocab_size=61, max_seq_len=32)
LAYOUTS = {"fsdp": {}, "cp": {"cp": 2}, "ep": {"ep": 2}}
"""Each layout's `data_parallel_step` keywords on 2 ranks."""
REFERENCE_MICROBATCHES = {"fsdp": 2, "cp": 1, "ep": 2}
"""The row blocks one process runs for each layout: one per data-parallel rank."""


class _BiasedProjection(nn.Module):
    """A block that ends in a biased Linear: its output is a view."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x_BSD: Tensor) -> Tensor:
        return self.proj(x_BSD)


class _InPlaceModel(nn.Module):
    """Blocks and a head whose outputs are views, each block's output scaled in place."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_BiasedProjection() for _ in range(2))
        self.head = nn.Linear(DIM, 3)

    def forward(self, x_BSD: Tensor) -> Tensor:
        for block in self.blocks:
            h_BSD = block(x_BSD)
            h_BSD.mul_(2.0)  # in place on a unit's output
            x_BSD = torch.tanh(h_BSD)
        return self.head(x_BSD)


def _in_place_model() -> nn.Module:
    torch.manual_seed(0)
    return _InPlaceModel().double()


def _in_place_gradients(model: nn.Module, x_BSD: Tensor) -> dict[str, Tensor]:
    """The gradients of a loss that also changes the model's output in place."""
    out_BSO = model(x_BSD)
    out_BSO.add_(1.0)
    (out_BSO**2).sum().backward()
    return {name: full_gradient(p.grad) for name, p in model.named_parameters()}


class _BiasedHeadGPT(custom.TinyGPT):
    """The example model with a biased output projection (Falcon's, GPT-J's)."""

    def __init__(self, args: custom.TinyGPTArgs) -> None:
        super().__init__(args)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=True)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        super().init_weights(seed)
        if self.lm_head is not None:
            nn.init.zeros_(self.lm_head.bias)


BIASED_HEAD = dataclasses.replace(custom.TINY_GPT, name="biased_head_gpt", build=_BiasedHeadGPT)


def _batch() -> Any:
    return parity_batch(ARGS.vocab_size, ROWS, SEQ_LEN)


def _steps(rank: int, world: int, spec: ModelSpec) -> dict[str, Any]:
    """Every check's result on this rank, with FSDP2's view warnings recorded; the in-place
    runs last, their errors reported (without the alias, backward fails there)."""
    generator = torch.Generator().manual_seed(1)
    x_BSD = torch.randn(2 * world, 5, DIM, dtype=torch.float64, generator=generator)
    results: dict[str, Any] = {"reference": _in_place_gradients(_in_place_model(), x_BSD)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, layout in LAYOUTS.items():
            results[name] = data_parallel_step(rank, world, spec, ARGS, _batch(), **layout)
        for name, config in (
            ("sharded", ParallelismConfig(dp_shard=-1)),
            ("replicated", ParallelismConfig(dp_replicate=-1, dp_shard=1)),
        ):
            dims = ParallelDims.from_config(config, world)
            model = _in_place_model()
            mesh, exact = dims.build_mesh("cpu"), torch.float64
            apply_data_parallel(
                model, mesh, dims, blocks=model.blocks, param_dtype=exact, reduce_dtype=exact
            )
            rows = x_BSD.shape[0] // world
            try:
                results[name] = _in_place_gradients(model, x_BSD[rank * rows : (rank + 1) * rows])
            except RuntimeError as error:
                results[name] = f"backward failed: {error}"
    results["warnings"] = [str(w.message) for w in caught if VIEW_WARNING in str(w.message)]
    return results


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, Any]]:
    return run_on_ranks(_steps, 2, BIASED_HEAD, timeout=180)


def test_in_place_ops_on_view_outputs_of_fsdp_units_keep_exact_gradients(per_rank) -> None:
    for results in per_rank:
        want = results["reference"]
        for layout in ("sharded", "replicated"):
            assert isinstance(results[layout], dict), results[layout]
            for name, grad in results[layout].items():
                torch.testing.assert_close(grad, want[name], rtol=1e-12, atol=1e-12, msg=name)


def test_a_biased_output_projection_trains_exactly_without_view_warnings(per_rank) -> None:
    for results in per_rank:
        assert results["warnings"] == [], results["warnings"][:1]
    for layout, microbatches in REFERENCE_MICROBATCHES.items():
        reference = reference_step(BIASED_HEAD, ARGS, _batch(), microbatches=microbatches)
        difference = max_relative_difference([r[layout] for r in per_rank], reference)
        assert difference <= TOLERANCE, (layout, difference)
