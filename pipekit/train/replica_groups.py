"""Fault-tolerant replica groups: torchft's `Manager` between the groups of one job.

Each replica group is a torchrun of its own (FSDP, TP, CP and the pipeline inside it, as any
job); the groups split the global batch as dp_replicate would and meet through a torchft
lighthouse, which forms a quorum of the groups alive at each step. A step:

1. `start_step`: the quorum; a group that (re)joins behind the others receives the training
   state from a live peer here (torchft's recovery transport), not from a checkpoint.
2. `sum_over_groups` of the step's label tokens: each group's loss is normalised by the tokens
   of every group in the quorum, so summed gradients are the quorum's mean token loss.
3. after the backward, `sum_gradients`: every rank's gradient shard summed with the same rank
   of the other groups (their layouts are equal, so shards line up) over torchft's
   fault-tolerant process group, which is rebuilt when the quorum changes.
4. `should_commit`: the groups agree whether every sum went through; if not (a group died in
   the step) nobody steps the optimizer and the step is taken again on the next batch.

With `sync_every` H > 1 the groups instead train apart and average their weights every H steps
(LocalSGD, `semi_synchronous`).

torchft is imported only here and only when `[fault_tolerance] enabled = true`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from pipekit.config.fault_tolerance import FaultToleranceConfig
from pipekit.config.loader import ConfigError

__all__ = ["ReplicaGroups", "check_fault_tolerance"]

logger = logging.getLogger(__name__)

LIGHTHOUSE_VARIABLE = "TORCHFT_LIGHTHOUSE"


def check_fault_tolerance(config: FaultToleranceConfig, dp_replicate: int) -> int:
    """The number of replica groups the batch is split over (1 when disabled); ConfigError
    naming the fix for a section that cannot run."""
    if not config.enabled:
        return 1
    rules = [
        (importlib.util.find_spec("torchft") is not None,
         "needs torchft: pip install 'pipekit[ft]', or set enabled = false"),
        (config.groups >= 1, f"groups={config.groups} must be >= 1"),
        (0 <= config.replica_group < config.groups,
         f"replica_group={config.replica_group} must be in 0 .. groups - 1 = {config.groups - 1}"),
        (1 <= config.min_replicas <= config.groups,
         f"min_replicas={config.min_replicas} must be in 1 .. groups = {config.groups}"),
        (dp_replicate == 1,
         f"the replica groups take the place of dp_replicate={dp_replicate}: set "
         "[parallelism] dp_replicate = 1 and run one torchrun per group"),
        (bool(config.lighthouse or os.environ.get(LIGHTHOUSE_VARIABLE)),
         f"needs the lighthouse's address: set lighthouse = \"http://host:29510\" or the "
         f"{LIGHTHOUSE_VARIABLE} variable"),
        (config.sync_every >= 1, f"sync_every={config.sync_every} must be >= 1"),
        (config.timeout_s > 0 and config.quorum_timeout_s > 0,
         f"timeout_s={config.timeout_s} and quorum_timeout_s={config.quorum_timeout_s} must "
         "be > 0"),
    ]  # fmt: skip
    for holds, message in rules:
        if not holds:
            raise ConfigError(f"[fault_tolerance] {message}")
    return config.groups


def _tensor_bytes(state: Any) -> int:
    """Bytes of the tensors in a nested state dict (a DTensor's: this rank's shard)."""
    if isinstance(state, Tensor):
        return _local(state).nbytes
    if isinstance(state, dict):
        return sum(_tensor_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_tensor_bytes(value) for value in state)
    return 0


def _local(tensor: Tensor) -> Tensor:
    """The tensor this rank holds (a DTensor's local shard)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ReplicaGroups:
    """This rank's torchft `Manager`: the quorum, the sums over the groups and the commit
    (see the module docstring). `training_state` gives the checkpoint's parts (model and
    optimizer, schedule, data position, step), which a recovering group copies from a live
    one: each rank's shards to the same rank of the other group."""

    def __init__(
        self,
        config: FaultToleranceConfig,
        device: torch.device,
        training_state: Callable[[], dict[str, Any]],
    ) -> None:
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        timeout = timedelta(seconds=config.timeout_s)
        process_group = (
            ProcessGroupNCCL(timeout=timeout)
            if device.type == "cuda"
            else ProcessGroupGloo(timeout=timeout)
        )
        self.config = config
        self._training_state = training_state
        store: dict[str, Any] = {}
        if "MASTER_ADDR" not in os.environ:  # `python train.py`: host the group's store here
            self._store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
            store = {"store_addr": "localhost", "store_port": self._store.port}
        self.manager = Manager(
            pg=process_group,
            load_state_dict=self._load_peer_state,
            state_dict=self._peer_state,
            min_replica_size=config.min_replicas,
            use_async_quorum=False,  # a rejoining group heals before its forward
            timeout=timeout,
            quorum_timeout=timedelta(seconds=config.quorum_timeout_s),
            rank=dist.get_rank() if dist.is_initialized() else 0,
            world_size=dist.get_world_size() if dist.is_initialized() else 1,
            lighthouse_addr=config.lighthouse or None,
            replica_id=f"pipekit_group_{config.replica_group}",
            init_sync=False,  # every group builds the same weights from the job's seed
            **store,
        )
        self._participants: int | None = None
        self.recovered_bytes = 0
        """Bytes of training state this rank received from live groups, over the run."""

    def _peer_state(self) -> dict[str, Any]:
        """What this group sends a recovering one (torchft sends its own progress apart)."""
        return {key: part.state_dict() for key, part in self._training_state().items()}

    def _load_peer_state(self, state: dict[str, Any]) -> None:
        parts = self._training_state()
        for key, part_state in state.items():
            parts[key].load_state_dict(part_state)
        self.recovered_bytes += _tensor_bytes(state)

    def start_step(self) -> None:
        """Join the step's quorum (a group behind the others first receives the training state
        from a live one); one log line when the groups in it change, and one per recovery
        with the bytes this rank received and the seconds the quorum took."""
        started, received = time.perf_counter(), self.recovered_bytes
        self._start_quorum()
        if self._participants is None:  # this process's first step: wait for every group
            self._wait_for_every_group(started + self.config.quorum_timeout_s)
        step = self.manager.current_step() + 1
        if self.recovered_bytes > received:
            logger.info(
                "recovered the training state of step %d from a live replica group: %d bytes "
                "on this rank in %.2f s", step - 1, self.recovered_bytes - received,
                time.perf_counter() - started,
            )  # fmt: skip
        participants = self.manager.num_participants()
        if participants != self._participants:
            logger.info(
                "step %d: %d of %d replica groups in the quorum",
                step, participants, self.config.groups,
            )  # fmt: skip
            self._participants = participants

    def _wait_for_every_group(self, deadline: float) -> None:
        """Ask for quorums until every group is in one, or `deadline`: groups start seconds
        apart, and the first one up would otherwise train the first steps alone and the
        others copy its state instead of starting with it (a group restarted while the others
        run finds them all at once)."""
        while self.manager.num_participants() < self.config.groups:
            if time.perf_counter() > deadline:
                logger.warning(
                    "not every replica group joined within quorum_timeout_s=%s; starting with %d",
                    self.config.quorum_timeout_s, self.manager.num_participants(),
                )  # fmt: skip
                return
            time.sleep(0.1)
            self._start_quorum()

    def _start_quorum(self) -> None:
        """torchft's quorum, or one line naming the lighthouse when none forms (torchft's own
        error is a bare gRPC status)."""
        try:
            self.manager.start_quorum()
        except Exception as error:
            lighthouse = self.config.lighthouse or os.environ.get(LIGHTHOUSE_VARIABLE)
            raise TimeoutError(
                f"replica group {self.config.replica_group}: no quorum from the lighthouse at "
                f"{lighthouse} within quorum_timeout_s={self.config.quorum_timeout_s} "
                f"({type(error).__name__}: {error}); if it is down, start it again, then the "
                "groups: they resume from their last checkpoints"
            ) from error

    @property
    def synchronous(self) -> bool:
        """Whether gradients are summed over the groups every step (else LocalSGD)."""
        return self.config.sync_every == 1

    def semi_synchronous(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int
    ) -> contextlib.AbstractContextManager[Any]:
        """Around the training loop from `step` on: with `sync_every` H > 1, torchft's
        LocalSGD, which after every H-th optimizer step forms a quorum and averages the
        groups' weights (each rank's shards; kept local where the quorum fails); otherwise
        nothing. A job resumed between two syncs syncs at the steps the uninterrupted run
        does (multiples of H)."""
        if self.synchronous:
            return contextlib.nullcontext()
        from torchft.local_sgd import LocalSGD

        local_sgd = LocalSGD(self.manager, model, optimizer, sync_every=self.config.sync_every)
        # torchft 0.2 counts the steps to the next sync from its construction and has no
        # setting for a start between two syncs.
        local_sgd._local_step = step % self.config.sync_every
        return local_sgd

    @property
    def participants(self) -> int:
        """Groups in the current step's quorum."""
        return self.manager.num_participants()

    def sum_over_groups(self, value: Tensor) -> Tensor:
        """`value` summed over the quorum's groups, in place (float)."""
        self.manager.allreduce(value, reduce_op=dist.ReduceOp.SUM).wait()
        return value

    def sum_gradients(self, parameters: Iterable[nn.Parameter]) -> None:
        """Every gradient (this rank's shard) summed over the quorum's groups, in place: one
        sum per dtype over the gradients laid end to end (a sum per tensor costs a round trip
        each)."""
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for param in parameters:
            if param.grad is not None:
                grad = _local(param.grad)
                by_dtype.setdefault(grad.dtype, []).append(grad)
        for grads in by_dtype.values():
            flat = torch.cat([grad.reshape(-1) for grad in grads])
            self.manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM).wait()
            for grad, summed in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                grad.copy_(summed.view_as(grad))

    def should_commit(self) -> bool:
        """Whether every group's sums went through, agreed by all: step the optimizer only
        then."""
        return bool(self.manager.should_commit())

    def start_at(self, step: int) -> None:
        """Set torchft's progress from the training step the job starts at (0, or the step it
        resumed): torchft counts committed syncs, one per step (or per `sync_every` steps),
        so it follows from the step, and a checkpoint need not hold it; that keeps the
        checkpoints of jobs with and without fault tolerance interchangeable. (Its count of
        batches committed, which nothing reads, starts over.)"""
        self.manager.load_state_dict(
            {"step": step // self.config.sync_every, "batches_committed": 0}
        )

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
