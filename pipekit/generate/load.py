"""The model and tokenizer `python -m pipekit.generate` decodes with, from either kind of
checkpoint: a pipekit (DCP) step folder of any training layout, or a Hugging Face folder of any
registered family.

A DCP step folder holds weights; the model they belong to is the job's: the resolved config its
trainer wrote into the step folder (`config.toml`; older checkpoints have only the one beside
them, `<output_dir>/config.toml`), or `--config`.
Checkpoints keep every parameter whole under its model name whatever the layout (FSDP, tp, ep,
pipeline, vocabulary rows), so one process reads them into the whole model. A Hugging Face
folder says its family in config.json; its tokenizer is its `tokenizer.json` unless given.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from torch import nn

from pipekit.checkpoint.dcp import COMPLETE_MARKER, load_checkpoint
from pipekit.checkpoint.safetensors_io import CheckpointError
from pipekit.config import load_job_config
from pipekit.config.dump import JOB_CONFIG_FILE
from pipekit.distributed.parallel_dims import ParallelDims
from pipekit.models.registry import spec_for_checkpoint
from pipekit.train.data.tokenizer import Tokenizer, build_tokenizer
from pipekit.train.job import validate_job

__all__ = ["LoadedModel", "load_for_generation"]


class LoadedModel(NamedTuple):
    """What decoding needs: the float32 model in eval mode, the tokenizer to use with it, and
    the longest sequence its positions allow (`ModelShape.max_seq_len`)."""

    model: nn.Module
    tokenizer: Tokenizer
    max_seq_len: int


def load_for_generation(
    checkpoint: Path, config: Path | None = None, tokenizer: str | None = None
) -> LoadedModel:
    """The float32 model in eval mode holding `checkpoint`, the tokenizer to use with it
    (`tokenizer`, or the job's / the folder's) and its longest sequence; CheckpointError or
    ValueError naming the fix."""
    if (checkpoint / "config.json").is_file():
        family = spec_for_checkpoint(checkpoint)
        assert family.hf is not None  # spec_for_checkpoint finds families with an adapter
        model, args = family.hf.build_from_checkpoint(str(checkpoint))
        default = checkpoint / "tokenizer.json"
        if tokenizer is None and not default.is_file():
            raise ValueError(
                f"{checkpoint} has no tokenizer.json; give --tokenizer (a tokenizer.json, or "
                "'bytes')"
            )
        built = build_tokenizer(tokenizer or str(default))
        return LoadedModel(model.eval(), built, family.shape(args).max_seq_len)
    if not (checkpoint / COMPLETE_MARKER).is_file():
        raise CheckpointError(
            f"{checkpoint} is neither a Hugging Face folder (config.json) nor a complete "
            f"pipekit checkpoint step (a {COMPLETE_MARKER} marker); give a step folder such as "
            "outputs/<job>/checkpoints/step-100"
        )
    own = checkpoint / JOB_CONFIG_FILE
    config_path = config or (own if own.is_file() else checkpoint.parent.parent / JOB_CONFIG_FILE)
    if not config_path.is_file():
        raise ValueError(
            f"no {config_path}: the job's config says which model the checkpoint holds; give "
            "--config (the config the job trained with)"
        )
    job_config = load_job_config(["--config", str(config_path)])
    world = ParallelDims.smallest_world_size(job_config.parallelism)
    job = validate_job(job_config, world, check_files=False)
    model = job.spec.build(job.args)
    # the model's tensors are filled in place, under the names the trainer saves them with
    load_checkpoint(checkpoint, {"model_and_optimizer": {"model": model.state_dict()}})
    built = build_tokenizer(tokenizer or job_config.data.tokenizer)
    return LoadedModel(model.eval(), built, job.shape.max_seq_len)
