"""The tiny float32 Llama that the distributed tests share."""

from __future__ import annotations

import torch
from torch import nn

from models.llama import Llama, LlamaArgs

TINY_LLAMA = LlamaArgs(
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=64,
    ffn_dim=48,
    rope_scaling=None,
    rope_theta=10000.0,
    max_seq_len=64,
)


def tiny_llama(seed: int = 0, tied: bool = False) -> nn.Module:
    """TINY_LLAMA built on meta, materialised on CPU and initialised from `seed`."""
    with torch.device("meta"):
        model = Llama(TINY_LLAMA.with_updates(tie_embeddings=tied))
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def tiny_pipeline_stages(
    rank: int,
    world: int,
    *,
    schedule: str,
    num_stages: int,
    rows_per_unit: int,
    slice_length: int,
    num_slices: int,
    dtype: torch.dtype = torch.float64,
    seed: int = 3,
    stage_indices: list[int] | None = None,
    group=None,
    checkpoint_activations: bool = False,
    vocab_parallel: bool = False,
    vocab_size: int = TINY_LLAMA.vocab_size,
    num_layers: int | None = None,
) -> list:
    """This rank's stages of TINY_LLAMA with one layer per stage (`num_layers` split evenly
    otherwise), initialised from `seed` in
    `dtype`, placed as `schedule` places them (or at `stage_indices`), cpu attention; optionally
    with every block's activations checkpointed, or without the embedding and output layer
    (`vocab_parallel`, see `tiny_vocab_parallel`)."""
    from pipekit._torch_private import checkpoint_module_activations
    from pipekit.pipelining.build import build_rank_stages
    from pipekit.pipelining.schedule import V_SHAPED_SCHEDULES
    from pipekit.pipelining.stage import StageShapes
    from pipekit.pipelining.stage_split import llama_stage_module_names

    def materialize(module: nn.Module) -> None:
        module.to_empty(device="cpu")
        module.init_weights(seed=seed)
        module.to(dtype)
        if checkpoint_activations:
            for block in (module.layers or {}).values():
                checkpoint_module_activations(block)

    num_layers = num_layers or num_stages
    with torch.device("meta"):
        model = Llama(
            TINY_LLAMA.with_updates(n_layers=num_layers, max_seq_len=64, vocab_size=vocab_size)
        )
    shapes = StageShapes(
        rows_per_unit,
        slice_length,
        TINY_LLAMA.dim,
        vocab_size,
        dtype,
        vocab_parallel=vocab_parallel,
    )
    return build_rank_stages(
        model,
        llama_stage_module_names(num_layers, num_stages, vocab_parallel=vocab_parallel),
        outside_stages=("tok_embeddings", "output") if vocab_parallel else (),
        rank=rank,
        num_ranks=world,
        stage_style="v" if schedule in V_SHAPED_SCHEDULES else "loop",
        stage_indices=stage_indices,
        shapes=shapes,
        num_slices=num_slices,
        device=torch.device("cpu"),
        materialize=materialize,
        group=group,
        backend="cpu",
    )


def tiny_vocab_parallel(stages: list, num_stages: int, seed: int = 3, group=None):
    """This rank's `PipelineVocabParallel` for `tiny_pipeline_stages(vocab_parallel=True)`
    (same seed and dtype): the rows of TINY_LLAMA's embedding and output this rank holds."""
    import torch.distributed as dist

    from pipekit.pipelining.vocab_parallel import PipelineVocabParallel, vocab_shard_modules

    group = group or dist.new_group()  # its own: not the group the stages send over
    shapes = stages[0].shapes
    full = Llama(
        TINY_LLAMA.with_updates(n_layers=num_stages, max_seq_len=64, vocab_size=shapes.vocab_size)
    )
    full.init_weights(seed=seed)
    embedding, output = vocab_shard_modules(shapes.vocab_size, TINY_LLAMA.dim, group)
    embedding.load_full_weight(full.tok_embeddings.weight.detach())
    output.load_full_weight(full.output.weight.detach())
    embedding.to(shapes.dtype)
    output.to(shapes.dtype)
    held = {stage.stage_index: stage.group_rank for stage in stages}
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, held, group=group)
    owner = {index: rank for part in everyone for index, rank in part.items()}
    return PipelineVocabParallel(
        embedding,
        output,
        shapes,
        first_rank=owner[0],
        last_rank=owner[num_stages - 1],
        group=group,
    )
