"""Training-state checkpoints with torch.distributed.checkpoint (DCP): atomic and resharding.

A checkpoint is a folder `step-N` under the manager's folder. It is written as
`step-N.tmp-<token>`; after every rank has finished writing (a barrier), rank 0 writes the job's
config beside the tensors (`config.toml`, when the manager has one: what model wrote it), then
the `COMPLETE` marker, and renames the folder to `step-N`. A rename is atomic, so a crash at any
moment leaves either a tmp folder or a complete checkpoint, never a `step-N` that loads as valid
but is not. Deleting is the reverse (rename away, then remove), so pruning cannot leave a marked
folder with missing files either.

State is a dict of entries saved under their keys: `Stateful` objects (`ModelOptimizerState`,
an LR scheduler, a data loader) or plain dicts (`{"step": 12, "rng": capture_rng_state()}`).
Loading fills the same structure in place; DCP reads each rank's own shards, so a checkpoint
written at one data-parallel degree loads at another. Works without a process group (world
size 1) too. A checkpoint whose entries do not fit the state (another model) is named as such,
with the entries that differ (`pipekit.checkpoint.state_fit`), never called damaged.

pipekit seeds every rank identically (job.seed), so the random generators are replicated state:
like any plain tensor, DCP saves one copy (rank 0's) and every rank restores it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import Placement
from torch.optim import Optimizer

from pipekit._torch_private import StridedShard
from pipekit.checkpoint._durable import fsync_path
from pipekit.checkpoint.safe_metadata import SafeFileSystemReader
from pipekit.checkpoint.safetensors_io import CheckpointError
from pipekit.checkpoint.state_fit import CheckpointMismatchError, FittingLoadPlanner
from pipekit.config.dump import JOB_CONFIG_FILE

__all__ = [
    "COMPLETE_MARKER",
    "EXPORT_DTYPES",
    "CheckpointManager",
    "ModelOptimizerState",
    "capture_rng_state",
    "holds_model_only",
    "load_checkpoint",
    "restore_rng_state",
]

COMPLETE_MARKER = "COMPLETE"
"""File written into a checkpoint folder once every rank's data is on disk."""

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtypes `[checkpoint] export_dtype` names, for the floating weights of model-only saves."""

_COMPLETE_NAME = re.compile(r"step-(\d+)")


def capture_rng_state() -> dict[str, Tensor]:
    """The CPU generator's state, and the current CUDA device's when CUDA is available."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: Mapping[str, Tensor]) -> None:
    """Set the generators to a state from `capture_rng_state` (CUDA's only if both have it)."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


_FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)
"""Optimizer hyperparameters keyed per parameter name too: pipeline ranks hold different
parameters, and an unflattened `param_groups` list would be one entry that every rank overwrites."""


class ModelOptimizerState:
    """`Stateful` model and optimizer, keyed by parameter names (FQNs), not optimizer indices.

    `get_state_dict`/`set_state_dict` give FSDP2 models their DTensor shards, so DCP writes and
    reads only this rank's part, and the names survive wrapping and resharding.

    `row_shards` maps parameters of which each rank along the `row_dims` of the world `mesh`
    holds only some rows, cut as DTensor's `Shard(0)` cuts them on each dim in mesh order
    (vocabulary parallelism across the pipeline ranks, and their tp ranks), whether plain or
    sharded further by FSDP, to the rows of the full matrix. They and their optimizer state are
    saved as DTensors of the full matrix over `row_dims` (and the FSDP dims), so the ranks' rows
    are kept apart and a run with another split can load them.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        row_shards: Mapping[str, int] | None = None,
        mesh: DeviceMesh | None = None,
        row_dims: tuple[str, ...] = ("pp",),
        with_optimizer: bool = True,
        save_dtype: torch.dtype | None = None,
        kept_on_load: tuple[str, ...] = (),
    ) -> None:
        if row_shards and mesh is None:
            raise ValueError("row_shards needs the world mesh that holds their row dims")
        self.model = model
        self.optimizer = optimizer
        self.with_optimizer = with_optimizer
        """False: load (or save) the model alone; the optimizer keeps its state."""
        self.save_dtype = save_dtype
        """A model-only save's dtype for floating weights (None keeps theirs)."""
        self.kept_on_load = kept_on_load
        """Endings of model entries a load leaves as they are (not read from the checkpoint)."""
        self._kept: dict[str, Any] = {}
        self.row_shards, self.mesh, self.row_dims = dict(row_shards or {}), mesh, row_dims
        self._rows: dict[tuple[str, str], Tensor] = {}

    def state_dict(self) -> dict[str, Any]:
        model_state, optimizer_state = get_state_dict(
            self.model, self.optimizer, options=_FLAT_OPTIMIZER
        )
        self._rows = {}
        self._kept = {k: v for k, v in model_state.items() if k.endswith(self.kept_on_load)}
        model_state = {key: value for key, value in model_state.items() if key not in self._kept}
        for part, state in (("model", model_state), ("optimizer", optimizer_state)):
            for key, full_rows in self._row_sharded_keys(state):
                self._rows[part, key] = state[key]
                state[key] = self._full_matrix_view(state[key], full_rows)
        if not self.with_optimizer:
            if self.save_dtype is not None:
                model_state = {
                    key: value.to(self.save_dtype) if value.is_floating_point() else value
                    for key, value in model_state.items()
                }
            return {"model": model_state}
        return {"model": model_state, "optimizer": optimizer_state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        model_state = {**state_dict["model"], **self._kept}
        if not self.with_optimizer:
            for key, _ in self._row_sharded_keys(model_state):
                model_state[key] = self._rows["model", key]
            set_model_state_dict(self.model, model_state, options=_FLAT_OPTIMIZER)
            return
        optimizer_state = dict(state_dict["optimizer"])
        # DCP filled the full-matrix views in place, so the rows they wrap hold the loaded values
        for part, state in (("model", model_state), ("optimizer", optimizer_state)):
            for key, _ in self._row_sharded_keys(state):
                state[key] = self._rows[part, key]
        weight_decays = [group.get("weight_decay") for group in self.optimizer.param_groups]
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=model_state,
            optim_state_dict=optimizer_state,
            options=_FLAT_OPTIMIZER,
        )
        # Which parameters decay is the loading job's choice ([optimizer] no_decay): torch
        # gives each group the saved values of its first parameter, and the saving job may
        # have grouped them otherwise.
        for group, weight_decay in zip(self.optimizer.param_groups, weight_decays, strict=True):
            group["weight_decay"] = weight_decay

    def _row_sharded_keys(self, state: Mapping[str, Any]) -> list[tuple[str, int]]:
        """The row-sharded parameters' entries and their optimizer state of the same shape,
        with the full matrix's rows."""
        return [
            (key, full_rows)
            for key, value in state.items()
            for fqn, full_rows in self.row_shards.items()
            if key == fqn or (key.startswith(f"state.{fqn}.") and value.ndim > 0)
        ]

    def _full_matrix_view(self, rows: Tensor, full_rows: int) -> Tensor:
        """This rank's rows (plain, or an FSDP shard of them) as a DTensor of the full matrix,
        sharing their storage."""
        assert self.mesh is not None  # checked in __init__
        outer = tuple(dim for dim in self.row_dims if dim != "tp")
        inner = ("tp",) if "tp" in self.row_dims else ()
        dims, placements, local = (*outer, *inner), [Shard(0)] * len(self.row_dims), rows
        if isinstance(rows, DTensor):  # FSDP's shards of the rank's rows, over its data dims
            split = self.mesh["tp"].size() if inner else 1
            data = [_strided(placement, split) for placement in rows.placements]
            dims = (*outer, *(rows.device_mesh.mesh_dim_names or ()), *inner)
            placements = [*([Shard(0)] * len(outer)), *data, *([Shard(0)] * len(inner))]
            local = rows.to_local()
        shape = torch.Size([full_rows, *rows.shape[1:]])
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(
            local, self.mesh[dims], placements, run_check=False, shape=shape, stride=stride
        )


def _strided(placement: Placement, split: int) -> Placement:
    """A data dim's `Shard(0)` of rows that tp (a later mesh dim) split first: a strided shard,
    as FSDP2 places its shards over tensor parallelism's."""
    if split == 1 or not isinstance(placement, Shard):
        return placement
    return StridedShard(0, split_factor=split)


class CheckpointManager:
    """Saves `step-N` checkpoints into `folder`, keeps the newest `keep_last` (0 keeps all).

    Every rank calls every method with the same arguments (they are collective when a process
    group exists); the folder must be shared by all ranks. `job_config` (the TOML text of the
    job's resolved config) is written into every checkpoint as `config.toml`, so a later job
    can tell which model wrote it.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        keep_last: int = 0,
        asynchronous: bool = False,
        job_config: str | None = None,
    ) -> None:
        if keep_last < 0:
            raise ValueError(f"keep_last={keep_last} must be >= 0 (0 keeps every checkpoint)")
        self.folder = Path(folder)
        self.keep_last = keep_last
        self.asynchronous = asynchronous
        self.job_config = job_config
        self._pending: tuple[int, Path, Future, bool] | None = None
        # Background writes meet on a group of their own (gloo: DCP's plans travel on the CPU),
        # so their collectives never interleave with the training's.
        self._write_group = (
            dist.new_group(backend="gloo") if asynchronous and dist.is_initialized() else None
        )

    def path(self, step: int) -> Path:
        """Where the complete checkpoint of `step` lives."""
        return self.folder / f"step-{step}"

    def complete_steps(self) -> list[int]:
        """Steps with a complete checkpoint, oldest first (tmp and unmarked folders ignored)."""
        if not self.folder.is_dir():
            return []
        steps = []
        for entry in self.folder.iterdir():
            match = _COMPLETE_NAME.fullmatch(entry.name)
            if match and (entry / COMPLETE_MARKER).is_file():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def latest_step(self) -> int | None:
        """The newest step with a complete training checkpoint (a model-only save holds
        nothing to resume from), or None."""
        steps = self.training_steps()
        return steps[-1] if steps else None

    def training_steps(self) -> list[int]:
        """Complete steps that hold a training state, oldest first (not model-only saves)."""
        return [step for step in self.complete_steps() if not holds_model_only(self.path(step))]

    def save(self, step: int, state: Mapping[str, Any], model_only: bool = False) -> Path | None:
        """Write `state` as the checkpoint of `step`, replacing any of that step; collective.
        `model_only` marks a save of the model's weights alone (`holds_model_only`).

        Returns the published checkpoint's path. An asynchronous manager copies the state to
        host memory, writes it in a background thread and returns None; the checkpoint is
        published by `finish` (called by the next save, and by the trainer before it exits),
        so at most one save is in flight."""
        self.finish()
        if _rank() == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._remove_stale_tmp_folders()
        tmp = self.folder / f"step-{step}.tmp-{_shared_token()}"
        with _quiet_without_process_group(), _as_checkpoint_error(step, tmp):
            if not self.asynchronous:
                dcp.save(dict(state), checkpoint_id=tmp)
            else:
                future = dcp.async_save(
                    dict(state),
                    checkpoint_id=tmp,
                    process_group=self._write_group,
                    no_dist=not dist.is_initialized(),
                )
                self._pending = (step, tmp, future, model_only)
        return None if self.asynchronous else self._publish(step, tmp, model_only)

    def finish(self) -> Path | None:
        """Wait for the asynchronous save in flight, if any, and publish it (collective);
        its path, or None when nothing was in flight."""
        if self._pending is None:
            return None
        step, tmp, future, model_only = self._pending
        self._pending = None
        with _as_checkpoint_error(step, tmp):
            future.result()
        return self._publish(step, tmp, model_only)

    def _publish(self, step: int, tmp: Path, model_only: bool) -> Path:
        """Mark `tmp` complete and rename it into place once every rank has written it."""
        _barrier()  # every rank's files are written before the checkpoint is published
        final = self.path(step)
        if _rank() == 0:
            if self.job_config is not None:
                _write_durably(tmp / JOB_CONFIG_FILE, self.job_config)
            marker = {"step": step, "world_size": _world_size(), "model_only": model_only}
            _write_durably(tmp / COMPLETE_MARKER, json.dumps(marker))
            if final.exists():
                _remove(final)
            os.rename(tmp, final)
            fsync_path(self.folder)
            if self.keep_last:
                for old_step in self.complete_steps()[: -self.keep_last]:
                    _remove(self.path(old_step))
        _barrier()  # no rank moves on (or looks for the latest step) before the rename
        return final

    def load(self, step: int, state: Mapping[str, Any]) -> None:
        """Restore `state` in place from the checkpoint of `step`; collective."""
        path = self.path(step)
        if not (path / COMPLETE_MARKER).is_file():
            what = "is not a complete checkpoint" if path.is_dir() else "does not exist"
            raise CheckpointError(
                f"checkpoint {path} {what} (no {COMPLETE_MARKER} marker: missing, or a save was "
                f"interrupted); complete steps in {self.folder}: {self.complete_steps()}"
            )
        if holds_model_only(path):
            raise CheckpointError(
                f"checkpoint {path} holds the model alone (last_save_model_only), nothing to "
                f"resume from: set [checkpoint] load_step to a training step "
                f"({self.training_steps() or 'none'}), or start a new job from it with "
                "initial_load_path"
            )
        load_checkpoint(path, state)

    def _remove_stale_tmp_folders(self) -> None:
        """Remove the tmp folders of interrupted saves (one job writes a folder at a time)."""
        for entry in self.folder.glob("step-*.tmp-*"):
            shutil.rmtree(entry, ignore_errors=True)


def holds_model_only(path: Path) -> bool:
    """Whether the complete checkpoint `path` holds the model's weights alone: a model-only
    save, which generation and a new job's initial load read but a resume cannot."""
    try:
        marker = json.loads((path / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and bool(marker.get("model_only"))


def load_checkpoint(path: Path, state: Mapping[str, Any]) -> None:
    """Restore `state` in place from the complete checkpoint folder `path` (of any job and
    layout: DCP reshards); collective. CheckpointError naming the folder on failure: the
    entries that differ when the checkpoint does not fit `state`, else the cause."""
    try:
        with _quiet_without_process_group(), _dcp_logging_silenced():
            dcp.load(
                dict(state),
                storage_reader=SafeFileSystemReader(path),
                planner=FittingLoadPlanner(),
            )
    # DCP reports a failure on any rank as CheckpointException, a BaseException.
    except (Exception, dcp.CheckpointException) as error:
        rank, cause = _first_failure(error)
        if isinstance(cause, CheckpointMismatchError):
            raise CheckpointError(
                f"checkpoint {path} does not fit the state loaded into it ({rank}{cause}): it "
                "is intact, but was written by a job with another model, optimizer or state "
                f"(its {JOB_CONFIG_FILE}, where present, says which); load it into a job with "
                "those settings, or leave the differing part out ([checkpoint] "
                "exclude_from_loading)"
            ) from error
        raise CheckpointError(
            f"checkpoint {path} could not be read ({rank}{type(cause).__name__}: {cause}); if "
            "its files are damaged, an older step may load ([checkpoint] load_step)"
        ) from error


@contextlib.contextmanager
def _as_checkpoint_error(step: int, tmp: Path) -> Iterator[None]:
    """A failed write, on any rank, as one CheckpointError naming the step, folder and cause."""
    try:
        yield
    # DCP reports a failure on any rank as CheckpointException, a BaseException.
    except (Exception, dcp.CheckpointException) as error:
        rank, cause = _first_failure(error)
        raise CheckpointError(
            f"checkpoint of step {step} could not be written to {tmp} "
            f"({rank}{type(cause).__name__}: {cause}); check the folder's free space and "
            "permissions"
        ) from error


@contextlib.contextmanager
def _quiet_without_process_group() -> Iterator[None]:
    """Silence DCP's warning that it works in one process: at world size 1 that is the plan."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


@contextlib.contextmanager
def _dcp_logging_silenced() -> Iterator[None]:
    """DCP logs every failed read with a traceback (on the root logger, in torch 2.13); the
    CheckpointError we raise says it once."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(previous)


def _first_failure(error: BaseException) -> tuple[str, BaseException]:
    """("rank R: ", its exception) of the first failing rank (DCP wraps them per rank), or
    ("", `error`) for an error of this process."""
    if isinstance(error, dcp.CheckpointException) and error.failures:
        rank, (cause, _) = min(error.failures.items(), key=lambda item: item[0])
        return f"rank {rank}: ", cause
    return "", error


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _shared_token() -> str:
    """A random name part chosen by rank 0 and known to every rank."""
    token = [uuid.uuid4().hex[:8]]
    if dist.is_initialized():
        dist.broadcast_object_list(token, src=0)
    return token[0]


def _remove(folder: Path) -> None:
    """Delete a checkpoint folder; renamed away first so no marked, half-deleted folder remains."""
    doomed = folder.with_name(f"{folder.name}.tmp-deleting-{uuid.uuid4().hex[:8]}")
    os.rename(folder, doomed)
    shutil.rmtree(doomed)


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
