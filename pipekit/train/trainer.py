"""The training loop: build, parallelize, initialise or resume, step, log, checkpoint.

Order of construction (torchtitan's): model on the meta device -> (pipeline: keep this rank's
stages) -> materialise and initialise (or load a Hugging Face checkpoint) -> activation
checkpointing -> data parallelism (FSDP2 / HSDP / replication; per stage under pipelining) ->
optimizer and LR schedule -> resume from the newest checkpoint. Initialisation depends only on
the job seed and each module's name, so any data-parallel or pipeline layout starts from the
weights a single process would.

Legend: B local micro-batch, S sequence, V vocabulary.
"""

from __future__ import annotations

import functools
import math
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import Tensor, nn

from pipekit.attention.context import CausalAttention
from pipekit.checkpoint.dcp import (
    CheckpointManager,
    ModelOptimizerState,
    capture_rng_state,
    restore_rng_state,
)
from pipekit.checkpoint.local_shards import local_nbytes
from pipekit.checkpoint.safetensors_io import TensorRead
from pipekit.checkpoint.upcycle import upcycle_into
from pipekit.config.job_config import JobConfig
from pipekit.config.validate import job_model
from pipekit.distributed.fsdp import apply_data_parallel
from pipekit.distributed.grad_clip import clip_grad_norm_
from pipekit.distributed.parallel_dims import ParallelDims
from pipekit.distributed.process_group import new_group_along
from pipekit.moe.aux_loss import aux_loss_scale
from pipekit.moe.expert_parallel import (
    all_reduce_replicated_expert_grads,
    apply_expert_parallel,
    expert_mesh,
    expert_parameters,
    set_expert_execution,
)
from pipekit.pipelining.build import build_rank_model, wrap_rank_stages
from pipekit.pipelining.context_exchange import PipelineContextExchange
from pipekit.pipelining.plan import plan_pipeline
from pipekit.pipelining.schedule import PipelineRunner, build_pipeline_runner
from pipekit.pipelining.stage import StageShapes
from pipekit.pipelining.stage_split import llama_layers_per_stage
from pipekit.pipelining.trace import record_pipeline_step
from pipekit.pipelining.vocab_parallel import (
    VOCAB_MODULE_NAMES,
    PipelineVocabParallel,
    copy_full_vocab_rows,
    vocab_shard_modules,
)
from pipekit.train.activation_checkpoint import apply_activation_checkpointing
from pipekit.train.data import build_data_loader
from pipekit.train.loss import count_label_tokens, token_sum_cross_entropy
from pipekit.train.lr_schedule import build_lr_scheduler
from pipekit.train.metrics import (
    MetricsLogger,
    measure_matmul_flops,
    memory_stats,
    training_flops_per_token,
)
from pipekit.train.optimizer import build_optimizer

__all__ = ["NonFiniteLossError", "Trainer"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; the run stops before that step is applied or saved."""


class Trainer:
    """One training job, built from a validated JobConfig inside an initialised process group."""

    def __init__(self, config: JobConfig) -> None:
        self.config = config
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.device = torch.device(
            f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        )
        self.dims = ParallelDims.from_config(config.parallelism, self.world_size)
        self.mesh = self.dims.build_mesh(self.device.type) if self.world_size > 1 else None
        self.output_dir = Path(config.job.output_dir)
        self.spec, self.model_args = job_model(config)
        upcycle = config.model.upcycle
        self.upcycle = upcycle.to_spec() if upcycle.enabled else None
        self.checkpoints = CheckpointManager(
            self.output_dir / config.checkpoint.folder, keep_last=config.checkpoint.keep_last
        )
        resume_step = self.checkpoints.latest_step() if config.checkpoint.resume else None

        dp_rank, dp_degree = self.dims.dp_rank(self.mesh), self.dims.dp_degree
        self.micro_batch_size = config.training.global_batch_size // (
            dp_degree * config.training.gradient_accumulation_steps
        )
        torch.manual_seed(config.job.seed)
        self._expert_mesh = None  # ep_replicate x ep, over the data ranks (validation: pp = 1)
        if self.dims.ep_enabled:
            data_ranks = self.dims.dp_degree * self.dims.cp
            self._expert_mesh = expert_mesh(self.device.type, data_ranks, self.dims.ep)
        self.pipeline: PipelineRunner | None = None
        if self.dims.pp_enabled:
            self.model, self.pipeline = self._build_pipeline(load_hf=resume_step is None)
        else:
            self.model = self._build_model(load_hf=resume_step is None)
        self.optimizer = build_optimizer(self.model.parameters(), config.optimizer)
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer, config.training.steps, config.lr_scheduler
        )
        self.data = build_data_loader(
            config.data,
            seq_len=config.training.seq_len,
            local_batch_size=self.micro_batch_size,
            dp_rank=dp_rank,
            dp_world_size=dp_degree,
            seed=config.job.seed,
        )
        # MoE auxiliary losses are averaged over the forwards of a step, as token losses are:
        # every micro-batch (and pipeline unit) of every data-parallel rank holds B x S tokens.
        forwards_per_step = dp_degree * config.training.gradient_accumulation_steps
        if self.pipeline is not None:
            forwards_per_step *= self.pipeline.num_microbatches * self.pipeline.num_slices
        self._aux_loss_share = 1.0 / forwards_per_step
        self.step = 0
        if resume_step is not None:
            self.checkpoints.load(resume_step, self._checkpoint_state())
        self.metrics = MetricsLogger(
            self.output_dir / config.metrics.jsonl_file, enabled=self.rank == 0
        )
        with torch.device("meta"):  # the whole model's FLOPs, whatever this rank holds
            full_model = self.spec.build(self.model_args)
        self.flops_per_token = training_flops_per_token(
            full_model,
            self.model_args.n_layers,
            self.model_args.n_heads,
            self.model_args.per_head_dim,
            config.training.seq_len,
        )
        self.peak_flops = config.metrics.peak_flops or self._measured_peak_flops()

    def _materialize(self, model: nn.Module, load_hf: bool) -> None:
        """Move off meta and initialise from the job seed, or load the Hugging Face weights."""
        model.to_empty(device=self.device)
        model.init_weights(seed=self.config.job.seed)
        if load_hf and self.config.checkpoint.initial_load_path:
            self.spec.load_hf(self.config.checkpoint.initial_load_path, model, self.model_args)

    def _parallelize_upcycled(self, model: nn.Module, load_hf: bool) -> None:
        """An upcycled model (or stage) is sharded on meta before it has storage, then each rank
        fills its own blocks, so none holds more (a resume overwrites them from DCP)."""
        self._parallelize(model)
        model.to_empty(device=self.device)
        model.tie_weights()  # FSDP2 keeps a tie through to_empty; a plain module does not
        if load_hf:
            self._load_upcycled(model)

    def _load_upcycled(self, model: nn.Module) -> None:
        """Fill `model`'s local blocks from the dense checkpoint: experts copied from the FFN
        blocks, router drawn from the job seed."""
        from models.registry import get_model_spec

        dense_spec = get_model_spec(self.config.model.name)
        assert dense_spec.upcycler is not None and self.upcycle is not None  # validated
        reads: list[TensorRead] = []
        path = self.config.checkpoint.initial_load_path
        upcycle_into(
            model,
            path,
            dense_spec.upcycler,
            self.model_args,
            self.upcycle,
            self.config.job.seed,
            read_log=reads,
        )
        owned, read = local_nbytes(model), sum(block.nbytes for block in reads)
        print(
            f"[rank {self.rank}] upcycled {path}: read {read / 2**20:.1f} MiB for "
            f"{owned / 2**20:.1f} MiB of local parameters",
            flush=True,
        )

    def _parallelize(self, model: nn.Module) -> None:
        """Expert parallelism, activation checkpointing, then data parallelism, in place."""
        moe = self.config.moe
        if self.dims.ep_enabled:
            apply_expert_parallel(
                model,
                self._expert_mesh["ep"],
                partitions=moe.partitions,
                memory_reuse=moe.memory_reuse,
            )
        else:
            set_expert_execution(model, moe.partitions, moe.memory_reuse)
        apply_activation_checkpointing(list((model.layers or {}).values()), self.config.training)
        training = self.config.training
        if self.mesh is not None:
            apply_data_parallel(
                model,
                self.mesh,
                self.dims,
                param_dtype=_DTYPES[training.mixed_precision_param],
                reduce_dtype=_DTYPES[training.mixed_precision_reduce],
                ignored_params=expert_parameters(model) if self.dims.ep_enabled else None,
            )

    def _build_model(self, load_hf: bool) -> nn.Module:
        with torch.device("meta"):
            model = self.spec.build(self.model_args)
        if self.upcycle is not None:
            self._parallelize_upcycled(model, load_hf)
            return model
        self._materialize(model, load_hf)
        self._parallelize(model)
        return model

    def _build_pipeline(self, load_hf: bool) -> tuple[nn.Module, PipelineRunner]:
        """This rank's stages (sharing one module with the full model's names) and schedule."""
        config, args = self.config, self.model_args
        plan = plan_pipeline(
            config.parallelism, args.n_layers, self.micro_batch_size, config.training.seq_len
        )
        pp_mesh = self.dims.mesh("pp")
        placement = {
            "rank": pp_mesh.get_local_rank(),
            "num_ranks": plan.num_ranks,
            "stage_style": plan.stage_style,
            "stage_indices": plan.stage_indices(pp_mesh.get_local_rank()),
        }
        with torch.device("meta"):
            full_model = self.spec.build(args)
        rank_model = build_rank_model(
            full_model,
            plan.module_names_per_stage,
            **placement,
            outside_stages=plan.modules_outside_stages,
        )
        parallelize = self._parallelize
        if self.upcycle is None:
            self._materialize(rank_model, load_hf)
        else:  # each stage is sharded on meta, then filled (no vocab parallelism: validated)
            parallelize = functools.partial(self._parallelize_upcycled, load_hf=load_hf)
        vocab_group = None
        if plan.vocab_parallel:  # this rank's rows, under the full model's names
            # the output passes' collectives get their own group: on NCCL a pipeline send
            # blocks its communicator until received, and a pass may sit behind one
            vocab_group = new_group_along(self.mesh, "pp")
            with self.device:
                embedding, output = vocab_shard_modules(args.vocab_size, args.dim, vocab_group)
            copy_full_vocab_rows(
                embedding, output, functools.partial(self._materialize, load_hf=load_hf), full_model
            )
            rank_model.tok_embeddings, rank_model.output = embedding, output
            if self.mesh is not None:
                self._shard_vocab(embedding, output)
        shapes = StageShapes(
            rows=self.micro_batch_size // plan.num_microbatches,
            slice_length=config.training.seq_len // plan.num_slices,
            model_dim=args.dim,
            vocab_size=args.vocab_size,
            dtype=torch.float32,
            vocab_parallel=plan.vocab_parallel,
        )
        stages = wrap_rank_stages(
            rank_model,
            plan.module_names_per_stage,
            **placement,
            shapes=shapes,
            num_slices=plan.num_slices,
            device=self.device,
            parallelize=parallelize,
            group=pp_mesh.get_group(),
            backend=config.model.attention_backend,
        )
        vocab = None
        if plan.vocab_parallel:
            stage_ranks = [plan.stage_rank(stage) for stage in (0, plan.num_stages - 1)]
            vocab = PipelineVocabParallel(
                rank_model.tok_embeddings,
                rank_model.output,
                shapes,
                first_rank=stage_ranks[0],
                last_rank=stage_ranks[1],
                group=vocab_group,
            )
        exchange = None
        if plan.context_exchange:  # a group of its own, for the same reason as the vocabulary's
            exchange = PipelineContextExchange(
                new_group_along(self.mesh, "pp"),
                llama_layers_per_stage(plan.module_names_per_stage),
                timeout=timedelta(seconds=config.parallelism.collective_timeout_s),
            )
        runner = build_pipeline_runner(
            plan.schedule,
            stages,
            plan.num_microbatches,
            plan.num_slices,
            actions_by_rank=plan.actions_by_rank,
            vocab=vocab,
            exchange=exchange,
        )
        return rank_model, runner

    def _shard_vocab(self, embedding: nn.Module, output: nn.Module) -> None:
        """Data parallelism over the vocabulary shards. The output layer runs once per unit, so
        it stays gathered from its forward to its backward (PipelineVocabParallel syncs its
        gradients after the step's last pass)."""
        training = self.config.training
        precision = {
            "param_dtype": _DTYPES[training.mixed_precision_param],
            "reduce_dtype": _DTYPES[training.mixed_precision_reduce],
        }
        apply_data_parallel(embedding, self.mesh, self.dims, **precision)
        apply_data_parallel(output, self.mesh, self.dims, reshard_after_forward=False, **precision)

    def _measured_peak_flops(self) -> float:
        flops = torch.tensor(measure_matmul_flops(), dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(flops)
            flops /= self.world_size
        return float(flops)

    def _checkpoint_state(self) -> dict[str, Any]:
        return {
            "model_and_optimizer": ModelOptimizerState(
                self.model, self.optimizer, row_shards=self._row_shards(), mesh=self.mesh
            ),
            "lr_scheduler": self.lr_scheduler,
            "data": self.data,
            "trainer": _TrainerProgress(self),
        }

    def _row_shards(self) -> dict[str, int]:
        """Parameters split by rows across the pipeline ranks (vocabulary parallelism), with the
        rows of the full matrix."""
        if self.pipeline is None or self.pipeline.vocab is None:
            return {}
        return {f"{name}.weight": self.model_args.vocab_size for name in VOCAB_MODULE_NAMES}

    def _autocast(self) -> Any:
        """Mixed precision without FSDP (one rank): autocast; FSDP2 does it by itself."""
        param_dtype = _DTYPES[self.config.training.mixed_precision_param]
        enabled = self.mesh is None and param_dtype != torch.float32
        return torch.autocast(self.device.type, dtype=param_dtype, enabled=enabled)

    def _all_reduce_sum(self, value: Tensor) -> Tensor:
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(value)
        return value

    def train_step(self) -> tuple[float, float, int]:
        """One optimizer step: returns (loss, grad norm, global label tokens)."""
        micro_batches = [
            next(self.data).to(self.device)
            for _ in range(self.config.training.gradient_accumulation_steps)
        ]
        local_tokens = sum(count_label_tokens(batch["labels"]) for batch in micro_batches)
        # The ranks of one pipeline read the same batch: count it once.
        global_tokens = self._all_reduce_sum(torch.as_tensor(local_tokens, device=self.device))
        global_tokens = global_tokens // self.dims.pp
        loss_sum = torch.zeros((), device=self.device)
        trace = self.step + 1 == self.config.metrics.pipeline_trace_step
        with record_pipeline_step(
            self.pipeline, self.output_dir, enabled=trace, write=self.rank == 0
        ):
            for batch in micro_batches:
                with aux_loss_scale(self._aux_loss_share):
                    loss = self._forward_backward(batch, global_tokens)
                if loss is not None:  # pipelined: only the rank with the last stage has a loss
                    loss_sum += loss.detach()
        if self._expert_mesh is not None and self._expert_mesh["ep_replicate"].size() > 1:
            replicas = self._expert_mesh["ep_replicate"].get_group()
            all_reduce_replicated_expert_grads(self.model, replicas)
        global_loss = float(self._all_reduce_sum(loss_sum))
        if not math.isfinite(global_loss):
            raise NonFiniteLossError(
                f"loss is {global_loss} at step {self.step + 1}; stopping before the update. "
                "Lower optimizer.lr, raise lr_scheduler.warmup_steps, or set training.max_norm"
            )
        max_norm = self.config.training.max_norm
        grad_norm = clip_grad_norm_(
            list(self.model.parameters()),
            max_norm or math.inf,
            pipeline_group=self.dims.mesh("pp").get_group() if self.dims.pp_enabled else None,
        )
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return global_loss, float(grad_norm), int(global_tokens)

    def _forward_backward(self, batch: TensorDict, global_tokens: Tensor) -> Tensor | None:
        """Loss of one micro-batch (token sum over the global count), gradients accumulated."""
        if self.pipeline is not None:
            return self.pipeline.step(batch, global_tokens)
        context = CausalAttention(
            batch["document_ids"], backend=self.config.model.attention_backend
        )
        with self._autocast():
            logits_BSV = self.model(batch["tokens"], batch["positions"], context)
        loss = token_sum_cross_entropy(logits_BSV, batch["labels"], global_tokens)
        loss.backward()  # data parallelism sums gradients (pipekit.distributed.fsdp)
        return loss

    def train(self) -> list[float]:
        """Run to `training.steps`; returns the losses of the steps this call ran."""
        config = self.config
        if self.rank == 0:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            model = f"{config.model.name}/{config.model.flavor}"
            if self.upcycle is not None:
                upcycle = self.upcycle
                model += (
                    f" upcycled to {self.spec.name} ({upcycle.total_experts} experts, "
                    f"top-{upcycle.routed_experts})"
                )
            print(
                f"training {model} on {self.world_size} rank(s), "
                f"steps {self.step + 1}..{config.training.steps}",
                flush=True,
            )
        losses = []
        window_start, window_tokens = time.perf_counter(), 0
        while self.step < config.training.steps:
            loss, grad_norm, tokens = self.train_step()
            losses.append(loss)
            window_tokens += tokens
            last = self.step == config.training.steps
            if self.step == 1 or last or self.step % config.metrics.log_interval == 0:
                elapsed = time.perf_counter() - window_start
                tokens_per_s = window_tokens / elapsed
                record = {
                    "step": self.step,
                    "loss": loss,
                    "grad_norm": grad_norm,
                    "lr": float(self.lr_scheduler.get_last_lr()[0]),
                    "tokens_per_s": tokens_per_s,
                    "mfu": tokens_per_s
                    * self.flops_per_token
                    / (self.peak_flops * self.world_size),
                    **memory_stats(self.model, self.optimizer),
                }
                self.metrics.log(record)
                window_start, window_tokens = time.perf_counter(), 0
            if config.checkpoint.enable and (last or self.step % config.checkpoint.interval == 0):
                self.checkpoints.save(self.step, self._checkpoint_state())
        if config.checkpoint.export_hf_at_end:
            self.export_hf(self.output_dir / "hf")
        return losses

    def export_hf(self, directory: Path) -> None:
        """Write the current weights in Hugging Face layout (gathered to rank 0)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self.rank == 0:
            plain = self.spec.build(self.model_args)
            plain.load_state_dict(full)
            self.spec.save_hf(plain, self.model_args, str(directory))
        if dist.is_initialized():
            dist.barrier()


class _TrainerProgress:
    """The step counter and RNG states, as a checkpointable object."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.trainer.step, "rng": capture_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trainer.step = int(state["step"])
        restore_rng_state(state["rng"])
