"""Expert parallelism on gloo ranks against the single-process MoE: loss and every gradient."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from moe_reference import DIM, EXPERTS, reference_moe_forward, small_moe
from tiny_models import TINY_LLAMA
from torch.distributed.device_mesh import init_device_mesh

from pipekit.config import ConfigError, load_job_config
from pipekit.families.llama_moe.args import LlamaMoEArgs
from pipekit.models import get_model_spec
from pipekit.models.materialize import local_tensor
from pipekit.moe import MoEArgs
from pipekit.moe import dispatch_plan as dispatch_plan_module
from pipekit.moe.dispatch_plan import plan_partitions
from pipekit.moe.expert_parallel import apply_expert_parallel
from pipekit.moe.token_exchange import CollectiveExchange, PacedExchange, link_rows
from pipekit.testing import data_parallel_model, run_on_ranks
from pipekit.train.job import validate_job

CASES = [
    ("topk_softmax", 2, None, 1, "none"),
    ("topk_softmax", 2, 0.5, 3, "S4"),
    ("softmax_topk", 2, 0.75, 2, "S2"),
    ("noisy_topk", 2, 1.0, 3, "S1"),
    ("switch", 1, 1.0, 2, "S3"),
    ("expert_choice", 2, 1.5, 3, "none"),
]


def _rank_input(rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(2, 7 + rank, DIM, dtype=torch.float64, generator=generator)


def _loss(out_BSD: torch.Tensor) -> torch.Tensor:
    upstream = torch.linspace(-1, 1, out_BSD.numel(), dtype=out_BSD.dtype).view_as(out_BSD)
    return (out_BSD * upstream).sum()


def _expert_parallel_run(
    rank: int, world_size: int, case: tuple, break_reorder: bool = False
) -> dict[str, torch.Tensor]:
    router, top_k, capacity, partitions, strategy = case
    if break_reorder:  # ablation: leave received rows grouped by source, not by expert
        dispatch_plan_module._expert_major_order = lambda *args: None
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    moe = small_moe(router, top_k, capacity, z_loss_weight=0.01)
    apply_expert_parallel(moe, mesh, partitions=partitions, memory_reuse=strategy)
    x_BSD = _rank_input(rank).requires_grad_()
    torch.manual_seed(50 + rank)  # the noisy router's noise
    loss = _loss(moe(x_BSD))
    loss.backward()
    result = {"loss": loss.detach(), "x": x_BSD.grad}
    for name, param in moe.named_parameters():
        result[name] = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
    granularity = moe.execution.granularity
    result["chosen_partitions"] = torch.tensor(
        [-1] if granularity is None else list(granularity.cache_table.values())
    )
    return result


def _reference(case: tuple, world_size: int) -> list[dict[str, torch.Tensor]]:
    router, top_k, capacity, _, _ = case
    moe = small_moe(router, top_k, capacity, z_loss_weight=0.01)
    results = []
    for rank in range(world_size):
        moe.zero_grad()
        x_BSD = _rank_input(rank).requires_grad_()
        torch.manual_seed(50 + rank)
        experts = moe.experts
        loss = _loss(
            reference_moe_forward(moe, x_BSD, experts.w1_EFD, experts.w3_EFD, experts.w2_EDF)
        )
        loss.backward()
        results.append(
            {"loss": loss.detach(), "x": x_BSD.grad}
            | {name: param.grad.clone() for name, param in moe.named_parameters()}
        )
    return results


def _assert_matches(results: list[dict], reference: list[dict], world_size: int) -> None:
    per_rank = EXPERTS // world_size
    for rank in range(world_size):
        for key in ("loss", "x"):
            torch.testing.assert_close(
                results[rank][key], reference[rank][key], rtol=1e-10, atol=1e-10
            )
    for name in reference[0]:
        if name in ("loss", "x", "chosen_partitions"):
            continue
        expected = sum(ref[name] for ref in reference)
        if name.startswith("experts."):  # each rank holds its block of experts
            actual = torch.cat([results[rank][name] for rank in range(world_size)])
            assert results[0][name].shape[0] == per_rank
        else:  # replicated router: data parallelism would sum the ranks' gradients
            actual = sum(result[name] for result in results)
        torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize(
    "case", CASES, ids=lambda case: f"{case[0]}-cf{case[2]}-n{case[3]}-{case[4]}"
)
def test_expert_parallel_matches_single_process_fp64(case: tuple) -> None:
    results = run_on_ranks(_expert_parallel_run, 2, case)
    _assert_matches(results, _reference(case, 2), 2)


def test_expert_parallel_on_four_ranks_one_expert_each() -> None:
    case = ("topk_softmax", 2, 1.0, 2, "S4")
    results = run_on_ranks(_expert_parallel_run, 4, case)
    _assert_matches(results, _reference(case, 4), 4)


def test_automatic_granularity_agrees_across_ranks_and_keeps_parity() -> None:
    case = ("topk_softmax", 2, None, "auto", "auto")
    results = run_on_ranks(_expert_parallel_run, 2, case)
    _assert_matches(results, _reference(case, 2), 2)
    chosen = [result["chosen_partitions"].tolist() for result in results]
    assert chosen[0] == chosen[1] and len(chosen[0]) == 1 and chosen[0][0] >= 1


def test_grouping_received_rows_by_source_breaks_parity() -> None:
    """Ablation: skip the reorder from source-major to expert-major after the all-to-all."""
    case = ("topk_softmax", 2, None, 1, "none")
    results = run_on_ranks(_expert_parallel_run, 2, case, True)
    with pytest.raises(AssertionError):
        _assert_matches(results, _reference(case, 2), 2)


def _round_trip_run(rank: int, world_size: int, paced: bool) -> dict:
    group = torch.distributed.new_group(list(range(world_size)))
    seconds_per_byte = 2e-6
    exchange = PacedExchange(group, seconds_per_byte) if paced else CollectiveExchange(group)
    moe = small_moe("topk_softmax", 2, None, z_loss_weight=0.01)
    x_TD = _rank_input(rank).reshape(-1, DIM)
    routing = moe.router(x_TD)
    plans, order = plan_partitions(routing, 2, exchange)
    token_index_A = routing.token_index_A[order]
    rows_AD = x_TD[token_index_A]
    started = time.perf_counter()
    back = []
    for plan in plans:
        rows = rows_AD[plan.assignments]
        received = exchange.start(rows, plan.send_splits, plan.recv_splits).wait()
        back.append(exchange.start(received, plan.recv_splits, plan.send_splits).wait())
    elapsed = time.perf_counter() - started
    remote_rows = sum(link_rows(p.send_splits, p.recv_splits, rank) for p in plans)
    return {
        "identity": torch.equal(torch.cat(back), rows_AD),
        "elapsed": elapsed,
        "paced_floor": 2 * remote_rows * DIM * 8 * seconds_per_byte,
        "received_rows": sum(p.received_rows for p in plans),
    }


@pytest.mark.parametrize("paced", [False, True], ids=["native", "paced"])
def test_dispatch_then_combine_is_the_identity(paced: bool) -> None:
    results = run_on_ranks(_round_trip_run, 2, paced)
    assert all(result["identity"] for result in results)
    assert sum(r["received_rows"] for r in results) > 0
    if paced:  # the emulated link holds each transfer for at least its paced duration
        assert all(r["elapsed"] >= r["paced_floor"] for r in results)


def _parameter_shares(rank: int, world_size: int) -> dict[str, dict[str, tuple[int, int]]]:
    args = LlamaMoEArgs(**vars(TINY_LLAMA), moe=MoEArgs(num_experts=4, top_k=2))
    shares = {}
    for name, degrees in {"ep 2": {"ep": 2}, "ep 1 x etp 2": {"etp": 2}}.items():
        model, _, _ = data_parallel_model(world_size, get_model_spec("llama_moe"), args, **degrees)
        shares[name] = {
            n: (local_tensor(p).numel(), p.numel()) for n, p in model.named_parameters()
        }
    return shares


def test_experts_are_sharded_over_the_ep_groups_that_hold_them() -> None:
    """4 ranks, ep = 2: the two ep groups hold the same experts, and FSDP2 splits each rank's
    experts again over them, so every rank holds a quarter of every expert tensor, as of
    every dense one (replicated experts would be half); with etp = 2 instead, each expert's
    hidden dim over 2 ranks and FSDP2 over the other 2, a quarter again."""
    for per_layout in run_on_ranks(_parameter_shares, 4):
        for shares in per_layout.values():
            assert any(".experts." in name for name in shares)
            for name, (local, total) in shares.items():
                assert local * 4 == total, (name, local, total)


def test_expert_tensor_parallelism_is_refused_where_it_cannot_run() -> None:
    """One line each, before launch: ep x etp not dividing the token ranks, a hidden dim etp
    does not divide, experts with biases (gpt-oss)."""
    configs = Path(__file__).resolve().parents[2] / "configs"
    moe = ["--config", str(configs / "debug_moe.toml")]
    cases = [
        ([*moe, "--parallelism.etp", "2"], 2, "ep x etp = 4 must divide"),
        ([*moe, "--parallelism.ep", "1", "--parallelism.etp", "5"], 5, "etp=5 must divide the"),
        (
            ["--config", str(configs / "debug_gpt_oss.toml"), "--parallelism.ep", "1",
             "--parallelism.etp", "2"],
            4,
            "etp=2 with expert biases",
        ),
    ]  # fmt: skip
    for arguments, world, message in cases:
        with pytest.raises(ConfigError, match=message):
            validate_job(load_job_config(arguments), world, check_files=False)
    job = validate_job(load_job_config([*moe, "--parallelism.etp", "2"]), 4, check_files=False)
    assert (job.dims.ep, job.dims.etp) == (2, 2)
