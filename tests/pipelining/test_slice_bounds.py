"""Equal-cost slicing: the bounds give every slice the same cost under the simulator's cost
model (within one granule), the plan places them from the model's FLOPs and refuses the features
that need equal slices, and the simulated pipeline runs shorter than with equal-length slices."""

import itertools
import statistics

import pytest
import torch

from pipekit.attention.document_lengths import LogNormalLengths, packed_document_ids
from pipekit.config.job_config import JobConfig, ParallelismConfig
from pipekit.models import get_model_spec
from pipekit.pipelining.plan import plan_pipeline
from pipekit.pipelining.schedules.document_costs import document_unit_shares
from pipekit.pipelining.schedules.simulate import CostModel, simulate
from pipekit.pipelining.schedules.slice_bounds import (
    cost_slice_bounds,
    minimax_slice_bounds,
    slice_bounds,
)
from pipekit.pipelining.schedules.slice_layout import SliceLayout
from pipekit.pipelining.schedules.sliced import sliced_pipeline_actions
from pipekit.train.job import validate_job


def _costs(bounds: tuple[int, ...], ratio: float) -> list[float]:
    """Every slice's forward time under the simulator's cost model."""
    fractions = tuple(bound / bounds[-1] for bound in bounds)
    cost = CostModel(forward_attention=ratio, slice_bounds=fractions)
    n = len(bounds) - 1
    return [cost.forward_time(0, 1, index, n) for index in range(n)]


def test_equal_length_bounds_cut_every_seq_len_over_n_tokens():
    assert slice_bounds(32, 4) == (0, 8, 16, 24, 32)
    assert slice_bounds(32, 4, "equal_cost", attention_to_linear=0.0) == (0, 8, 16, 24, 32)


@pytest.mark.parametrize(
    ("seq_len", "n", "ratio"), [(8192, 8, 2.6), (32768, 8, 10.0), (4096, 4, 1)]
)
def test_equal_cost_bounds_equalise_the_cost_model_within_a_granule(seq_len, n, ratio):
    granularity = 64
    bounds = slice_bounds(seq_len, n, "equal_cost", ratio, granularity)
    assert bounds[0] == 0 and bounds[-1] == seq_len
    assert all(bound % granularity == 0 for bound in bounds)
    lengths = [end - start for start, end in itertools.pairwise(bounds)]
    assert lengths == sorted(lengths, reverse=True) and lengths[0] > lengths[-1]
    costs = _costs(bounds, ratio)
    # one granule at the sequence's end costs at most this much
    granule = (
        granularity + ratio * (seq_len**2 - (seq_len - granularity) ** 2) / seq_len
    ) / seq_len
    assert max(costs) - min(costs) <= granule
    equal = _costs(slice_bounds(seq_len, n), ratio)
    assert max(equal) - min(equal) > 5 * granule  # what equal lengths leave


def test_equal_cost_keeps_a_granule_per_slice_and_names_bad_input():
    assert slice_bounds(16, 8, "equal_cost", 1000.0, 2) == (0, 2, 4, 6, 8, 10, 12, 14, 16)
    with pytest.raises(ValueError, match="slicing='equal_area' is not one of"):
        slice_bounds(32, 4, "equal_area")
    with pytest.raises(ValueError, match="granularity=3 tokens, which must divide"):
        slice_bounds(32, 4, "equal_cost", 1.0, 3)
    with pytest.raises(ValueError, match="seq_len=30 does not split into num_slices=4"):
        slice_bounds(30, 4, "equal_cost", 1.0)


def test_equal_cost_slices_shorten_the_simulated_pipeline():
    """p = 2, m = 2, n = 8, attention 2.6x the linear work: the ranks stop waiting for each
    other's heavier late slices (the equal-length makespan is the longer one)."""
    actions = sliced_pipeline_actions(2, 2, 8)
    ratio = 2.6
    bounds = slice_bounds(8192, 8, "equal_cost", ratio, 64)
    equal_cost = CostModel(forward_attention=ratio, slice_bounds=tuple(b / 8192 for b in bounds))
    equal_length = CostModel(forward_attention=ratio)
    shorter = simulate(actions, num_slices=8, cost=equal_cost).makespan
    longer = simulate(actions, num_slices=8, cost=equal_length).makespan
    assert longer / shorter > 1.05
    # the same total work: only the waiting changed
    busy = simulate(actions, num_slices=8, cost=equal_cost).busy_time
    assert sum(busy.values()) == pytest.approx(
        sum(simulate(actions, num_slices=8, cost=equal_length).busy_time.values())
    )


def _plan(seq_len: int = 512, ratio: float = 3.0, **keys):
    keys.setdefault("dp_shard", 1)
    keys.setdefault("slicing", "equal_cost")
    config = ParallelismConfig(pipeline_parallel_degree=2, **keys)
    llama = get_model_spec("llama")
    shape = llama.shape(llama.flavor("debug").with_updates(n_layers=4, max_seq_len=seq_len))
    return plan_pipeline(config, llama.structure, shape, 4, seq_len, attention_to_linear=ratio)


def test_the_plan_carries_equal_cost_bounds_rounded_for_the_tp_shares():
    plan = _plan(num_slices=4)
    assert plan.slice_bounds == slice_bounds(512, 4, "equal_cost", 3.0, 8)
    assert plan.slice_lengths[0] > plan.slice_lengths[-1] and sum(plan.slice_lengths) == 512
    assert plan.slice_length == plan.slice_lengths[0]
    shared = _plan(num_slices=4, seq_len=96, tp=3, sequence_parallel=True)
    assert all(length % 3 == 0 for length in shared.slice_lengths)
    assert len(set(shared.slice_lengths)) > 1


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"pipeline_schedule": "1F1B"}, "needs sliced passes: num_slices >= 2, not 1"),
        ({"slicing": "equal"}, "slicing='equal' is not one of equal_length, equal_cost"),
    ],
)
@pytest.mark.parametrize("slicing", ["equal_cost", "documents"])
def test_uneven_slicing_refuses_what_cannot_cut_it(keys, message, slicing):
    with pytest.raises(ValueError, match=message):
        _plan(**{"slicing": slicing, **keys})


@pytest.mark.parametrize("slicing", ["equal_cost", "documents"])
@pytest.mark.parametrize("pieces", [2, 8])
def test_uneven_slices_under_context_parallelism_round_to_the_cp_ranks_pieces(slicing, pieces):
    """Each slice is dealt to the cp ranks in cp x pieces equal pieces (a tp share each under
    sequence parallelism): bounds, planned and cut per microbatch, land on multiples of it."""
    keys = {
        "cp": 2, "cp_balance_pieces": pieces, "context_exchange": True, "vocab_parallel": True,
        "num_slices": 4,
    }  # fmt: skip
    plan = _plan(slicing=slicing, **keys)
    multiple = 2 * pieces
    assert plan.slices.granularity % multiple == 0
    assert len(set(plan.slice_lengths)) > 1
    short_documents_BS = torch.arange(512).div(40, rounding_mode="floor").expand(2, 512)
    for bounds in (plan.slice_bounds, plan.slices.microbatch_bounds(short_documents_BS)):
        assert all(bound % multiple == 0 for bound in bounds), bounds
    shared = _plan(slicing=slicing, seq_len=768, tp=3, sequence_parallel=True, **keys)
    assert all(length % 3 == 0 for length in shared.slice_lengths)  # a tp share per cp rank


def test_documents_slicing_plans_one_sequence_and_cuts_each_microbatch_by_its_documents():
    plan = _plan(num_slices=4, slicing="documents")
    granularity = plan.slices.granularity
    assert plan.slices.per_microbatch and plan.slice_bounds == slice_bounds(
        512, 4, "equal_cost", 3.0, granularity
    )
    one_sequence = plan.slices.microbatch_bounds(None)
    assert all(
        abs(a - b) <= granularity for a, b in zip(one_sequence, plan.slice_bounds, strict=True)
    )
    short_documents_BS = torch.arange(512).div(32, rounding_mode="floor").expand(2, 512)
    assert plan.slices.microbatch_bounds(short_documents_BS) == (0, 128, 256, 384, 512)


def test_document_cuts_count_attention_in_the_kernels_tiles():
    """A microbatch of 8-token documents, then one long one: counted by keys, the short
    documents look nearly free and the first slice takes most of them; counted in the 64-token
    tiles a tiled kernel computes whole, each costs its tile and the first slice is shorter."""
    documents_S = torch.cat(
        [torch.arange(256).div(8, rounding_mode="floor"), torch.full((256,), 99)]
    )
    layout = {"bounds": (0, 128, 256, 384, 512), "slicing": "documents", "granularity": 16}
    by_keys = SliceLayout(**layout, attention_to_linear=3.0)
    by_tiles = SliceLayout(**layout, attention_to_linear=3.0, work_block=64)
    keys_cut = by_keys.microbatch_bounds(documents_S[None])
    tiles_cut = by_tiles.microbatch_bounds(documents_S[None])
    assert tiles_cut[1] < keys_cut[1], (keys_cut, tiles_cut)


def test_minimax_bounds_cut_any_slice_cost_and_name_bad_input():
    """On a per-token cost the minimax cut's costliest slice is no costlier than the nearest
    cumulative cut's; bounds are granule multiples, one granule at least per slice."""
    cost_S = torch.rand(512, generator=torch.Generator().manual_seed(0)) ** 4

    def slice_cost(start, end, earlier):
        assert earlier[0] == 0 and earlier[-1] == start
        return float(cost_S[start:end].sum())

    bounds = minimax_slice_bounds(slice_cost, 512, 6, granularity=8)
    costs = [slice_cost(a, b, [0, a]) for a, b in itertools.pairwise(bounds)]
    nearest = cost_slice_bounds(cost_S, 6, 8)
    assert max(costs) <= max(slice_cost(a, b, [0, a]) for a, b in itertools.pairwise(nearest))
    assert bounds[0] == 0 and bounds[-1] == 512 and all(b % 8 == 0 for b in bounds)
    spike_S = torch.zeros(64)
    spike_S[-1] = 1.0
    spiked = minimax_slice_bounds(lambda a, b, _: float(spike_S[a:b].sum()), 64, 4, 8)
    assert all(b - a >= 8 for a, b in itertools.pairwise(spiked))
    with pytest.raises(ValueError, match="granularity dividing the length"):
        minimax_slice_bounds(slice_cost, 10, 4, granularity=4)


def test_document_cuts_balance_the_tiles_the_sliced_kernel_computes():
    """Six long-tailed packed rows of 16K tokens, each cut in 8 slices on 64-token bounds, the
    kernel in 512-token tiles tiling every KV chunk from its own start (the CPU kernel): every
    document cut's slices are within 5% of each other in those tiles; cut by the row-aligned
    tile count (the ablation), slices that start inside a tile are priced by the wrong tiles:
    one row ends over 20% apart, and the rows 4% further apart on average."""
    ids_BS = packed_document_ids(LogNormalLengths(1024, 1.6), 6, 16384, seed=0)
    layout = SliceLayout(
        bounds=slice_bounds(16384, 8), slicing="documents", granularity=64,
        attention_to_linear=2.6, work_block=512,
    )  # fmt: skip
    balanced, row_aligned = [], []
    for ids_1S in ids_BS.split(1):
        costs = layout.slice_costs(ids_1S, layout.microbatch_bounds(ids_1S))
        balanced.append(max(costs) / statistics.fmean(costs))
        by_rows = layout.slice_costs(ids_1S, cost_slice_bounds(layout.token_costs(ids_1S), 8, 64))
        row_aligned.append(max(by_rows) / statistics.fmean(by_rows))
    assert max(balanced) < 1.05, balanced
    assert max(row_aligned) > 1.2, row_aligned
    assert statistics.fmean(balanced) < statistics.fmean(row_aligned) - 0.04


def test_the_simulator_prices_each_microbatchs_documents():
    """`document_unit_shares`: on one causal sequence per row, the shares the simulator
    assumes for planned slices; on packed rows (microbatch 0: short documents then a long one;
    microbatch 1: the reverse), the document cut simulates a shorter step than equal-length
    slices, and both far shorter than priced as one causal sequence per row."""
    layouts = {
        cut: _plan(num_slices=4, slicing=cut, microbatches=2).slices
        for cut in ("equal_length", "documents")
    }
    one_document = document_unit_shares(
        layouts["equal_length"], torch.zeros(2, 512, dtype=torch.long), 2
    )
    default = CostModel()
    for microbatch in one_document:
        for index, (tokens, attention) in enumerate(microbatch):
            assert tokens == default.slice_shares(index, 4)[0]
            assert attention == pytest.approx(default.slice_shares(index, 4)[1], abs=2e-3)
    short_S = torch.arange(256).div(16, rounding_mode="floor")
    short_then_long = torch.cat([short_S, torch.full((256,), 99)])
    long_then_short = torch.cat([torch.zeros(256, dtype=torch.long), 1 + short_S])
    ids_BS = torch.stack([short_then_long, short_then_long, long_then_short, long_then_short])
    actions = _plan(num_slices=4, slicing="documents", microbatches=2).actions_by_rank
    makespans = {}
    for cut, layout in layouts.items():
        priced = CostModel(
            forward_attention=3.0, unit_shares=document_unit_shares(layout, ids_BS, 2)
        )
        unpriced = CostModel(forward_attention=3.0, slice_bounds=layout.fractions)
        makespans[cut] = [
            simulate(actions, num_slices=4, cost=c).makespan for c in (priced, unpriced)
        ]
    assert makespans["documents"][0] < 0.97 * makespans["equal_length"][0], makespans
    assert makespans["equal_length"][1] > 2 * makespans["equal_length"][0]  # shares are read
    with pytest.raises(ValueError, match="covers 2 microbatches"):
        CostModel(unit_shares=one_document).slice_shares(0, 4, microbatch=2)


def test_a_job_places_equal_cost_slices_from_the_model_flops():
    config = JobConfig()
    config.model.flavor = "debug"
    config.training.global_batch_size, config.training.seq_len = 4, 2048
    config.parallelism = ParallelismConfig(
        dp_shard=1, pipeline_parallel_degree=2, num_slices=4, slicing="equal_cost"
    )
    lengths = validate_job(config, world_size=2).pipeline.slice_lengths
    assert lengths[0] > lengths[-1], lengths
    config.parallelism.cp = 2  # each slice dealt to the cp ranks in equal pieces
    split = validate_job(config, world_size=4).pipeline.slice_lengths  # a cp rank's shares
    assert sum(split) == 1024 and split[0] > split[-1], split
