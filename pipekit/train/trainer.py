"""The training loop: build, step, log, checkpoint; resume and export.

`Trainer(job)` takes a `Job` (`pipekit.train.job.validate_job`: the config, checked and resolved)
inside an initialised process group, builds this rank's model or pipeline
(`pipekit.train.model_setup`), the optimizer, LR schedule and data loader, and resumes from the
newest complete checkpoint. `train()` runs to `training.steps`.

Legend: B local micro-batch, S sequence, V vocabulary.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import Tensor
from torch.distributed.tensor.parallel import loss_parallel

from pipekit.attention.context import (
    AttentionContext,
    CausalAttention,
)
from pipekit.checkpoint.dcp import (
    EXPORT_DTYPES,
    CheckpointManager,
    ModelOptimizerState,
    load_checkpoint,
)
from pipekit.config.dump import dump_toml, write_job_config
from pipekit.config.loader import to_dict
from pipekit.distributed.context_parallel import ContextParallelRanks, context_parallel_ranks
from pipekit.distributed.fsdp import MIXED_PRECISION_DTYPES
from pipekit.distributed.grad_clip import clip_grad_norm_
from pipekit.layers.loss import count_label_tokens
from pipekit.layers.sequence_statistics import statistics_group
from pipekit.moe.aux_loss import aux_loss_scale
from pipekit.moe.bias_balance import (
    ROUTER_BIAS_NAMES,
    discard_expert_loads,
    update_expert_biases,
)
from pipekit.pipelining.tools.trace import record_pipeline_step
from pipekit.train.checkpoint_rules import is_pipekit_checkpoint, step_to_resume
from pipekit.train.chunked_output import ChunkedOutputLoss
from pipekit.train.compile import job_loss_fn
from pipekit.train.config_values import MODEL_ONLY
from pipekit.train.data import build_data_loader
from pipekit.train.determinism import use_deterministic
from pipekit.train.job import Job
from pipekit.train.lr_schedule import build_lr_scheduler
from pipekit.train.metric_writers import (
    JsonlWriter,
    MetricWriter,
    TensorBoardWriter,
    WandbWriter,
)
from pipekit.train.metrics import (
    MetricsLogger,
    measure_matmul_flops,
    memory_stats,
    training_flops_per_token,
)
from pipekit.train.model_setup import build_job_model
from pipekit.train.multi_token_loss import MultiTokenLoss
from pipekit.train.non_finite import NonFiniteLossError, handle_non_finite
from pipekit.train.optimizer import build_optimizer
from pipekit.train.profiling import StepProfiler
from pipekit.train.progress import ThroughputWindow, TrainingProgress
from pipekit.train.replica_groups import ReplicaGroups
from pipekit.train.stop_signals import StopSignals

__all__ = ["NonFiniteLossError", "Trainer"]

logger = logging.getLogger(__name__)


class Trainer:
    """One training job, built from a validated `Job` inside an initialised process group."""

    def __init__(self, job: Job) -> None:
        config = self.config = job.config
        self.job = job
        use_deterministic(config.debug.deterministic)
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.device = torch.device(
            f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        )
        self.dims = job.dims
        self.mesh = self.dims.build_mesh(self.device.type) if self.world_size > 1 else None
        self._context_parallel: ContextParallelRanks | None = None
        if self.dims.cp_enabled:
            assert self.mesh is not None
            pipeline = job.pipeline
            self._context_parallel = context_parallel_ranks(
                self.mesh, config.parallelism, config.training.seq_len,
                pipeline.num_slices if pipeline is not None else 1, pipeline is not None,
                pipeline.slices.microbatch_bounds if pipeline is not None else None,
            )  # fmt: skip
        self._statistics_group = self._sequence_group()
        self.output_dir = Path(config.job.output_dir)
        self.checkpoints = CheckpointManager(
            self.output_dir / config.checkpoint.folder,
            keep_last=config.checkpoint.keep_last,
            asynchronous=config.checkpoint.async_save,
            job_config=dump_toml(to_dict(config)),
        )
        resume_step = step_to_resume(config)
        torch.manual_seed(config.job.seed)
        initial = Path(config.checkpoint.initial_load_path or ".")
        initial_pipekit = resume_step is None and is_pipekit_checkpoint(initial)
        built = build_job_model(
            job, self.mesh, self.device, load_hf=resume_step is None and not initial_pipekit
        )
        self.model, self.pipeline = built.model, built.pipeline
        self._loss_fn = job_loss_fn(config.compile.enable, job.loss_parallel)
        chunk_tokens = config.training.loss_chunk_tokens  # validated: jobs without a pipeline
        self._chunked_loss = (
            ChunkedOutputLoss(self.model, job.spec.structure, chunk_tokens)
            if chunk_tokens
            else None
        )
        self._multi_token = MultiTokenLoss(job.multi_token_depth)
        self.optimizer = build_optimizer(self.model, config.optimizer, job.spec.structure)
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer, config.training.steps, config.lr_scheduler
        )
        dp_degree = job.data_parallel_degree
        self.micro_batch_size = job.local_batch_size
        data_options: dict[str, Any] = dict(
            seq_len=config.training.seq_len,
            local_batch_size=self.micro_batch_size,
            dp_rank=job.data_parallel_rank(self.dims.dp_rank(self.mesh)),
            dp_world_size=dp_degree,
            seed=config.job.seed,
        )
        held_out = config.validation.fraction if config.validation.enable else 0.0
        microbatches = job.pipeline.num_microbatches if job.pipeline is not None else 1
        self.data = build_data_loader(
            config.data, **data_options, held_out=held_out, microbatches=microbatches
        )
        self.validation_data = None
        if config.validation.enable:
            self.validation_data = build_data_loader(
                config.data, **data_options, held_out=config.validation.fraction, split="validation"
            )
        # MoE auxiliary losses are averaged over the forwards of a step, as token losses are:
        # every micro-batch of every data-parallel rank holds B x S tokens (a pipeline divides
        # its share among its units itself).
        self._aux_loss_share = 1.0 / (dp_degree * config.training.gradient_accumulation_steps)
        self.step = 0
        self.replica_groups: ReplicaGroups | None = None
        if config.fault_tolerance.enabled:
            self.replica_groups = ReplicaGroups(
                config.fault_tolerance, self.device, self._checkpoint_state
            )
        excluded = config.checkpoint.exclude_from_loading
        if initial_pipekit:  # into any layout: the model alone, or the whole training state
            model_only = config.checkpoint.initial_load_model_only
            excluded = MODEL_ONLY if model_only else excluded
            load_checkpoint(initial, self._checkpoint_state(excluded))
            what = "model" if model_only else "training state"
            logger.info("initialised the %s from %s", what, initial)
        if resume_step is not None:
            self.checkpoints.load(resume_step, self._checkpoint_state(excluded))
        if (initial_pipekit or resume_step is not None) and "optimizer" in excluded:
            self.optimizer.state.clear()  # as built: the states start at the first update
        if resume_step is not None:
            logger.info(
                "resumed from %s (step %d)", self.checkpoints.path(resume_step), resume_step
            )
        if self.replica_groups is not None:
            self.replica_groups.start_at(self.step)
        self.metrics = MetricsLogger(
            self._metric_writers() if self.rank == 0 else [], config.training.steps
        )
        with torch.device("meta"):  # the whole model's FLOPs, whatever this rank holds
            full_model = job.spec.build(job.args)
        self.flops_per_token = training_flops_per_token(
            full_model, job.shape, job.spec.structure, config.training.seq_len
        )
        self.peak_flops = config.metrics.peak_flops or self._measured_peak_flops()
        self.profiler = StepProfiler(
            config.profiling, self.output_dir, self.rank, list(self.model.parameters())
        )

    def _metric_writers(self) -> list[MetricWriter]:
        """Rank 0's writers, each starting at the step the job starts from."""
        metrics = self.config.metrics
        writers: list[MetricWriter] = [
            JsonlWriter(self.output_dir / metrics.jsonl_file, start_step=self.step)
        ]
        if metrics.tensorboard:
            writers.append(TensorBoardWriter(self.output_dir / "tensorboard", self.step))
        if metrics.wandb:
            writers.append(
                WandbWriter(self.output_dir, metrics.wandb_project, self.config.job.name)
            )
        return writers

    def _measured_peak_flops(self) -> float:
        compute_dtype = MIXED_PRECISION_DTYPES[self.config.training.mixed_precision_param]
        flops = torch.tensor(measure_matmul_flops(self.device, compute_dtype), dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(flops)
            flops /= self.world_size
        return float(flops)

    def _checkpoint_state(
        self, excluded: Sequence[str] = (), save_dtype: torch.dtype | None = None
    ) -> dict[str, Any]:
        """What a checkpoint holds, less the `excluded` parts (a resume's
        `exclude_from_loading`: the model is always there); a model-only save casts the
        weights to `save_dtype`."""
        row_shards = self.pipeline.row_sharded_parameters() if self.pipeline else {}
        full_rows = {name: shard.rows for name, shard in row_shards.items()}
        state = {
            "model_and_optimizer": ModelOptimizerState(
                self.model,
                self.optimizer,
                row_shards=full_rows,
                mesh=self.mesh,
                row_dims=self.pipeline.row_shard_dims() if self.pipeline else ("pp",),
                with_optimizer="optimizer" not in excluded,
                save_dtype=save_dtype,
                kept_on_load=ROUTER_BIAS_NAMES if "router_biases" in excluded else (),
            ),
            "lr_scheduler": self.lr_scheduler,
            "data": self.data,
            "trainer": TrainingProgress(self),
        }
        parts = {"data": ("data",), "progress": ("trainer", "lr_scheduler")}
        dropped = {key for name in excluded for key in parts.get(name, ())}
        return {key: value for key, value in state.items() if key not in dropped}

    @property
    def _summed_groups(self) -> ReplicaGroups | None:
        """The replica groups when gradients are summed over them every step."""
        groups = self.replica_groups
        return groups if groups is not None and groups.synchronous else None

    def _autocast(self) -> Any:
        """Mixed precision without FSDP (one rank): autocast; FSDP2 does it by itself."""
        param_dtype = MIXED_PRECISION_DTYPES[self.config.training.mixed_precision_param]
        enabled = self.mesh is None and param_dtype != torch.float32
        return torch.autocast(self.device.type, dtype=param_dtype, enabled=enabled)

    def _all_reduce_sum(self, value: Tensor) -> Tensor:
        if dist.is_initialized() and self.world_size > 1:
            dist.all_reduce(value)
        return value

    def train_step(self) -> tuple[float, float, int] | None:
        """One optimizer step: returns (loss, grad norm, global label tokens); None when a
        replica group failed during it (nobody stepped: the next batch takes the step)."""
        summed = self._summed_groups
        if summed is not None:
            summed.start_step()
        micro_batches = [
            next(self.data) for _ in range(self.config.training.gradient_accumulation_steps)
        ]
        trace = self.step + 1 == self.config.metrics.pipeline_trace_step
        with record_pipeline_step(
            self.pipeline, self.output_dir, enabled=trace, write=self.rank == 0
        ):
            global_loss, global_tokens = self._loss(micro_batches, backward=True)
        if summed is not None:
            summed.sum_gradients(self.model.parameters())
            if not summed.should_commit():  # a group failed in the step
                self.optimizer.zero_grad(set_to_none=True)
                return None
        grad_norm = math.nan
        if math.isfinite(global_loss):
            max_norm = self.config.training.max_norm
            grad_norm = float(
                clip_grad_norm_(
                    list(self.model.parameters()),
                    max_norm or math.inf,
                    pipeline_group=self.dims.mesh("pp").get_group()
                    if self.dims.pp_enabled
                    else None,
                    duplicates=self.pipeline.duplicate_parameters() if self.pipeline else (),
                    tensor_split=self.pipeline.tensor_split_parameters() if self.pipeline else None,
                )
            )
        if math.isfinite(global_loss) and math.isfinite(grad_norm):
            self.optimizer.step()
            update_expert_biases(self.model, self._stage_group())
        else:  # the loss and the norm are global: every rank takes this branch
            policy = self.config.training.on_nonfinite
            handle_non_finite(self.model, policy, global_loss, grad_norm, self.step + 1, self.rank)
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return global_loss, grad_norm, int(global_tokens)

    def _loss(self, micro_batches: list[TensorDict], backward: bool) -> tuple[float, int]:
        """The loss of one global batch (its micro-batches' token sums over the global label
        count) and that count; with `backward`, gradients accumulated."""
        micro_batches = [self._context_shard(batch.to(self.device)) for batch in micro_batches]
        local_tokens = sum(count_label_tokens(batch["labels"]) for batch in micro_batches)
        # The ranks of one pipeline, and of one tensor-parallel group, read the same batch:
        # count it once.
        same_batch = self.dims.pp * self.dims.tp
        global_tokens = self._all_reduce_sum(torch.as_tensor(local_tokens, device=self.device))
        global_tokens = global_tokens // same_batch
        summed = self._summed_groups if backward else None
        if summed is not None:  # the quorum's tokens
            global_tokens = summed.sum_over_groups(global_tokens.double()).long()
        loss_sum = torch.zeros((), device=self.device)
        for batch in micro_batches:
            with aux_loss_scale(self._aux_loss_share):
                loss = self._forward_backward(batch, global_tokens, backward)
            if loss is not None:  # pipelined: only the rank with the last stage has a loss
                loss_sum += loss.detach()
        loss_sum = self._all_reduce_sum(loss_sum)
        self._multi_token.end_step(self._all_reduce_sum, global_tokens, training=backward)
        if summed is not None:
            loss_sum = summed.sum_over_groups(loss_sum)
        return float(loss_sum) / self.dims.tp, int(global_tokens)

    def validation_loss(self) -> float:
        """Mean token loss over the first `validation.steps` global batches of the held-out
        rows. Outside pipelines a forward without gradients; a pipeline runs its schedule,
        forward and backward, and the gradients are dropped (its schedules are training
        schedules), so every layout evaluates the model it trains."""
        assert self.validation_data is not None
        accumulation = self.config.training.gradient_accumulation_steps
        loss_sum, token_sum = 0.0, 0
        for step in range(self.config.validation.steps):
            batches = [
                self.validation_data.batch_of_step(step * accumulation + micro)
                for micro in range(accumulation)
            ]
            loss, tokens = self._loss(batches, backward=False)
            loss_sum, token_sum = loss_sum + loss * tokens, token_sum + tokens
        self.optimizer.zero_grad(set_to_none=True)
        discard_expert_loads(self.model)  # the routers' counts are the training steps'
        return loss_sum / token_sum

    def _stage_group(self) -> dist.ProcessGroup | None:
        """Every rank holding tokens of this rank's pipeline stage (all but the pp dim): the
        routers' expert loads are summed over them."""
        return self.dims.mesh("dp_cp_tp").get_group() if self.dims.has_mesh("dp_cp_tp") else None

    def _sequence_group(self) -> dist.ProcessGroup | None:
        """The ranks that split a sequence's tokens (cp, and tp under sequence parallelism):
        MoE load-balancing statistics are added over them."""
        if self.job.sequence_parallel:
            return self.dims.mesh("cp_tp").get_group()
        return self.dims.mesh("cp").get_group() if self.dims.cp_enabled else None

    def _context_shard(self, batch: TensorDict) -> TensorDict:
        """Under context parallelism, this rank's tokens of the batch's rows (a pipeline's
        microbatches each dealt by their own documents)."""
        if self._context_parallel is None:
            return batch
        microbatches = self.pipeline.num_microbatches if self.pipeline is not None else 1
        return self._context_parallel.shard(batch, microbatches)

    def _forward_backward(
        self, batch: TensorDict, global_tokens: Tensor, backward: bool
    ) -> Tensor | None:
        """Loss of one micro-batch (token sum over the global count), gradients accumulated
        when `backward` (a pipeline always runs its backward); under loss parallelism inside
        torch's `loss_parallel()`, whose cross-entropy on vocabulary shards needs it around
        forward and backward alike."""
        gradients = backward or self.pipeline is not None
        with (
            loss_parallel() if self.job.loss_parallel else contextlib.nullcontext(),
            torch.set_grad_enabled(gradients),
            self._multi_token.targets(batch, global_tokens),
        ):
            return self._forward_backward_in_context(batch, global_tokens, gradients)

    def _forward_backward_in_context(
        self, batch: TensorDict, global_tokens: Tensor, backward: bool
    ) -> Tensor | None:
        if self.pipeline is not None:
            with statistics_group(self._statistics_group):
                return self.pipeline.step(batch, global_tokens)
        backend = self.config.model.attention_backend
        context: AttentionContext = CausalAttention(batch["document_ids"], backend=backend)
        if self._context_parallel is not None:
            context = self._context_parallel.attention(batch, backend)
        tokens, positions, labels = batch["tokens"], batch["positions"], batch["labels"]
        with self._autocast(), statistics_group(self._statistics_group):
            if self._chunked_loss is not None:  # the loss, its logits never whole
                loss = self._chunked_loss(tokens, positions, context, labels, global_tokens)
            else:
                loss = self._loss_fn(self.model(tokens, positions, context), labels, global_tokens)
        if backward:
            loss.backward()  # data parallelism sums gradients (pipekit.distributed.fsdp)
        return loss

    def train(self) -> list[float]:
        """Run to `training.steps`, or until SIGINT/SIGTERM (then the step in progress ends
        and a checkpoint is saved); returns the losses of the steps this call ran."""
        config = self.config
        if self.rank == 0:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            write_job_config(config, self.output_dir)
        logger.info(
            "training %s on %d rank(s), steps %d..%d",
            self.job.description,
            self.world_size,
            self.step + 1,
            config.training.steps,
        )
        losses: list[float] = []
        window = ThroughputWindow(self.step)
        stop_signal = None
        semi_synchronous = (
            self.replica_groups.semi_synchronous(self.model, self.optimizer, self.step)
            if self.replica_groups is not None
            else contextlib.nullcontext()
        )
        with (
            StopSignals() as stop,
            contextlib.closing(self.metrics),
            contextlib.closing(self.data),
            semi_synchronous,
        ):
            while self.step < config.training.steps and stop_signal is None:
                with self.profiler.step(self.step + 1):
                    taken = self.train_step()
                if taken is None:
                    logger.warning("step %d dropped: a replica group failed in it", self.step + 1)
                    continue
                loss, grad_norm, tokens = taken
                losses.append(loss)
                window.tokens += tokens
                last = self.step == config.training.steps
                if self.step == 1 or last or self.step % config.metrics.log_interval == 0:
                    self.metrics.log(self._record(loss, grad_norm, window))
                    window = ThroughputWindow(self.step)
                if self.validation_data is not None and (
                    last or self.step % config.validation.interval == 0
                ):
                    started = time.perf_counter()
                    self.metrics.log({"step": self.step, "val_loss": self.validation_loss()})
                    window.start += time.perf_counter() - started  # not training time
                stop_signal = stop.agreed_signal(self.device)
                interval = config.checkpoint.interval
                if config.checkpoint.enable and (
                    last or stop_signal is not None or self.step % interval == 0
                ):
                    self._save(model_only=last and config.checkpoint.last_save_model_only)
        self._log_saved(self.checkpoints.finish())
        if self.replica_groups is not None:
            self.replica_groups.shutdown()
        if stop_signal is not None:
            logger.info("stopped on %s after step %d; run the same command to resume",
                        stop_signal, self.step)  # fmt: skip
        elif config.checkpoint.export_hf_at_end:
            self.export_hf(self.output_dir / "hf")
        return losses

    def _save(self, model_only: bool = False) -> None:
        self._log_saved(self.checkpoints.finish())  # the save still in flight, if any
        if model_only:
            dtype = EXPORT_DTYPES[self.config.checkpoint.export_dtype]
            state = self._checkpoint_state(MODEL_ONLY, save_dtype=dtype)
        else:
            state = self._checkpoint_state()
        path = self.checkpoints.save(self.step, state, model_only=model_only)
        if path is None:
            logger.info("writing the checkpoint of step %d in the background", self.step)
        self._log_saved(path)

    @staticmethod
    def _log_saved(path: Path | None) -> None:
        if path is not None:
            logger.info("saved checkpoint %s", path)

    def _record(self, loss: float, grad_norm: float, window: ThroughputWindow) -> dict[str, Any]:
        """The metrics of the step just taken; throughput over the steps since the last one."""
        elapsed = time.perf_counter() - window.start
        tokens_per_s = window.tokens / elapsed  # every replica group's in the quorum, if summed
        groups = self._summed_groups.participants if self._summed_groups is not None else 1
        devices = self.world_size * groups
        return {
            "step": self.step,
            "loss": loss,
            "grad_norm": grad_norm,
            **self._multi_token.metrics,
            "lr": float(self.lr_scheduler.get_last_lr()[0]),
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / devices,
            "step_time_s": elapsed / (self.step - window.first_step),
            "mfu": tokens_per_s * self.flops_per_token / (self.peak_flops * devices),
            **memory_stats(self.model, self.optimizer),
        }

    def export_hf(self, directory: Path) -> None:
        """Write the current weights in Hugging Face layout: every rank writes its share of
        whole tensors from the shards and stages it holds (nothing gathered on one rank)."""
        hf = self.job.spec.hf
        assert hf is not None  # validated
        row_shards = self.pipeline.row_sharded_parameters() if self.pipeline else {}
        hf.save(self.model, self.job.args, str(directory), row_shards=row_shards)
        logger.info("exported %s layout to %s", self.job.spec.name, directory)
