"""DCP training-state checkpoints: exact round trips (model, optimizer, LR scheduler, plain
state, RNG) at world size 1 and with an FSDP2-sharded model on 2 gloo ranks, resharding 2 -> 1,
keep-last-k, and atomicity: interrupted saves and unmarked folders never load, damaged ones raise
a CheckpointError naming the folder, and intact ones of another state one naming what differs."""

import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tiny_models import TINY_LLAMA, tiny_llama
from torch import Tensor, nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.tensor import DTensor

import pipekit.checkpoint.dcp as dcp_module
from pipekit.checkpoint.dcp import (
    COMPLETE_MARKER,
    CheckpointManager,
    ModelOptimizerState,
    capture_rng_state,
    restore_rng_state,
)
from pipekit.checkpoint.safetensors_io import CheckpointError
from pipekit.config.job_config import ParallelismConfig
from pipekit.distributed.fsdp import apply_data_parallel
from pipekit.distributed.parallel_dims import ParallelDims
from pipekit.testing import run_on_ranks


def _model(seed: int) -> nn.Module:
    return tiny_llama(seed)


def _training_objects(model: nn.Module) -> tuple[torch.optim.Optimizer, object]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)


def _train_one_step(model, optimizer, scheduler, rank: int = 0, world_size: int = 1) -> None:
    tokens_BS = torch.randint(
        0, TINY_LLAMA.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3)
    )
    tokens_BS = tokens_BS[rank::world_size]
    logits_BSV = model(tokens_BS[:, :-1])
    nn.functional.cross_entropy(logits_BSV.flatten(0, 1), tokens_BS[:, 1:].flatten()).backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def _full(tensor: Tensor) -> Tensor:
    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return full.detach().clone()


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
    """Every parameter and AdamW moment as a full tensor, by parameter name."""
    snapshot = {}
    for name, param in model.named_parameters():
        snapshot[name] = _full(param)
        for moment in ("exp_avg", "exp_avg_sq"):
            snapshot[f"{name}/{moment}"] = _full(optimizer.state[param][moment])
    return snapshot


def _assert_same(got: dict[str, Tensor], want: dict[str, Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def _state(model, optimizer, scheduler, step: int) -> dict[str, object]:
    return {
        "model": ModelOptimizerState(model, optimizer),
        "lr_scheduler": scheduler,
        "train": {"step": step, "data": {"epoch": step // 3, "offset": 17 * step}},
        "rng": capture_rng_state(),
    }


def test_round_trip_at_world_size_one_restores_everything(tmp_path):
    model = _model(seed=0)
    optimizer, scheduler = _training_objects(model)
    _train_one_step(model, optimizer, scheduler)
    manager = CheckpointManager(tmp_path / "checkpoints", keep_last=2)
    manager.save(5, _state(model, optimizer, scheduler, step=5))
    next_draw = torch.rand(4)

    fresh_model = _model(seed=1)
    fresh_optimizer, fresh_scheduler = _training_objects(fresh_model)
    _train_one_step(fresh_model, fresh_optimizer, fresh_scheduler)  # optimizer state to overwrite
    fresh_state = _state(fresh_model, fresh_optimizer, fresh_scheduler, step=0)
    assert manager.latest_step() == 5
    manager.load(5, fresh_state)
    restore_rng_state(fresh_state["rng"])

    _assert_same(_snapshot(fresh_model, fresh_optimizer), _snapshot(model, optimizer))
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
    assert fresh_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert fresh_state["train"] == {"step": 5, "data": {"epoch": 1, "offset": 85}}
    assert torch.equal(torch.rand(4), next_draw)  # the generator resumes where it was saved


def _save_some(manager: CheckpointManager, steps) -> None:
    for step in steps:
        manager.save(step, {"train": {"step": step}, "weights": {"w": torch.full((3,), step)}})


def test_keep_last_deletes_older_complete_checkpoints(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    _save_some(manager, [1, 2, 3, 4, 5])
    assert manager.complete_steps() == [4, 5]
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["step-4", "step-5"]
    _save_some(manager, [5])  # saving a step again replaces it
    assert manager.complete_steps() == [4, 5]
    assert CheckpointManager(tmp_path).keep_last == 0  # 0 keeps all
    with pytest.raises(ValueError, match=r"keep_last=-1 must be >= 0"):
        CheckpointManager(tmp_path, keep_last=-1)


def test_interrupted_saves_and_unmarked_folders_never_load(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path)
    _save_some(manager, [1, 2])
    # A crash after every rank wrote its data but before rank 0 published the checkpoint.
    with monkeypatch.context() as crash:
        crash.setattr(dcp_module, "_write_durably", _raise_crash)
        with pytest.raises(_SimulatedCrash):
            _save_some(manager, [3])
    (stale,) = tmp_path.glob("step-3.tmp-*")
    # A folder named like a checkpoint but without the marker (e.g. copied by hand, half-done).
    shutil.copytree(manager.path(2), tmp_path / "step-7")
    (tmp_path / "step-7" / COMPLETE_MARKER).unlink()
    assert manager.latest_step() == 2
    target = {"train": {"step": 0}, "weights": {"w": torch.zeros(3)}}
    with pytest.raises(CheckpointError, match=r"step-7 is not a complete checkpoint"):
        manager.load(7, target)
    with pytest.raises(
        CheckpointError, match=r"step-3 does not exist .* complete steps .*\[1, 2\]"
    ):
        manager.load(3, target)
    assert target["train"]["step"] == 0  # nothing was touched
    _save_some(manager, [4])  # the next save clears the interrupted one
    assert not stale.exists() and manager.complete_steps() == [1, 2, 4]


class _SimulatedCrash(Exception):
    pass


def _raise_crash(*args: object) -> None:
    raise _SimulatedCrash


def test_a_damaged_checkpoint_is_unreadable_and_one_of_another_state_names_what_differs(
    tmp_path,
):
    """A truncated data file cannot be read; an intact checkpoint loaded into another state
    (a resized, a missing entry) is named as such, with every entry that differs, and is never
    called damaged nor offered for deletion."""
    manager = CheckpointManager(tmp_path)
    _save_some(manager, [1])
    (data_file,) = manager.path(1).glob("*.distcp")
    data_file.write_bytes(data_file.read_bytes()[:40])
    target = {"train": {"step": 0}, "weights": {"w": torch.zeros(3)}}
    with pytest.raises(CheckpointError, match=rf"checkpoint {manager.path(1)} could not be read"):
        manager.load(1, target)
    _save_some(manager, [2])
    other = {"train": {"step": 0}, "weights": {"w": torch.zeros(4), "b": torch.zeros(2)}}
    with pytest.raises(CheckpointError) as error:
        manager.load(2, other)
    message = str(error.value)
    assert f"checkpoint {manager.path(2)} does not fit the state loaded into it" in message
    assert "missing weights.b; other shapes for weights.w (saved (3,), wanted (4,))" in message
    assert "is intact" in message and "corrupt" not in message and "delete" not in message


def test_a_failed_save_ends_in_one_checkpoint_error(tmp_path, monkeypatch):
    """DCP reports a rank's failure as CheckpointException, a BaseException that would escape
    the job's error handling; the manager turns it into one CheckpointError line."""

    def full_disk(*_args: object, **_kwargs: object) -> None:
        failure = OSError(28, "No space left on device")
        raise torch.distributed.checkpoint.CheckpointException("save", {0: (failure, None)})

    monkeypatch.setattr(dcp_module.dcp, "save", full_disk)
    manager = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointError, match=r"step 1 could not be written .* No space left"):
        _save_some(manager, [1])
    assert manager.complete_steps() == []


class _PlantedCode:
    """Unpickling this calls `Path.touch` on the marker: code run from the checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_planted_metadata_file_runs_nothing_and_fails_in_one_line(tmp_path):
    """Resume unpickles `.metadata`; a file naming any function outside DCP's metadata types
    is refused before it runs. The ablation (torch's own reader) runs the planted call."""
    manager = CheckpointManager(tmp_path / "checkpoints")
    _save_some(manager, [1])
    marker = tmp_path / "ran"
    (manager.path(1) / ".metadata").write_bytes(pickle.dumps(_PlantedCode(marker)))
    target = {"train": {"step": 0}, "weights": {"w": torch.zeros(3)}}
    with pytest.raises(CheckpointError, match=r"names pathlib.Path.touch, which .* never holds"):
        manager.load(1, target)
    assert not marker.exists() and target["train"]["step"] == 0
    with pytest.raises(Exception):  # noqa: B017 - torch's reader fails after running it
        FileSystemReader(manager.path(1)).read_metadata()
    assert marker.exists()


def _sharded_round_trip(rank: int, world_size: int, folder: str) -> dict[str, Tensor]:
    """Save a trained FSDP2 model on 2 ranks; load it into a fresh one; both must be equal."""
    parallel_dims = ParallelDims.from_config(ParallelismConfig(dp_shard=-1), world_size)
    mesh = parallel_dims.build_mesh("cpu")
    model = apply_data_parallel(_model(seed=0), mesh, parallel_dims)
    optimizer, scheduler = _training_objects(model)
    _train_one_step(model, optimizer, scheduler, rank, world_size)
    manager = CheckpointManager(folder, keep_last=1)
    manager.save(1, _state(model, optimizer, scheduler, step=1))
    fresh_model = apply_data_parallel(_model(seed=1), mesh, parallel_dims)
    fresh_optimizer, fresh_scheduler = _training_objects(fresh_model)
    _train_one_step(fresh_model, fresh_optimizer, fresh_scheduler, rank, world_size)
    manager.load(manager.latest_step(), _state(fresh_model, fresh_optimizer, fresh_scheduler, 0))
    _assert_same(_snapshot(fresh_model, fresh_optimizer), _snapshot(model, optimizer))
    assert isinstance(next(model.parameters()), DTensor) and dist.get_world_size() == 2
    return _snapshot(model, optimizer)


def test_sharded_round_trip_on_two_ranks_and_resharding_to_one(tmp_path):
    folder = tmp_path / "checkpoints"
    saved, _ = run_on_ranks(_sharded_round_trip, 2, str(folder))
    manager = CheckpointManager(folder)
    model = _model(seed=2)
    optimizer, scheduler = _training_objects(model)
    _train_one_step(model, optimizer, scheduler)
    state = _state(model, optimizer, scheduler, step=0)
    manager.load(1, state)  # written by 2 ranks with sharded tensors, read by one process
    _assert_same(_snapshot(model, optimizer), saved)
    assert state["train"]["step"] == 1


def _async_round_trip(rank, world_size, folder):
    """Save asynchronously, change the weights at once, publish, load: the saved values."""
    manager = CheckpointManager(folder, keep_last=2, asynchronous=True)
    weights = torch.arange(6.0) + 10 * rank
    state = {"weights": {f"w{rank}": weights}, "train": {"step": 3}}
    assert manager.save(3, state) is None
    weights.add_(100.0)  # training goes on while the background thread writes
    assert manager.complete_steps() == []  # not published before `finish`
    published = manager.finish()
    assert published == manager.path(3) and manager.complete_steps() == [3]
    assert manager.finish() is None  # nothing in flight any more
    loaded = {"weights": {f"w{rank}": torch.zeros(6)}, "train": {"step": 0}}
    manager.load(3, loaded)
    return loaded["weights"][f"w{rank}"].tolist(), loaded["train"]["step"]


def test_asynchronous_saves_write_the_state_of_the_step_and_publish_on_finish(tmp_path):
    for values, step in run_on_ranks(_async_round_trip, 2, tmp_path / "two_ranks"):
        assert step == 3
        assert values in ([0.0, 1, 2, 3, 4, 5], [10.0, 11, 12, 13, 14, 15])
    values, _ = _async_round_trip(0, 1, tmp_path / "one_process")
    assert values == [0.0, 1, 2, 3, 4, 5]
    manager = CheckpointManager(tmp_path / "saves", asynchronous=True)
    _save_some(manager, [1, 2])  # the second save publishes the first before it starts
    assert manager.complete_steps() == [1]
    manager.finish()
    assert manager.complete_steps() == [1, 2]
