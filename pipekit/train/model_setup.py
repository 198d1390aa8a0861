"""This rank's model for a job: built on meta, given values, parallelized; or its pipeline.

Order (torchtitan's): model on the meta device -> (pipeline: keep this rank's stages) ->
activation checkpointing -> expert parallelism -> compiled blocks -> data parallelism (FSDP2 /
HSDP / replication; per stage under pipelining), all still on the meta device -> storage for
this rank's shards -> values, one init unit at a time (`pipekit.models.materialize_sharded`):
each unit's parameters stand in full while it is initialised from the job seed or read from a
Hugging Face checkpoint, then each rank keeps its block. No rank holds more than its shards plus
one unit's full tensors, and any layout starts from the weights a single process would. An
upcycled model fills its shards straight from the dense checkpoint's local blocks instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pipekit._torch_private import flatten_mesh
from pipekit.checkpoint.local_shards import local_nbytes
from pipekit.checkpoint.safetensors_io import TensorRead
from pipekit.checkpoint.upcycle import materialize_upcycled
from pipekit.distributed.fsdp import MIXED_PRECISION_DTYPES, apply_data_parallel
from pipekit.distributed.process_group import single_rank_mesh
from pipekit.distributed.tensor_parallel import apply_tensor_parallel
from pipekit.models.materialize import materialize_sharded, to_empty_keeping_ties
from pipekit.moe.expert_parallel import (
    apply_expert_parallel,
    expert_mesh,
    expert_parallel_mesh,
    set_expert_execution,
)
from pipekit.pipelining.build import StageSetup, build_pipeline
from pipekit.pipelining.runtime.runner import PipelineRunner
from pipekit.train.activation_checkpoint import apply_activation_checkpointing
from pipekit.train.compile import compile_blocks, job_loss_fn
from pipekit.train.float8 import apply_float8
from pipekit.train.job import Job

__all__ = ["JobModel", "build_job_model"]

logger = logging.getLogger(__name__)


@dataclass
class JobModel:
    """What the trainer trains on this rank."""

    model: nn.Module
    """The whole model, or this rank's stages' modules under the whole model's names."""
    pipeline: PipelineRunner | None


def build_job_model(
    job: Job,
    mesh: DeviceMesh | None,
    device: torch.device,
    *,
    load_hf: bool,
    on_meta: bool = False,
) -> JobModel:
    """This rank's model (or pipeline) for `job`; `load_hf` reads [checkpoint] initial_load_path
    (off when resuming: the checkpoint overwrites the values anyway). `on_meta` leaves every
    parameter on the meta device, parallelized exactly as training would (memory planning)."""
    setup = _ModelSetup(job, mesh, device, load_hf and not on_meta, allocate=not on_meta)
    with torch.device("meta"):
        model = job.spec.build(job.args)
    if job.pipeline is not None:
        assert mesh is not None  # pipelines have ranks
        runner = build_pipeline(job.pipeline, model, mesh, setup.stage_setup())
        assert runner.model is not None
        return JobModel(runner.model, runner)
    setup.parallelize(model)
    if job.upcycle is not None:
        setup.materialize_upcycled(model)
    else:
        setup.materialize(model)
    return JobModel(model, None)


class _ModelSetup:
    """The job's ways to give a module values and to parallelize it."""

    def __init__(
        self,
        job: Job,
        mesh: DeviceMesh | None,
        device: torch.device,
        load_hf: bool,
        *,
        allocate: bool = True,
    ) -> None:
        self.job, self.mesh, self.device, self.load_hf = job, mesh, device, load_hf
        self.allocate = allocate
        self.expert_mesh = self.routers_mesh = None
        dims = job.dims
        tp_moe = job.tensor_parallel > 1 and getattr(job.args, "moe", None) is not None
        if dims.ep_enabled or tp_moe:
            # the ranks that hold tokens of one pipeline rank's stages (tp ranks each their own,
            # under sequence parallelism, which tp with MoE requires)
            token_ranks = dims.dp_degree * dims.cp * (dims.tp if tp_moe else 1)
            self.expert_mesh = expert_mesh(
                device.type, token_ranks, dims.ep, pipeline_ranks=dims.pp, etp=dims.etp
            )
        if tp_moe:
            assert self.expert_mesh is not None
            self.routers_mesh = flatten_mesh(self.expert_mesh, "ep_tokens")
        training = job.config.training
        self.compute_dtype = MIXED_PRECISION_DTYPES[training.mixed_precision_param]
        self.precision: dict[str, Any] = {
            "param_dtype": self.compute_dtype,
            "reduce_dtype": MIXED_PRECISION_DTYPES[training.mixed_precision_reduce],
        }
        single_data_rank = dims.dp_degree * dims.cp == 1
        if job.pipeline is not None and single_data_rank and self.compute_dtype != torch.float32:
            # FSDP2 over one rank: the stages get mixed precision as they would under FSDP
            self.precision["precision_mesh"] = single_rank_mesh(device.type)

    def stage_setup(self) -> StageSetup:
        config = self.job.config
        upcycled = self.job.upcycle is not None
        return StageSetup(
            device=self.device,
            materialize=self.materialize_upcycled if upcycled else self.materialize,
            parallelize=self.parallelize,
            parallelize_vocab=self.parallelize_vocab,
            attention_backend=config.model.attention_backend,
            message_dtype=self.compute_dtype,
            collective_timeout=timedelta(seconds=config.parallelism.collective_timeout_s),
            offload_dir=config.parallelism.activation_offload_dir,
            loss_fn=job_loss_fn(config.compile.enable, self.job.loss_parallel),
        )

    def materialize(self, module: nn.Module) -> None:
        """Storage on the device for the (sharded) module, values from the job seed unit by
        unit (buffers too), then the local blocks of the Hugging Face checkpoint if the job
        loads one (each rank reads only the bytes of its shards)."""
        if not self.allocate:
            return
        seed = self.job.config.job.seed
        materialize_sharded(module, self.device, lambda unit: unit.init_weights(seed=seed))
        path = self.job.config.checkpoint.initial_load_path
        if self.load_hf and path:
            assert self.job.spec.hf is not None  # validated
            self.job.spec.hf.load(path, module, self.job.args)

    def materialize_upcycled(self, module: nn.Module) -> None:
        """Storage for the (already sharded) module, then its local blocks upcycled from the
        dense checkpoint: experts copied from the FFN blocks, router drawn from the job seed."""
        if not self.allocate:
            return
        if not self.load_hf:  # a DCP checkpoint fills the storage
            to_empty_keeping_ties(module, self.device)
            return
        job = self.job
        dense = job.dense_spec
        assert dense.upcycler is not None and job.upcycle is not None  # validated
        reads: list[TensorRead] = []
        path = job.config.checkpoint.initial_load_path
        materialize_upcycled(
            module, self.device, path, dense.upcycler, job.args, job.upcycle,
            job.config.job.seed, read_log=reads,
        )  # fmt: skip
        owned, read = local_nbytes(module), sum(block.nbytes for block in reads)
        logger.info(
            "upcycled %s: read %.1f MiB for %.1f MiB of local parameters",
            path,
            read / 2**20,
            owned / 2**20,
        )

    def parallelize(self, module: nn.Module) -> None:
        """FP8 linear layers, tensor parallelism, activation checkpointing, expert
        parallelism, compiled blocks, then data parallelism, in place."""
        job, moe = self.job, self.job.config.moe
        converted = apply_float8(
            module, job.config.training.float8, job.spec.structure, self.device.type
        )
        if converted:
            logger.info(
                "float8 (%s%s): %d linear layers",
                job.config.training.float8,
                "" if self.device.type == "cuda" else ", emulated",
                len(converted),
            )
        if job.tensor_parallel > 1:
            assert self.mesh is not None
            apply_tensor_parallel(
                module,
                self.mesh["tp"],
                job.spec,
                sequence_parallel=job.sequence_parallel,
                loss_parallel=job.loss_parallel,
                tied_embeddings=job.shape.tied_embeddings,
            )
        if job.dims.ep_enabled:
            assert self.expert_mesh is not None
            apply_expert_parallel(
                module,
                expert_parallel_mesh(self.expert_mesh),
                partitions=moe.partitions,
                memory_reuse=moe.memory_reuse,
            )
        else:
            set_expert_execution(module, moe.partitions, moe.memory_reuse)
        blocks = job.spec.structure.blocks_of(module)
        apply_activation_checkpointing(
            job.spec.structure.named_blocks_of(module), job.config.training
        )
        if job.config.compile.enable:
            compile_blocks(blocks)
        if self.mesh is not None:
            apply_data_parallel(
                module,
                self.mesh,
                job.dims,
                blocks=blocks,
                experts_mesh=None if self.expert_mesh is None else self.expert_mesh["ep_replicate"],
                routers_mesh=self.routers_mesh,
                **self.precision,
            )

    def parallelize_vocab(self, embedding: nn.Module, output: nn.Module) -> None:
        """Data parallelism over the vocabulary shards. The output layer runs once per unit, so
        it stays gathered from its forward to its backward (the vocabulary-parallel pipeline
        syncs its gradients after the step's last pass)."""
        if self.mesh is None:
            return
        dims = self.job.dims
        apply_data_parallel(embedding, self.mesh, dims, **self.precision)
        apply_data_parallel(output, self.mesh, dims, reshard_after_forward=False, **self.precision)
