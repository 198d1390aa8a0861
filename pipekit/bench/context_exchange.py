"""`python -m pipekit.bench context-exchange --pp 4 --slices 16 --seq 65536 --simulate`, and
measured: `python -m pipekit.bench context-exchange --pp 2 --slices 8 --microbatches 2 --seq 8192`.

Attention context exchange on the sliced schedule, simulated
(`pipekit.pipelining.schedules.simulate`):

- per lockstep step, each rank's pass and its attention work (in forward-slice units, a backward
  slice weighing `--backward-ratio`) before and after the exchange plan
  (`pipekit.pipelining.features.exchange_plan`);
- the bubble fraction with and without exchange under causal-attention costs at `--seq` for a
  Llama-like model of width `--dim` (attention / linear forward FLOPs = S / (12 d), as in the
  `schedules` bench), counted over all ranks: (p x makespan - busy) / busy. The exchange's own
  traffic is taken to overlap compute (early KV exchange), i.e. it costs no time here;
- the forward context sent per microbatch per rank, in slices and in bytes (`--layers` layers,
  bfloat16), against SlimPipe's Eq. 2 and its bound (2 - (p-1)/n) L M_h.

Without `--simulate` the bench also runs it: `--pp` gloo ranks, one thread each, started with
the pipeline-throughput bench's fair allocator setting, time the sliced schedule with and without
context exchange and torch's Schedule1F1B on the same model (a small Llama, float32; `--dim`
and `--layers` default to 256 and 4 there, against 5120 and 40 for the simulation), alternating
after a warm-up step each; the figures are ratios of median step times. One recorded step of
each then splits every rank's step into compute and idle (the pipeline-throughput bench's
breakdown), and `share_of_simulated_gain` is the measured step-time gain of the exchange as a
share of the gain the simulated makespans predict at the same shape; `per_round_speedup` is the
median of the per-round ratios (each round times every schedule once, so a pair shares the
machine's drifting state). A table of CPU seconds per step by thread (the rank's own, the
serving threads', gloo's) shows what the moved work and its transfers cost on the cores that
also run the passes; `exchange_cpu_ratio` is the exchange's CPU per step over the plain sliced
one's, all ranks, the median of the per-round ratios (1 when moving attention costs nothing, as
the simulation assumes).
"""

from __future__ import annotations

import argparse
import statistics

from pipekit.bench._cpu_per_step import print_cpu_per_step
from pipekit.bench._pipeline_launch import (
    add_model_arguments,
    add_pinning_argument,
    add_pipeline_arguments,
    check_pipeline_shape,
    model_spec,
)
from pipekit.bench._schedule_timing import (
    print_step_breakdown,
    schedule_runs,
    time_alternately,
)
from pipekit.bench.report import paired_ratios, print_result, print_table
from pipekit.bench.schedules import attention_to_linear_ratio
from pipekit.pipelining.features.exchange_plan import eq2_exchanged_slices, plan_context_exchange
from pipekit.pipelining.schedules.simulate import CostModel, SimulationResult, simulate
from pipekit.pipelining.schedules.sliced import sliced_pipeline_actions

__all__ = ["main"]

_GIB = 2**30


def overall_bubble(result: SimulationResult) -> float:
    """Idle over busy time summed over all ranks."""
    busy = sum(result.busy_time.values())
    return (len(result.busy_time) * result.makespan - busy) / busy


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pipekit.bench context-exchange",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_pipeline_arguments(parser, pp=4, slices=16, microbatches=4, seq=65536)
    parser.add_argument("--backward-ratio", type=float, default=2.0, help="backward / forward")
    parser.add_argument("--simulate", action="store_true", help="simulate only, run nothing")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps of each schedule")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps of each schedule")
    add_pinning_argument(parser)
    add_model_arguments(parser, dim=None, layers=None, heads=4, kv_heads=2, ffn_dim=768, vocab=256)
    options = parser.parse_args(argv)
    p, n, m = options.pp, options.slices, options.microbatches
    small = {"dim": 5120, "layers": 40} if options.simulate else {"dim": 256, "layers": 4}
    for name, default in small.items():
        if getattr(options, name) is None:
            setattr(options, name, default)
    try:
        if p < 2 or m < 1 or options.seq < n:
            raise ValueError(f"need --pp >= 2, --microbatches >= 1 and --seq >= --slices={n}")
        actions = sliced_pipeline_actions(p, m, n, 1)
        plan = plan_context_exchange(actions, n, options.backward_ratio)
        if not options.simulate:
            check_pipeline_shape(
                num_ranks=p,
                microbatches=m,
                num_slices=n,
                seq_len=options.seq,
                num_layers=options.layers,
                stages_per_rank=1,
            )
            spec = model_spec(options, options.seq)
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")

    ratio = attention_to_linear_ratio(options.seq, options.dim)
    cost = CostModel(
        forward_linear=1.0, forward_attention=ratio, backward_ratio=options.backward_ratio
    )
    print(
        f"sliced schedule p={p}, n={n}, m={m}; causal attention at S={options.seq}, d="
        f"{options.dim}: attention / linear = {ratio:.3g}; backward = "
        f"{options.backward_ratio:g} x forward"
    )
    print("\nattention work per rank per lockstep step (forward-slice units): before -> after")
    rows = []
    for moment in plan.moments:
        cells = []
        for rank in range(p):
            action = moment.actions.get(rank)
            if action is None:
                cells.append("-")
                continue
            before, after = moment.work_before[rank], moment.work_after[rank]
            cells.append(f"{action} {before:g}->{after:g}")
        rows.append([moment.index, *cells, moment.spread_before, moment.spread_after])
    print_table(["step", *(f"rank {r}" for r in range(p)), "spread", "after"], rows)

    without = simulate(actions, num_slices=n, cost=cost)
    with_exchange = simulate(
        actions, num_slices=n, cost=cost, attended_slices=plan.attended_slices()
    )
    uniform = simulate(actions, num_slices=n, cost=CostModel(backward_ratio=options.backward_ratio))
    print()
    print_table(
        ["", "makespan", "bubble (all ranks)"],
        [
            ["without exchange", without.makespan, overall_bubble(without)],
            ["with exchange", with_exchange.makespan, overall_bubble(with_exchange)],
            ["no attention (reference)", uniform.makespan, overall_bubble(uniform)],
        ],
    )
    sent = plan.exchanged_slices(m, p)
    eq2 = eq2_exchanged_slices(p, n)
    slice_bytes = options.layers / p * options.seq / n * options.dim * 2  # bfloat16
    bound = (2 - (p - 1) / n) * options.layers * options.seq * options.dim * 2
    print(
        f"\nforward context sent per microbatch per rank: {sent:.4g} slices = "
        f"{sent * slice_bytes / _GIB:.3g} GiB; Eq. 2: {eq2} slices = "
        f"{eq2 * slice_bytes / _GIB:.3g} GiB; bound (2 - (p-1)/n) L M_h = {bound / _GIB:.3g} GiB"
    )
    figures = {
        "bubble_with": overall_bubble(with_exchange),
        "bubble_without": overall_bubble(without),
        "bytes_vs_eq2": sent / eq2,
        "makespan_ratio": with_exchange.makespan / without.makespan,
    }
    if not options.simulate:
        figures |= _measure(options, spec)
        # the step-time gain measured, as a share of the gain the simulated makespans predict
        simulated_gain = 1 / figures["makespan_ratio"] - 1
        measured_gain = figures["measured_speedup"] - 1
        figures["share_of_simulated_gain"] = (
            measured_gain / simulated_gain if simulated_gain > 0 else float("nan")
        )
        print(
            f"\nsimulated gain {simulated_gain:.2%} (makespan ratio "
            f"{figures['makespan_ratio']:.4f}); measured gain {measured_gain:.2%}"
        )
    print_result(**figures)


def _measure(options: argparse.Namespace, model: dict[str, int]) -> dict[str, float]:
    """Time the four schedules and the sliced one with `context_exchange = "auto"` (its choice
    settled first, by its own timed trial steps) in one set of ranks; print the table; the
    measured ratios."""
    runs = schedule_runs(options.slices)
    runs["sliced+auto"] = {**runs["sliced"], "context_exchange": "auto"}
    spec = {
        "model": model,
        "microbatches": options.microbatches,
        "rows_per_microbatch": 1,
        "warmup": options.warmup,
        "repeats": options.repeats,
        "runs": runs,
    }
    ranks = time_alternately(options.pp, spec, pin=not options.no_pin, timeout=options.timeout)
    samples = ranks[0]["samples"]
    medians = {name: statistics.median(samples[name]) for name in runs}
    tokens = options.microbatches * options.seq
    print_table(
        ["schedule", "median s", "min s", "max s", "tokens/s", "vs 1F1B"],
        [
            [
                name,
                medians[name],
                min(samples[name]),
                max(samples[name]),
                tokens / medians[name],
                medians["1F1B"] / medians[name],
            ]
            for name in runs
        ],
    )
    per_round, faster = _per_round(samples["sliced"], samples["sliced+exchange"])
    print(
        f"per round (the schedules alternate), sliced / sliced+exchange: median {per_round:.4g}, "
        f"the exchange faster in {faster} of {options.repeats}"
    )
    cpu_ratio = print_cpu_per_step(ranks, list(runs), "sliced", "sliced+exchange")
    print_step_breakdown(
        [rank["recorded"] for rank in ranks], options.pp, options.microbatches, options.slices
    )
    choice = ranks[0]["choices"]["sliced+auto"]["context_exchange"]
    print(
        f"\ncontext_exchange = auto chose {'on' if choice['chosen'] else 'off'}: "
        f"{choice['reason']}; then {medians['sliced'] / medians['sliced+auto']:.4f}x plain sliced"
    )
    exchanged = [rank["recorded"]["sliced+exchange"] for rank in ranks]
    passes = sum(record["ahead_passes"] for record in exchanged)
    served = sum(record["ahead_served"] for record in exchanged)
    posted_ms = 1000 * sum(record["ahead_posted_s"] for record in exchanged) / max(passes, 1)
    held_ms = 1000 * sum(record["ahead_held_s"] for record in exchanged) / max(served, 1)
    held_min_ms = 1000 * min(record["ahead_held_min_s"] for record in exchanged)
    mib = sum(record["ahead_bytes"] for record in exchanged) / 2**20
    print(
        f"\nearly KV exchange (recorded step, all ranks): {passes} lending passes sent {mib:.3g} "
        f"MiB of chunks ahead, posted a mean {posted_ms:.4g} ms before the pass began; the "
        f"serving threads held them a mean {held_ms:.4g} ms (least {held_min_ms:.3g} ms) before "
        "the first request came"
    )
    return {
        "ahead_held_ms": held_ms,
        "measured_speedup": medians["sliced"] / medians["sliced+exchange"],
        "auto_vs_sliced": medians["sliced"] / medians["sliced+auto"],
        "auto_chose_exchange": int(choice["chosen"]),
        "vs_1f1b": medians["1F1B"] / medians["sliced+exchange"],
        "sliced_vs_1f1b": medians["1F1B"] / medians["sliced"],
        "per_round_speedup": per_round,
        "exchange_cpu_ratio": cpu_ratio,
    }


def _per_round(sliced_s: list[float], exchange_s: list[float]) -> tuple[float, int]:
    """The median of the per-round ratios sliced / exchange (`paired_ratios`), and in how many
    rounds the exchange was faster."""
    ratios = paired_ratios(sliced_s, exchange_s)
    return statistics.median(ratios), sum(ratio > 1 for ratio in ratios)


if __name__ == "__main__":
    main()
