"""The parity matrix: every parallel layout pipekit trains with, composed, against one process.

Each row runs one step of a tiny model (MoE with auxiliary losses on) on 4 ranks and compares
its loss and every gradient with the single-process step on the same weights and batch. In
float64 (relative difference <= 1e-10): FSDP, HSDP, torch's 1F1B, Interleaved1F1B and ZBV
(without data parallelism: the plan refuses its I/W actions on FSDP stages), SlimPipe's sliced
schedule (v = 1 and 2), sliced with context exchange, with context parallelism (SlimPipe's
commutated attention over the chunked KV cache, KV passing, and the choice per slice, on 2
pipeline x 2 cp ranks, and with context exchange on top), with tensor parallelism (sequence and
loss parallel, 2 pipeline x 2 tp ranks, the MoE's experts split over the tp ranks' tokens),
with vocabulary parallelism, expert parallelism alone and inside the sliced pipeline, expert
tensor parallelism (each expert's hidden dim split over 2 ranks) with EP and inside the sliced
pipeline, everything
at once, and tied embeddings across stages (on two ranks, as
vocabulary shards, and on one rank of a V), and a MoE upcycled from a dense Hugging Face
checkpoint inside the sliced pipeline with expert parallelism (each rank reading only its
stages' local blocks; Llama only). In bf16 (FSDP2 mixed precision, float32 weights and
reductions, bf16 messages) against float32, within 1.5e-2: the sliced pipeline with 2 data ranks
and with one. For Llama-MoE and for the custom example (GPT-2 style, registered from outside
pipekit); DeepSeek-V3 with latent MLA (its caches and exchanges hold the latent) and gpt-oss
(attention sinks, sliding windows shorter than a slice) run the rows without tensor
parallelism or bf16 (`MLA_ROWS`); a Falcon-style example (parallel blocks, learned positions,
ALiBi, multi-query attention, a biased output) runs `PARALLEL_BLOCKS_ROWS`. Pipelines run on
2 pipeline x 2 FSDP ranks unless the row says otherwise. Every row has an ablation that breaks
the mechanism the row relies on, and it must fail. A model's rows run in rank groups of
`ROWS_PER_GROUP`, its ablations in others.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import TINY_LLAMA
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import examples.custom_model.model as custom
import examples.parallel_blocks.model as parallel_blocks
from pipekit.checkpoint.upcycle import materialize_upcycled, upcycle_model
from pipekit.families.deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args
from pipekit.families.gpt_oss import GPT_OSS_FLAVORS
from pipekit.families.llama_moe.args import LlamaMoEArgs
from pipekit.families.llama_moe.upcycle import LLAMA_UPCYCLER
from pipekit.models import get_model_spec
from pipekit.models.upcycling import UpcycleSpec
from pipekit.moe import MoEArgs
from pipekit.moe.expert_parallel import expert_parameters
from pipekit.moe.layer import MoE
from pipekit.moe.routing import Routing
from pipekit.pipelining.features.activation_offload import PipelineActivationOffload
from pipekit.pipelining.features.context_parallel import PipelineContextParallel
from pipekit.pipelining.features.vocab_parallel import PipelineVocabParallel
from pipekit.pipelining.runtime.runner import PipelineRunner
from pipekit.testing import (
    Result,
    build_model,
    data_parallel_step,
    max_relative_difference,
    parity_batch,
    pipeline_step,
    reference_step,
    replace_context_exchange,
    run_on_ranks,
)

WORLD, ROWS, SEQ_LEN, MICROBATCHES, SLICES = 4, 8, 16, 2, 4
TOLERANCE, ABLATION_FLOOR = 1e-10, 1e-4
MOE = MoEArgs(num_experts=4, top_k=2, load_balance_weight=0.01, z_loss_weight=0.001)
_TINY_MLA = {
    "dim": 32, "n_layers": 4, "n_heads": 2, "vocab_size": 64, "ffn_dim": 64, "max_seq_len": 64,
    "q_lora_rank": 16, "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
    "v_head_dim": 8, "attention_cache": "latent", "expert_ffn_dim": 32,
    "moe": MoEArgs(
        num_experts=4, top_k=2, router="sigmoid_topk", num_shared_experts=1, num_groups=2,
        topk_groups=1, routed_scaling=2.5, load_balance="sequence", load_balance_weight=0.01,
    ),
}  # fmt: skip
"""DeepSeek-V3 at the matrix's size: latent MLA (the caches and exchanges hold one latent key
that is its own value), a dense first layer, shared experts, the grouped sigmoid router."""
_TINY_GPT_OSS = {
    "dim": 32, "n_heads": 2, "n_kv_heads": 1, "head_dim": 16, "vocab_size": 64, "ffn_dim": 32,
    "max_seq_len": 64, "sliding_window": 3,
    "moe": dataclasses.replace(GPT_OSS_FLAVORS["debug"].moe, num_experts=4),
}  # fmt: skip
"""gpt-oss at the matrix's size: attention sinks in every merge, a sliding window shorter than
a slice on even layers, biased projections and experts with the clamped SwiGLU."""
MODELS = {
    "llama_moe": LlamaMoEArgs(**{**vars(TINY_LLAMA), "n_layers": 4}, moe=MOE, moe_every=2),
    "tiny_gpt": custom.TinyGPTArgs(dim=32, n_layers=4, n_heads=2, vocab_size=64, max_seq_len=64),
    "deepseek_v3": DeepSeekV3Args(**{**vars(DEEPSEEK_V3_FLAVORS["debug"]), **_TINY_MLA}),
    "gpt_oss": dataclasses.replace(GPT_OSS_FLAVORS["debug"], **_TINY_GPT_OSS),
    "parallel_blocks": dataclasses.replace(
        parallel_blocks.FLAVORS["debug_dropless"], dim=32, vocab_size=64, max_seq_len=64
    ),
}
MLA_ROWS = (
    "FSDP", "sliced v=1", "sliced v=2", "sliced + context exchange", "EP", "sliced + EP",
    "sliced + context parallel (commutated)", "sliced + context parallel (kv_passing)",
    "sliced + context parallel (auto)", "sliced + context parallel (auto) + context exchange",
    "sliced + context parallel (ulysses)", "EP x ETP", "sliced + ETP",
)  # fmt: skip
"""DeepSeek-V3's and gpt-oss's rows: they have no tensor-parallel plan, and the bf16 rows hold
for any model; gpt-oss's experts have biases, which expert tensor parallelism refuses."""
PARALLEL_BLOCKS_ROWS = (
    "FSDP", "sliced v=1", "sliced + context exchange", "sliced + vocabulary parallel", "EP",
    "sliced + EP", "sliced + context parallel (commutated)",
    "sliced + context parallel (kv_passing)",
    "sliced + EP + vocabulary parallel + context exchange",
)  # fmt: skip
"""The Falcon-style example's rows (parallel blocks, learned positions, ALiBi, multi-query
attention, a biased untied output, switch experts): it has no tensor-parallel plan, one KV
head (Ulysses splits heads) and no ties; its output bias is split with the vocabulary."""
DENSE_LLAMA = dataclasses.replace(TINY_LLAMA, n_layers=4)
UPCYCLE = UpcycleSpec(num_experts=2, top_k=1, granularity=2)
"""Two copies of each dense FFN in two pieces: 4 experts, 2 per token, 2 per EP rank."""
UPCYCLE_SEED = 3
PIPELINE = {"dp_shard": 2, "microbatches": MICROBATCHES}
SLICED = PIPELINE | {"pipeline_schedule": "sliced", "num_slices": SLICES}
BF16 = {"dtype": torch.float32, "compute_dtype": torch.bfloat16}
BF16_TOLERANCE = 1.5e-2
"""bf16 keeps 8 significant bits: measured 3.9e-3 to 7.2e-3 of the largest float32 gradient.
Its ablation cuts a stage boundary (1.8e-1 and 1.0): the KV-cache one of the float64 rows moves
Llama-MoE's gradients by only 2.3e-2 of the largest, too close to bf16's own error."""


@dataclass(frozen=True)
class Row:
    """One layout: how it runs (`data_parallel` or `pipeline` keywords) and its ablation."""

    layout: str
    data_parallel: dict[str, Any] | None = None
    pipeline: dict[str, Any] = field(default_factory=dict)
    ablation: str = ""
    layers: int = 4
    """Blocks of the model: a V of 2 stages on each of 4 pipeline ranks needs 8."""
    tolerance: float = TOLERANCE
    tied: bool = False
    """Tie the embedding and output weights (their stages hold a copy each)."""
    every_expert: bool = False
    """Route each token to every expert: bf16 rounding flips top-k choices of near-tied
    experts, a discrete change no tolerance describes; with all experts chosen the routing is
    continuous and bf16 error stays small."""
    upcycled: bool = False
    """The MoE is upcycled from a dense Llama checkpoint (`DENSE_LLAMA`, `UPCYCLE`), every
    rank filling its stages' local blocks from the file; Llama-MoE only."""

    @property
    def dtype(self) -> torch.dtype:
        """The weights' (and the reference's) dtype."""
        return self.pipeline.get("dtype", torch.float64)

    @property
    def reference_microbatches(self) -> int:
        """The row blocks whose statistics the MoE aux losses take: each data rank's
        microbatches (pipelines split the 2 data ranks' rows into microbatches)."""
        if self.data_parallel is not None:
            return WORLD
        return self.pipeline["dp_shard"] * self.pipeline["microbatches"]


ROWS_ = [
    Row("FSDP", data_parallel={}, ablation="mean_reduction"),
    Row("HSDP", data_parallel={"dp_replicate": 2}, ablation="mean_reduction"),
    Row("1F1B", pipeline=PIPELINE | {"pipeline_schedule": "1F1B"}, ablation="cut_boundary"),
    Row(
        "Interleaved1F1B",
        pipeline=PIPELINE | {"pipeline_schedule": "Interleaved1F1B", "stages_per_rank": 2},
        ablation="cut_boundary",
    ),
    Row(  # I/W actions: torch's runtime cannot run them on FSDP stages (the plan refuses)
        "ZBV",
        pipeline={"dp_shard": 1, "microbatches": 4, "pipeline_schedule": "ZBVZeroBubble"}
        | {"stages_per_rank": 2},
        ablation="cut_boundary",
        layers=8,
    ),
    Row("sliced v=1", pipeline=SLICED, ablation="drop_kv_cache_grads"),
    Row("sliced v=2", pipeline=SLICED | {"stages_per_rank": 2}, ablation="drop_kv_cache_grads"),
    Row(  # every far-from-backward slice's movable activations go to a file and come back
        "sliced + activation offload",
        pipeline=SLICED | {"activation_offload": 1.0},
        ablation="offloaded_bytes_lost",
    ),
    Row(  # every block recomputes its slice in backward but the matmuls and attention
        "sliced + selective checkpointing",
        pipeline=SLICED | {"activation_checkpoint": "selective"},
        ablation="drop_kv_cache_grads",
    ),
    Row(
        "sliced + context exchange",
        pipeline=SLICED | {"context_exchange": True},
        ablation="drop_lent_kv_grads",
    ),
    Row(
        "sliced + vocabulary parallel",
        pipeline=SLICED | {"vocab_parallel": True},
        ablation="hidden_grad_last_rank_only",
    ),
    Row("EP", data_parallel={"ep": 2}, ablation="misplaced_experts"),
    Row(  # each expert's hidden dim over 2 ranks, its experts over the other 2
        "EP x ETP", data_parallel={"ep": 2, "etp": 2}, ablation="first_piece_only"
    ),
    Row("sliced + EP", pipeline=SLICED | {"ep": 2}, ablation="aux_statistics_per_slice"),
    Row(  # each pipeline rank's experts split on the hidden dim over its 2 data ranks
        "sliced + ETP", pipeline=SLICED | {"etp": 2}, ablation="first_piece_only"
    ),
    Row(
        "sliced + EP + vocabulary parallel + context exchange",
        pipeline=SLICED | {"ep": 2, "vocab_parallel": True, "context_exchange": True},
        ablation="misplaced_experts",
    ),
    Row("tied x sliced", pipeline=SLICED, ablation="untied_gradients", tied=True),
    Row(
        "tied x sliced + vocabulary parallel",
        pipeline=SLICED | {"vocab_parallel": True},
        ablation="untied_gradients",
        tied=True,
    ),
    Row(  # the V puts the first and the last stage on rank 0: both copies on one rank
        "tied x ZBV",
        pipeline={"dp_shard": 1, "microbatches": 4, "pipeline_schedule": "ZBVZeroBubble"}
        | {"stages_per_rank": 2},
        ablation="untied_gradients",
        layers=8,
        tied=True,
    ),
    Row(  # against float32; the ablation shows the looser tolerance still catches a real bug
        "bf16 x sliced",
        pipeline=SLICED | BF16,
        ablation="cut_boundary",
        tolerance=BF16_TOLERANCE,
        every_expert=True,
    ),
    Row(  # FSDP2 over one rank gives the stages their mixed precision
        "bf16 x sliced, one data rank",
        pipeline=SLICED | BF16 | {"dp_shard": 1},
        ablation="cut_boundary",
        tolerance=BF16_TOLERANCE,
        every_expert=True,
    ),
    *(  # 2 pipeline x 2 context-parallel ranks: every slice split over the cp ranks; "auto"
        # switches from passing K/V to passing queries mid-sequence at these shapes
        Row(
            f"sliced + context parallel ({variant})",
            pipeline=SLICED | {"dp_shard": 1, "cp": 2, "cp_variant": variant},
            ablation="local_kv_cache_only",
        )
        for variant in ("commutated", "kv_passing", "auto")
    ),
    Row(  # each slice resharded to heads; the caches hold every token of a rank's heads
        "sliced + context parallel (ulysses)",
        pipeline=SLICED | {"dp_shard": 1, "cp": 2, "cp_variant": "ulysses"},
        ablation="ulysses_tokens_misordered",
    ),
    Row(  # lending slices run commutated, each pipeline peer attending all cp ranks' queries
        "sliced + context parallel (auto) + context exchange",
        pipeline=SLICED | {"dp_shard": 1, "cp": 2, "context_exchange": True},
        ablation="drop_lent_kv_grads",
    ),
    Row(  # 2 pipeline x 2 tp ranks; the experts split over the tp ranks' tokens; the tied
        # embedding and output split alike over tp, their copies summed over the pipeline
        "tied x sliced + TP (sequence and loss parallel) + EP",
        pipeline=SLICED | {"dp_shard": 1, "tp": 2, "ep": 2},
        ablation="routers_outside_tp",
        tied=True,
    ),
    Row(  # the vocabulary rows split over the 2 pipeline x 2 tp ranks, sequence parallel
        "sliced + vocabulary parallel + TP + EP",
        pipeline=SLICED | {"dp_shard": 1, "tp": 2, "ep": 2, "vocab_parallel": True},
        ablation="tensor_ranks_not_summed",
    ),
    Row(
        "upcycled x sliced + EP",
        pipeline=SLICED | {"ep": 2},
        ablation="router_seed_per_rank",
        upcycled=True,
    ),
]


def _rows(model: str) -> list[Row]:
    """The rows `model` runs: upcycling starts from a dense Llama, so only Llama-MoE has it."""
    if model == "parallel_blocks":
        return [row for row in ROWS_ if row.layout in PARALLEL_BLOCKS_ROWS]
    if model in ("deepseek_v3", "gpt_oss"):
        rows = [row for row in ROWS_ if row.layout in MLA_ROWS]
        return [row for row in rows if model != "gpt_oss" or "ETP" not in row.layout]
    return [row for row in ROWS_ if not row.upcycled or model == "llama_moe"]


def _batch(model: str) -> Any:
    return parity_batch(MODELS[model].vocab_size, ROWS, SEQ_LEN)


def _roll_local_experts(model: nn.Module) -> None:
    """Ablation: each rank's experts shifted by one, as if the shards were cut wrongly."""
    with torch.no_grad():
        for param in expert_parameters(model):
            local = param.to_local() if isinstance(param, DTensor) else param
            local.copy_(local.roll(1, 0))


def _model_ablation(name: str) -> Callable[[nn.Module], None] | None:
    if name == "mean_reduction":  # FSDP's default mean instead of pipekit's sum
        return lambda model: [
            module.set_gradient_divide_factor(float(WORLD))
            for module in model.modules()
            if isinstance(module, FSDPModule)
        ]
    if name == "misplaced_experts":
        return _roll_local_experts
    if name == "first_piece_only":
        return _first_piece_only
    raise ValueError(name)


def _first_piece_only(model: nn.Module) -> None:
    """Ablation of expert tensor parallelism: each assignment goes to its expert's first
    piece only (the other pieces' slices of the hidden dim never see the token)."""
    for module in model.modules():
        if isinstance(module, MoE):
            execution = module.execution
            pieces = execution.routing_of_pieces
            execution.routing_of_pieces = lambda routing, pieces=pieces: _first_piece(
                pieces(routing), routing.num_experts
            )


def _first_piece(routing: Routing, num_experts: int) -> Routing:
    """`routing` (split into pieces) with the weights of every piece but the first zeroed."""
    first_A = routing.expert_index_A < num_experts
    return dataclasses.replace(routing, weight_A=routing.weight_A * first_A)


class _ZeroGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.clone()  # not a view: torch's stage detaches its output in place

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return torch.zeros_like(grad)


def _runner_ablation(name: str, pipeline: dict[str, Any]) -> Callable[[PipelineRunner], None]:
    def adjust(runner: PipelineRunner) -> None:
        if name == "cut_boundary":  # no gradient crosses into a stage from the next one
            for stage in runner.stages:
                if not stage.is_last:
                    stage.submod.register_forward_hook(lambda _m, _a, out: _ZeroGradient.apply(out))
        elif name == "drop_kv_cache_grads":
            for stage in runner.stages:
                stage.kv_cache.drop_cached_gradients = True
        elif name == "drop_lent_kv_grads":
            replace_context_exchange(runner, drop_remote_kv_grads=True)
        elif name == "hidden_grad_last_rank_only":
            vocab = runner.extension("vocab_parallel")
            assert vocab is not None
            if not runner.has_last_stage:
                vocab.output.register_full_backward_hook(lambda _, grad, __: (grad[0] * 0,))
        elif name == "tensor_ranks_not_summed":  # embeddings and hidden-state gradients
            # from a tp rank's own vocabulary rows only (its tokens' share, as if summed)
            vocab = runner.extension("vocab_parallel")
            assert isinstance(vocab, PipelineVocabParallel) and vocab.tensor_group is not None
            ranks, rank = vocab.tensor_group.size(), vocab.tensor_group.rank()
            vocab._sum_over_tensor_ranks = lambda partial, sequence_dim: partial.chunk(
                ranks, sequence_dim
            )[rank].clone()
        elif name == "offloaded_bytes_lost":  # what comes back from the file is zeros
            offload = runner.extension("activation_offload")
            assert isinstance(offload, PipelineActivationOffload)
            store, read = offload.offloader.store, offload.offloader.store.get
            store.get = lambda ticket, device: torch.zeros_like(read(ticket, device))
        elif name == "aux_statistics_per_slice":
            for stage in runner.stages:
                stage._sequence = lambda *_: nullcontext()
        elif name == "misplaced_experts":
            assert runner.model is not None
            _roll_local_experts(runner.model)
        elif name == "first_piece_only":
            assert runner.model is not None
            _first_piece_only(runner.model)
        elif name == "local_kv_cache_only":  # queries never reach the other cp rank's cache
            parallel = runner.extension("context_parallel")
            assert isinstance(parallel, PipelineContextParallel)
            parallel.drop_remote = True
        elif name == "ulysses_tokens_misordered":  # the gathered tokens put in the wrong order
            parallel = runner.extension("context_parallel")
            assert isinstance(parallel, PipelineContextParallel)
            rank_tokens = parallel.rank_tokens
            parallel.rank_tokens = lambda microbatch, index: rank_tokens(microbatch, index).flip(0)
        elif name in ("router_seed_per_rank", "routers_outside_tp"):
            pass  # applied when the stages are built (`_run_row`)
        elif name == "untied_gradients":  # each copy keeps its own stage's gradient
            tied = runner.extension("tied_weights")
            assert tied is not None
            tied.end_step = lambda: None
        else:
            raise ValueError(name)

    return adjust


def _args(model: str, row: Row) -> Any:
    if row.upcycled:
        return LLAMA_UPCYCLER.moe_args(DENSE_LLAMA, UPCYCLE)
    args = MODELS[model]
    moe = args.moe
    if row.every_expert:
        moe = dataclasses.replace(moe, top_k=moe.num_experts)
    ties = {"tie_embeddings": row.tied} if row.tied or hasattr(args, "tie_embeddings") else {}
    return dataclasses.replace(args, n_layers=row.layers, moe=moe, **ties)


def _write_dense_llama(directory: Path) -> None:
    """The dense Llama the upcycled row starts from, in Hugging Face layout, in float64."""
    llama = get_model_spec("llama")
    assert llama.hf is not None
    dense = build_model(llama, DENSE_LLAMA, seed=11, dtype=torch.float64)
    llama.hf.save(dense, DENSE_LLAMA, str(directory))


def _run_row(rank: int, world: int, model: str, row: Row, ablate: bool, dense: Path) -> Result:
    spec, args = get_model_spec(model), _args(model, row)
    if row.data_parallel is not None:
        adjust = _model_ablation(row.ablation) if ablate else None
        return data_parallel_step(
            rank, world, spec, args, _batch(model), adjust=adjust, **row.data_parallel
        )
    adjust = _runner_ablation(row.ablation, row.pipeline) if ablate else None
    materialize = None
    if row.upcycled:  # the ablation draws each rank's routers from a seed of its own
        seed = UPCYCLE_SEED + (rank if ablate else 0)
        materialize = functools.partial(
            materialize_upcycled, device="cpu", directory=dense, upcycler=LLAMA_UPCYCLER,
            args=args, spec=UPCYCLE, seed=seed,
        )  # fmt: skip
    if ablate and row.ablation == "routers_outside_tp":  # their gradients partial per tp rank
        return pipeline_step(rank, world, spec, args, _batch(model), routers=False, **row.pipeline)
    return pipeline_step(
        rank, world, spec, args, _batch(model), adjust=adjust, materialize=materialize,
        **row.pipeline,
    )  # fmt: skip


ROWS_PER_GROUP = 7
"""Rows run by one rank group. Each row creates process groups that stay alive (torch's
DeviceMesh caches them), and every collective of a rank slows as they accumulate: tiny_gpt's
28 rows took 33.6 s in one group, 25.8 s in groups of 7 and 27.7 s in groups of 4."""


def _run_rows(
    rank: int, world: int, model: str, ablate: bool, dense: Path, first: int
) -> list[Result]:
    rows = _rows(model)[first : first + ROWS_PER_GROUP]
    return [_run_row(rank, world, model, row, ablate, dense) for row in rows]


def _reference(model: str, row: Row, dense: Path) -> Result:
    spec, args, batch = get_model_spec(model), _args(model, row), _batch(model)
    microbatches = row.reference_microbatches
    if not row.upcycled:
        return reference_step(spec, args, batch, microbatches=microbatches, dtype=row.dtype)
    upcycled, _ = upcycle_model(
        dense, LLAMA_UPCYCLER, DENSE_LLAMA, spec.build, UPCYCLE, seed=UPCYCLE_SEED,
        dtype=row.dtype,
    )  # fmt: skip
    return reference_step(spec, args, batch, microbatches=microbatches, model=upcycled)


def _differences(model: str, ablate: bool, dense: Path) -> dict[str, float]:
    rows = _rows(model)
    if any(row.upcycled for row in rows):
        _write_dense_llama(dense)
    per_rank: list[list[Result]] = [[] for _ in range(WORLD)]
    for first in range(0, len(rows), ROWS_PER_GROUP):
        group = run_on_ranks(_run_rows, WORLD, model, ablate, dense, first, timeout=600)
        for rank, results in enumerate(group):
            per_rank[rank].extend(results)
    references: dict[tuple[Any, ...], Result] = {}
    differences = {}
    for index, row in enumerate(rows):
        key = (row.reference_microbatches, row.layers, row.dtype, row.every_expert, row.tied,
               row.upcycled)  # fmt: skip
        if key not in references:
            references[key] = _reference(model, row, dense)
        results = [per_rank[rank][index] for rank in range(WORLD)]
        differences[row.layout] = max_relative_difference(results, references[key])
    return differences


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_layout_matches_one_process_fp64(model: str, tmp_path: Path) -> None:
    differences = _differences(model, ablate=False, dense=tmp_path / "dense")
    tolerances = {row.layout: row.tolerance for row in ROWS_}
    failed = {layout: d for layout, d in differences.items() if not d <= tolerances[layout]}
    assert not failed, f"{model}: above the row's tolerance: {failed}"
    low_precision = [row.layout for row in _rows(model) if "compute_dtype" in row.pipeline]
    float32_like = {layout: differences[layout] for layout in low_precision}
    low = not float32_like or min(float32_like.values()) > 1e-4
    assert low, f"bf16 compute did not happen: {float32_like}"


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_layout_fails_when_its_mechanism_is_broken(model: str, tmp_path: Path) -> None:
    differences = _differences(model, ablate=True, dense=tmp_path / "dense")
    floors = {row.layout: max(ABLATION_FLOOR, 4 * row.tolerance) for row in ROWS_}
    passed = {layout: d for layout, d in differences.items() if not d > floors[layout]}
    assert not passed, f"{model}: ablations that still match: {passed}"
