"""Context exchange in the sliced pipeline changes nothing but where attention is computed: loss
and every gradient equal one unsliced process (float64), for p = 2 and 4, n = 2p and 4p, m = 2,
with packed documents, two layers per stage, interleaved stages, uneven stages, vocabulary
parallelism and activation checkpointing, with the lent chunks sent ahead of their passes (early
KV exchange, the default) and inside the requests. Every rank waits for its serving only at the
end of the step. The ablation drops the lent chunks' dK/dV and must fail; a run that lends
nothing would not notice it, so the ablation also proves that the exchange happens."""

from __future__ import annotations

import inspect
from datetime import timedelta

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

from pipekit.pipelining.actions import BACKWARD, FORWARD, Action
from pipekit.pipelining.features.context_exchange import (
    SEND_AHEAD_BACKWARD,
    SEND_AHEAD_FORWARD,
    SERVE_AFTER_BACKWARD,
    SERVE_AFTER_FORWARD,
    PipelineContextExchange,
)
from pipekit.pipelining.schedules.units import unit_index, unit_microbatch_and_slice
from pipekit.testing import (
    RankFailedError,
    max_relative_difference,
    replace_context_exchange,
    run_on_ranks,
    runner_step,
)


def _run(
    rank: int,
    world: int,
    v: int,
    m: int,
    n: int,
    num_layers: int,
    drop_remote_kv_grads: bool = False,
    checkpoint_activations: bool = False,
    vocab_parallel: bool = False,
    chunks_ahead: bool = True,
) -> tuple:
    runner = tiny_pipeline(
        pp_mesh(world),
        stages_per_rank=v,
        microbatches=m,
        num_slices=n,
        rows=PARITY_ROWS,
        seq_len=PARITY_SEQ_LEN,
        num_layers=num_layers,
        context_exchange=True,
        checkpoint_activations=checkpoint_activations,
        vocab_parallel=vocab_parallel,
    )
    exchange = runner.extension("context_exchange")
    assert isinstance(exchange, PipelineContextExchange)
    if drop_remote_kv_grads:  # ablation: the same plan, lent chunks' dK/dV dropped
        exchange = replace_context_exchange(runner, drop_remote_kv_grads=True)
    if not chunks_ahead:  # the lent chunks travel inside each request
        exchange = replace_context_exchange(runner, chunks_ahead=False)
    loss, grads = runner_step(runner, tiny_batch())
    ahead = None
    if chunks_ahead:  # (passes that found their chunks sent ahead, lending passes, sent in time)
        lendings = exchange.plan.lendings(runner.stages[0].group_rank)
        ahead = (len(exchange.ahead_sends), len(lendings), _sent_ahead_in_time(runner, lendings))
    transfers, serving_cpu_s = len(exchange.plan.transfers), exchange.serving_cpu_s
    return loss, grads, transfers, serving_cpu_s, _serving_at_the_end(runner), ahead


def _serving_at_the_end(runner) -> bool | None:
    """Whether every serving action of this rank follows its last pass (None: it serves
    nothing)."""
    order = runner.schedule.pipeline_order[runner.stages[0].group_rank]
    kinds = [action.computation_type for action in order if action is not None]
    serving_kinds = (SERVE_AFTER_FORWARD, SERVE_AFTER_BACKWARD)
    serving = [i for i, kind in enumerate(kinds) if kind in serving_kinds]
    passes = [i for i, kind in enumerate(kinds) if kind in (FORWARD, BACKWARD)]
    return min(serving) > max(passes) if serving else None


def _sent_ahead_in_time(runner, lendings) -> bool:
    """Whether every lending pass's sending-ahead action runs after the forward that produced
    its newest lent slice and before the pass."""
    order = [a for a in runner.schedule.pipeline_order[runner.stages[0].group_rank] if a]
    index = {action: position for position, action in enumerate(order)}
    for action, parts in lendings.items():
        kind = SEND_AHEAD_FORWARD if action.computation_type == FORWARD else SEND_AHEAD_BACKWARD
        sent = index[Action(action.stage_index, kind, action.microbatch_index)]
        microbatch, _ = unit_microbatch_and_slice(action.microbatch_index, runner.num_slices)
        newest = max(max(kv_slices) for _, kv_slices in parts)
        unit = unit_index(microbatch, newest, runner.num_slices)
        if not index[Action(action.stage_index, FORWARD, unit)] < sent < index[action]:
            return False
    return True


def _option(config: tuple, name: str, default: bool = False) -> bool:
    """A keyword option of `_run` from a positional config."""
    names = list(inspect.signature(_run).parameters)[2:]
    return bool(dict(zip(names, config, strict=False)).get(name, default))


def _run_many(rank: int, world: int, configs: list[tuple]) -> list[tuple]:
    return [_run(rank, world, *config) for config in configs]


def _differences(world: int, configs: list[tuple], timeout: float) -> dict[tuple, float]:
    results = run_on_ranks(_run_many, world, configs, timeout=timeout)
    differences = {}
    for index, config in enumerate(configs):
        per_rank = [results[rank][index] for rank in range(world)]
        assert per_rank[0][2] > 0, f"{config}: the plan exchanges nothing"
        assert {at_end for *_, at_end, _ in per_rank} - {None} == {True}, config
        for *_, serving_cpu_s, at_end, _ in per_rank:  # a serving rank's threads' CPU is counted
            assert (serving_cpu_s > 0) == (at_end is not None), (config, serving_cpu_s)
        if _option(config, "chunks_ahead", True):  # every lending pass sent its chunks ahead
            for noted, lending_passes, in_time in (ahead for *_, ahead in per_rank):
                assert noted == lending_passes > 0 and in_time, (config, noted, lending_passes)
        reference = tiny_reference(config[3])
        differences[config] = max_relative_difference(
            [(loss, grads) for loss, grads, *_ in per_rank], reference
        )
    return differences


@pytest.mark.parametrize("world", [2, 4])
def test_exchange_keeps_loss_and_every_gradient_fp64(world: int) -> None:
    """(v, m, n, layers): n = 2p and 4p with m = 2, one and two layers per stage."""
    configs = [(1, 2, 2 * world, world), (1, 2, 4 * world, 2 * world)]
    if world == 2:
        configs += [(2, 2, 4, 4), (1, 2, 4, 3)]  # interleaved; stages of 2 and 1 layers
        configs += [(1, 2, 4, 2, False, False, True)]  # vocabulary parallel
        configs += [(1, 2, 8, 4, False, False, False, False)]  # chunks inside the requests
    for config, difference in _differences(world, configs, timeout=300).items():
        assert difference <= PARITY_TOLERANCE, f"{config}: max relative difference {difference:.2e}"


def test_exchange_with_activation_checkpointing_fp64() -> None:
    """A recomputed layer neither lends nor serves forward work again, and still records its
    backward's lending and serving."""
    configs = [(1, 2, 4, 2, False, True), (1, 2, 8, 4, False, True)]
    for config, difference in _differences(2, configs, timeout=120).items():
        assert difference <= PARITY_TOLERANCE, f"{config}: max relative difference {difference:.2e}"


def test_dropping_the_remote_kv_gradients_breaks_parity() -> None:
    configs = [(1, 2, 4, 2, True), (1, 2, 8, 4, True)]
    for config, difference in _differences(2, configs, timeout=120).items():
        assert difference > 1e-3, config


def test_stages_without_layers_are_refused() -> None:
    with pytest.raises(ValueError, match=r"stages \[1\] hold no attention layer"):
        PipelineContextExchange(None, {0: 2, 1: 0}, downward_group=None)


def test_one_group_for_both_directions_is_refused() -> None:
    """A rank lends to a peer while its threads still serve that peer: the two directions'
    messages would mix on one group."""
    with pytest.raises(ValueError, match="give downward_group a group of its own"):
        PipelineContextExchange(None, {0: 2, 1: 2}, downward_group=None)


def _wait_for_a_dead_peer(rank: int, world: int) -> None:
    from pipekit.attention.across.lending import AttentionLoan

    if rank == 0:
        AttentionLoan(1, timeout=timedelta(seconds=1)).receive(torch.empty(1))


def test_a_peer_that_never_answers_is_named() -> None:
    with pytest.raises(
        RankFailedError, match="rank 0 of the exchange group waited more than 1 s for rank 1"
    ):
        run_on_ranks(_wait_for_a_dead_peer, 2, timeout=60)
