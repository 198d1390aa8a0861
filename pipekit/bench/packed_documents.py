"""`python -m pipekit.bench packed-documents --pp 2 --slices 8 --microbatches 2 --seq 16384`:
slices of packed documents, cut once for one causal sequence or per microbatch by its own
documents.

Each row packs documents of a long-tailed mix (`LogNormalLengths`: log-normal lengths, median
`--median` tokens, log-spread `--sigma`; most documents short, a thin tail as long as a row),
so a token's attention work is the keys its own document lets it see, not its position. Three
cuts of the sliced pipeline (`--pp` ranks) are compared on the same batch:

- `equal_length`: SlimPipe's, every slice `S / n` tokens;
- `equal_cost`: cut once, for one causal sequence per row (the front-loaded formula);
- `documents`: each microbatch cut by its own documents' work, every step.

The work table gives, per cut, each slice's attention-plus-linear work over the mean of its
microbatch's slices (the slowest slice sets the pace of a lockstep pipeline), in the tiles the
sliced kernel computes. Then the ranks (gloo, one thread each, the fair allocator) time the
three cuts alternately after a warm-up step each; `--slice-steps` recorded steps of each give
the measured imbalance: per stage and microbatch, the slowest slice's forward-plus-backward
seconds over the mean of its slices, each slice's seconds summed over those steps (the same
batch: the sum averages out the machine's jitter, not the cut's imbalance; a single step on
this 2-core machine varies a slice by 5-10%). `documents_vs_<cut>` is the median per-round
step-time ratio;
`simulated_documents_vs_<cut>` the simulator's for this batch (`document_unit_shares`), and
`prediction_error_vs_<cut>` how far it is from the measured one.

Then the pipeline with every slice over `--cp` ranks, in work only (pp x cp ranks outnumber
this machine's cores: their times would mean nothing): equal-length slices dealt head and tail
against slices cut and dealt by documents. Then the same batch over `--cp` context-parallel
ranks, and `--dp-rows` rows of `--dp-seq` tokens over `--dp` data-parallel ranks
(`_rank_deals`): the static deals against the deals by attention work, in work and in measured
per-rank compute and tokens/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import statistics

from torch import Tensor

from pipekit.attention.across.token_shards import context_parallel_tokens
from pipekit.attention.document_lengths import LogNormalLengths, packed_document_ids
from pipekit.bench._pipeline_launch import (
    add_model_arguments,
    add_pinning_argument,
    add_pipeline_arguments,
    bench_plan,
    check_pipeline_shape,
    model_spec,
)
from pipekit.bench._rank_deals import rank_deal_part
from pipekit.bench._schedule_timing import time_alternately
from pipekit.bench.report import max_over_mean, paired_ratios, print_result, print_table
from pipekit.pipelining.pipeline_plan import PipelinePlan
from pipekit.pipelining.schedules.document_costs import document_unit_shares
from pipekit.pipelining.schedules.simulate import CostModel, simulate
from pipekit.pipelining.schedules.slice_bounds import SLICINGS
from pipekit.pipelining.schedules.slice_layout import SliceLayout

__all__ = ["main"]


def _work_imbalance(
    plan_slices: SliceLayout, document_ids_BS: Tensor, microbatches: int
) -> tuple[float, list[tuple[int, ...]]]:
    """(mean over microbatches of the slowest slice's work over the mean slice's, the bounds
    of each microbatch) for one cut, each slice's work as the sliced kernel computes it."""
    ratios, bounds_per_microbatch = [], []
    for ids_BS in document_ids_BS.tensor_split(microbatches):
        bounds = plan_slices.microbatch_bounds(ids_BS)
        ratios.append(max_over_mean(plan_slices.slice_costs(ids_BS, bounds)))
        bounds_per_microbatch.append(bounds)
    return statistics.fmean(ratios), bounds_per_microbatch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pipekit.bench packed-documents",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_pipeline_arguments(parser, pp=2, slices=8, microbatches=2, seq=16384)
    add_model_arguments(parser, dim=256, layers=4, heads=4, kv_heads=2, ffn_dim=768, vocab=256)
    add_pinning_argument(parser)
    parser.add_argument("--median", type=int, default=1024, help="median document tokens")
    parser.add_argument("--sigma", type=float, default=1.6, help="log-normal spread")
    parser.add_argument("--seed", type=int, default=0, help="seed of the document draw")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps of each cut")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps of each cut")
    parser.add_argument("--slice-steps", type=int, default=3,
                        help="recorded steps whose slice times are summed")  # fmt: skip
    parser.add_argument("--work-only", action="store_true", help="print the work tables only")
    parser.add_argument("--cp", type=int, default=2, help="context-parallel ranks (0: skip)")
    parser.add_argument("--cp-pieces", type=int, default=8, help="pieces per cp rank")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel ranks (0: skip)")
    parser.add_argument("--dp-rows", type=int, default=8, help="rows of the dp part's batch")
    parser.add_argument("--dp-seq", type=int, default=4096, help="tokens per row, dp part")
    parser.add_argument("--pipeline", default=True, action=argparse.BooleanOptionalAction,
                        help="the sliced pipeline's part")  # fmt: skip
    options = parser.parse_args(argv)
    try:
        check_pipeline_shape(
            num_ranks=options.pp, microbatches=options.microbatches, num_slices=options.slices,
            seq_len=options.seq, num_layers=options.layers, stages_per_rank=1,
        )  # fmt: skip
        model = model_spec(options, options.seq)
    except ValueError as error:
        parser.error(str(error))
    load = os.getloadavg()[0]
    lengths = LogNormalLengths(options.median, options.sigma)
    document_ids_BS = packed_document_ids(lengths, options.microbatches, options.seq, options.seed)
    mix = lengths.label
    documents = int(sum(int(row.max()) + 1 for row in document_ids_BS))
    print(
        f"{options.microbatches} microbatches of 1 row x {options.seq} tokens, {mix}: "
        f"{documents} document parts; {options.pp} ranks, {options.slices} slices"
    )
    figures: dict[str, float] = {}
    if options.pipeline:
        figures |= _pipeline_part(options, model, document_ids_BS)
    if options.pipeline and options.cp:
        figures |= _pipeline_cp_part(options, model, document_ids_BS)
    timing = dict(
        warmup=options.warmup, repeats=options.repeats, pin=not options.no_pin,
        timeout=options.timeout, measure=not options.work_only, pieces=options.cp_pieces,
    )  # fmt: skip
    if options.cp:
        figures |= rank_deal_part("cp", document_ids_BS, model, ranks=options.cp, **timing)
    if options.dp:
        rows_BS = packed_document_ids(lengths, options.dp_rows, options.dp_seq, options.seed)
        dp_model = model | {"max_seq_len": options.dp_seq}
        figures |= rank_deal_part("dp", rows_BS, dp_model, ranks=options.dp, **timing)
    print_result(**figures, load_before=load)


def _pipeline_part(
    options: argparse.Namespace, model: dict, document_ids_BS: Tensor
) -> dict[str, float]:
    """The three cuts' work table and, unless `--work-only`, their timing."""
    work, makespan, rows = {}, {}, []
    for cut in SLICINGS:
        plan = bench_plan(
            model, schedule="sliced", stages_per_rank=1, num_ranks=options.pp,
            microbatches=options.microbatches, num_slices=options.slices,
            rows=options.microbatches, slicing=cut,
        )  # fmt: skip
        work[cut], bounds = _work_imbalance(plan.slices, document_ids_BS, options.microbatches)
        makespan[cut] = _simulated_makespan(plan, document_ids_BS, options.microbatches)
        inner = "; ".join(" ".join(map(str, b[1:-1])) for b in bounds)
        rows.append([cut, work[cut], makespan[cut], inner])
    print_table(["cut", "work max/mean", "simulated step", "inner bounds per microbatch"], rows)
    figures = {f"work_imbalance_{cut}": work[cut] for cut in SLICINGS}
    for cut in ("equal_length", "equal_cost"):
        figures[f"simulated_documents_vs_{cut}"] = makespan[cut] / makespan["documents"]
    if not options.work_only:
        figures |= _measure(options, model, document_ids_BS)
        for cut in ("equal_length", "equal_cost"):
            simulated = figures[f"simulated_documents_vs_{cut}"]
            figures[f"prediction_error_vs_{cut}"] = simulated / figures[f"documents_vs_{cut}"] - 1
    return figures


_PIPELINE_CP_LAYOUTS = {"static": ("equal_length", "sequence"), "documents": ("documents",) * 2}
"""The pipeline with cp: (slicing, cp_balance) of the static layout and the document-aware."""


def _pipeline_cp_part(
    options: argparse.Namespace, model: dict, document_ids_BS: Tensor
) -> dict[str, float]:
    """Work only: `--pp` pipeline ranks with every slice over `--cp` ranks (pp x cp ranks,
    more than this machine's cores, so not timed), static (equal-length slices, each dealt
    head and tail) against document-aware (slices cut and dealt by documents): per
    microbatch, the busiest (slice, cp rank) cell's work over the mean cell's. Work is linear
    plus the keys each token sees within its document, the cost the cp deal balances; the
    slices are cut by it too (the kernel's tiles, which the pipeline part counts, are left
    out: a cp rank's queries are scattered pieces, not the sequence's tiles)."""
    figures, rows = {}, []
    cp = options.cp
    for name, (cut, deal) in _PIPELINE_CP_LAYOUTS.items():
        plan = bench_plan(
            model, schedule="sliced", stages_per_rank=1, num_ranks=options.pp,
            microbatches=options.microbatches, num_slices=options.slices,
            rows=options.microbatches, slicing=cut, cp=cp, cp_balance=deal,
            cp_balance_pieces=options.cp_pieces,
        )  # fmt: skip
        slices = dataclasses.replace(plan.slices, work_block=1)  # keys seen, as dealt
        ratios = []
        for ids_BS in document_ids_BS.tensor_split(options.microbatches):
            bounds = slices.microbatch_bounds(ids_BS)
            dealt = ids_BS if deal == "documents" else None
            table_CS = context_parallel_tokens(
                options.seq, cp, document_ids_BS=dealt, pieces_per_rank=options.cp_pieces,
                bounds=bounds,
            )  # fmt: skip
            cost_S = slices.token_costs(ids_BS)
            ratios.append(
                max_over_mean(
                    [
                        float(cost_S[tokens_S[start // cp : end // cp]].sum())
                        for start, end in itertools.pairwise(bounds)
                        for tokens_S in table_CS
                    ]
                )
            )
        figures[f"pp_cp_work_imbalance_{name}"] = statistics.fmean(ratios)
        rows.append([name, cut, deal, figures[f"pp_cp_work_imbalance_{name}"]])
    print_table(["pp x cp layout", "slicing", "cp_balance", "work max/mean (slice, rank)"], rows)
    return figures


def _simulated_makespan(plan: PipelinePlan, document_ids_BS: Tensor, microbatches: int) -> float:
    """The simulator's step for the plan on this batch: each microbatch's slices as the plan
    cuts them, priced by their tokens and their attention within documents (in the kernel's
    tiles), attention at the model's attention-to-linear FLOPs."""
    cost = CostModel(
        forward_attention=plan.attention_to_linear,
        unit_shares=document_unit_shares(plan.slices, document_ids_BS, microbatches),
    )
    return simulate(plan.actions_by_rank, num_slices=plan.num_slices, cost=cost).makespan


def _measure(options: argparse.Namespace, model: dict, document_ids_BS: Tensor) -> dict[str, float]:
    """Time the three cuts alternately in the same ranks; the measured slice imbalance and the
    per-round step ratios."""
    runs = {
        cut: {"schedule": "sliced", "num_slices": options.slices, "slicing": cut}
        for cut in SLICINGS
    }
    spec = {
        "model": model,
        "microbatches": options.microbatches,
        "rows_per_microbatch": 1,
        "warmup": options.warmup,
        "repeats": options.repeats,
        "runs": runs,
        "document_ids": document_ids_BS.tolist(),
        "slice_steps": options.slice_steps,
    }
    ranks = time_alternately(options.pp, spec, pin=not options.no_pin, timeout=options.timeout)
    samples = ranks[0]["samples"]
    tokens = options.microbatches * options.seq
    imbalance = {
        cut: statistics.fmean(rank["recorded"][cut]["slice_time_imbalance"] for rank in ranks)
        for cut in SLICINGS
    }
    print_table(
        ["cut", "median s", "min s", "max s", "tokens/s", "slice time max/mean"],
        [
            [cut, statistics.median(samples[cut]), min(samples[cut]), max(samples[cut]),
             tokens / statistics.median(samples[cut]), imbalance[cut]]
            for cut in SLICINGS
        ],
    )  # fmt: skip
    figures = {f"time_imbalance_{cut}": imbalance[cut] for cut in SLICINGS}
    for cut in ("equal_length", "equal_cost"):
        figures[f"documents_vs_{cut}"] = statistics.median(
            paired_ratios(samples[cut], samples["documents"])
        )
    return figures


if __name__ == "__main__":
    main()
