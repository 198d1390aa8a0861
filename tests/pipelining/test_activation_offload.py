"""Activation offload: the offloader moves what only autograd holds and brings back the same
bytes (exact gradients, shared storages kept shared, in-place changes caught), the schedule
plan picks the far units and evens the ranks out, and pipelines with offload keep their
gradients (sliced v=2, 1F1B, interleaved) while the bytes saved on the device fall.

The parity matrix's "sliced + activation offload" row checks the sliced pipeline against one
process, with an ablation that loses the offloaded bytes."""

from __future__ import annotations

import pytest
import torch
from tiny_models import (
    PARITY_ROWS,
    PARITY_SEQ_LEN,
    PARITY_TOLERANCE,
    pp_mesh,
    tiny_batch,
    tiny_pipeline,
    tiny_reference,
)

from pipekit.memory.offload import ActivationOffloader
from pipekit.memory.offload_store import FileStore
from pipekit.memory.tracker import ActivationMemoryTracker
from pipekit.pipelining.actions import BACKWARD
from pipekit.pipelining.features.activation_offload import PipelineActivationOffload
from pipekit.pipelining.features.offload_plan import (
    RELOAD,
    auto_offload_ratios,
    plan_rank_offload,
    resident_peak,
    resolve_offload_ratios,
)
from pipekit.pipelining.schedules.sliced import peak_units_in_flight, sliced_pipeline_actions
from pipekit.pipelining.schedules.torch_lists import torch_schedule_actions
from pipekit.testing import Result, max_relative_difference, run_on_ranks, runner_step


def _mlp_step(offloader: ActivationOffloader | None, ratio: float, reload: bool = True):
    """A float64 two-layer step whose norm-like output three matmuls save (one storage)."""
    torch.manual_seed(0)
    weights = [torch.randn(16, 16, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    x_BD = torch.randn(32, 16, dtype=torch.float64, requires_grad=True)

    def forward() -> torch.Tensor:
        hidden_BD = torch.tanh(x_BD @ weights[0])
        shared_BD = hidden_BD * 2.0  # saved by the three products below
        total = sum((shared_BD @ w).sin().sum() for w in weights[1:])
        return total

    if offloader is None:
        loss = forward()
    else:
        with offloader.saving("unit"):
            loss = forward()
        offloader.offload("unit", ratio)
        if reload:
            offloader.reload("unit")
    loss.backward()
    return [x_BD.grad, *[w.grad for w in weights]]


def test_offloaded_bytes_come_back_exact_and_shared_storages_move_once():
    reference = _mlp_step(None, 0.0)
    store = FileStore()
    offloader = ActivationOffloader(store)
    grads = _mlp_step(offloader, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True))
    moved, stats = offloader.stats.offloaded_bytes, offloader.stats
    assert moved == stats.movable_bytes > 0
    # tanh's output, the shared product input (once, not three times) and three matmul outputs
    assert moved == (2 + 3) * 32 * 16 * 8
    assert store.file_bytes == moved and stats.late_reloads == 0


def test_a_missed_reload_reads_back_at_unpack_and_the_file_reuses_its_regions():
    reference = _mlp_step(None, 0.0)
    store = FileStore()
    offloader = ActivationOffloader(store)
    for _ in range(3):
        grads = _mlp_step(offloader, 1.0, reload=False)
        assert all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True))
        offloader.clear()
    assert offloader.stats.late_reloads == 3 * 5
    assert store.file_bytes == offloader.stats.offloaded_bytes // 3  # freed regions reused


def test_the_tracker_counts_an_offloaded_storage_only_while_it_is_on_the_device():
    x_BD = torch.randn(64, 32, requires_grad=True)
    offloader = ActivationOffloader(FileStore())
    with ActivationMemoryTracker() as tracker:
        with offloader.saving("unit"):
            loss = (torch.tanh(x_BD) * x_BD).exp().sum()
        saved = tracker.live_bytes("saved")
        offloader.offload("unit", 1.0)
        away = tracker.live_bytes("saved")
        offloader.reload("unit")
        back = tracker.live_bytes("saved")
        loss.backward()
    # tanh's and exp's outputs move; x stays (the caller holds it)
    assert (saved, away, back) == (3 * 64 * 32 * 4, 64 * 32 * 4, 3 * 64 * 32 * 4)


def test_ratio_moves_the_earliest_saved_share():
    x_BD = torch.randn(64, 32, requires_grad=True)
    offloader = ActivationOffloader(FileStore())
    with offloader.saving("unit"):
        hidden = x_BD
        for _ in range(4):
            hidden = torch.tanh(hidden)  # four outputs of equal size, each saved
        loss = hidden.sum()
    del hidden  # else the last output has a holder besides autograd, and stays
    moved = offloader.offload("unit", 0.5)
    assert moved == offloader.stats.movable_bytes // 2
    offloader.reload("unit")
    loss.backward()


def test_an_in_place_change_after_saving_is_caught_before_moving():
    x_BD = torch.randn(8, 8, requires_grad=True)
    offloader = ActivationOffloader(FileStore())
    with offloader.saving("unit"):
        out_BD = torch.tanh(x_BD)
        loss = (out_BD * 1.0).sum()
        with torch.no_grad():
            out_BD.add_(1)  # tanh saved its output; this changes it behind autograd's back
    del out_BD  # autograd's the only holder left: the storage would move
    with pytest.raises(RuntimeError, match="modified in place"):
        offloader.offload("unit", 1.0)
    del loss


def test_the_plan_offloads_units_whose_backward_is_far_and_reloads_one_action_ahead():
    actions = sliced_pipeline_actions(4, 4, 16, 1)
    last = [a for a in actions[3] if a is not None]
    plan = plan_rank_offload(last, 1.0)
    # the last rank runs F0..F15 B15 F16 B14 ...: a microbatch's last slice (unit 15, 31, ...)
    # has its backward right after its forward and stays; every other unit waits long enough
    assert {unit for _, unit in plan.offloaded} == {u for u in range(64) if u % 16 != 15}
    for position, reload in plan.reloads:
        assert reload.computation_type == RELOAD
        backward = last[position + 1]
        assert backward.computation_type == BACKWARD
        assert backward.microbatch_index == reload.microbatch_index
    assert plan_rank_offload(last, 0.0).offloaded == frozenset()


def test_auto_ratios_bring_every_rank_down_to_the_last_ranks_peak():
    for actions in (
        sliced_pipeline_actions(4, 4, 16, 1),
        sliced_pipeline_actions(4, 8, 8, 2),
        torch_schedule_actions("1F1B", 4, 8, 1),
    ):
        ratios = auto_offload_ratios(actions)
        peaks = [peak_units_in_flight(actions[rank]) for rank in sorted(actions)]
        assert ratios == sorted(ratios, reverse=True) and ratios[-1] == 0.0
        assert ratios[0] > 0
        for rank, ratio in enumerate(ratios):
            assert resident_peak(actions[rank], 0.0) == peaks[rank]
            reachable = max(min(peaks), resident_peak(actions[rank], 1.0))  # 1F1B: 2 units
            assert resident_peak(actions[rank], ratio) <= reachable + 1e-9


def test_resolving_the_setting_names_the_fix():
    actions = sliced_pipeline_actions(2, 2, 4, 1)
    assert resolve_offload_ratios(0.0, actions) == ()
    assert resolve_offload_ratios(0.5, actions) == (0.5, 0.5)
    assert resolve_offload_ratios([0.9, 0.0], actions) == (0.9, 0.0)
    with pytest.raises(ValueError, match="3 ratios for 2 pipeline ranks"):
        resolve_offload_ratios([0.5, 0.5, 0.5], actions)
    with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
        resolve_offload_ratios(-0.1, actions)


def _offloaded_pipeline(rank: int, world: int, configs: list[tuple]) -> list[Result]:
    results = []
    for schedule, v, m, n, offload, features in configs:
        runner = tiny_pipeline(
            pp_mesh(world),
            schedule=schedule,
            stages_per_rank=v,
            microbatches=m,
            num_slices=n,
            rows=PARITY_ROWS,
            seq_len=PARITY_SEQ_LEN,
            activation_offload=offload,
            **features,
        )
        results.append(runner_step(runner, tiny_batch()))
        extension = runner.extension("activation_offload")
        assert isinstance(extension, PipelineActivationOffload)
        if rank == 0:  # the first rank holds the most units: something always moves there
            assert extension.offloader.stats.offloaded_bytes > 0
    return results


def test_pipelines_with_offload_equal_one_process_fp64():
    """Interleaved and torch-list schedules carry the reloads too; v=2 places two stages'
    units on a rank; the reloads go between context exchange's loans and vocabulary
    parallelism's output passes."""
    configs = [
        ("sliced", 2, 3, 4, 1.0, {}),
        ("1F1B", 1, 6, 1, 1.0, {}),
        ("Interleaved1F1B", 2, 6, 1, "auto", {}),
        ("sliced", 1, 2, 4, 1.0, {"context_exchange": True}),
        ("sliced", 1, 2, 4, 1.0, {"vocab_parallel": True}),
    ]
    results = run_on_ranks(_offloaded_pipeline, 2, configs, timeout=120)
    for index, (_, v, *_rest) in enumerate(configs):
        difference = max_relative_difference(
            [results[rank][index] for rank in range(2)], tiny_reference(2 * v)
        )
        assert difference <= PARITY_TOLERANCE, f"{configs[index]}: {difference:.2e}"
