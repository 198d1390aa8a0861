"""`python -m pipekit.bench context-exchange --pp 4 --slices 16 --seq 65536 --simulate`.

Attention context exchange on the sliced schedule, simulated (`pipekit.pipelining.simulate`):

- per lockstep step, each rank's pass and its attention work (in forward-slice units, a backward
  slice weighing `--backward-ratio`) before and after the exchange plan
  (`pipekit.pipelining.exchange_plan`);
- the bubble fraction with and without exchange under causal-attention costs at `--seq` for a
  Llama-like model of width `--dim` (attention / linear forward FLOPs = S / (12 d), as in the
  `schedules` bench), counted over all ranks: (p x makespan - busy) / busy. The exchange's own
  traffic is taken to overlap compute (early KV exchange), i.e. it costs no time here;
- the forward context sent per microbatch per rank, in slices and in bytes (`--layers` layers,
  bfloat16), against SlimPipe's Eq. 2 and its bound (2 - (p-1)/n) L M_h.

The measured mode (ranks exchanging context while they run) needs `ContextExchangeAttention`,
which is not built yet; without `--simulate` the bench says so and stops.
"""

from __future__ import annotations

import argparse

from pipekit.bench._report import print_result, print_table
from pipekit.bench.schedules import attention_to_linear_ratio
from pipekit.pipelining.actions import sliced_pipeline_actions
from pipekit.pipelining.exchange_plan import eq2_exchanged_slices, plan_context_exchange
from pipekit.pipelining.simulate import CostModel, SimulationResult, simulate

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
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks p")
    parser.add_argument("--slices", type=int, default=16, help="slices per sequence n")
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches m per step")
    parser.add_argument("--seq", type=int, default=65536, help="sequence length S")
    parser.add_argument("--dim", type=int, default=5120, help="model width d (Llama 13B: 5120)")
    parser.add_argument("--layers", type=int, default=40, help="layers L (Llama 13B: 40)")
    parser.add_argument("--backward-ratio", type=float, default=2.0, help="backward / forward")
    parser.add_argument("--simulate", action="store_true", help="simulate instead of running")
    options = parser.parse_args(argv)
    p, n, m = options.pp, options.slices, options.microbatches
    if not options.simulate:
        parser.exit(
            2,
            f"{parser.prog}: error: the measured mode needs ContextExchangeAttention, which is "
            "not built yet; pass --simulate\n",
        )
    try:
        if p < 2 or m < 1 or options.seq < n:
            raise ValueError(f"need --pp >= 2, --microbatches >= 1 and --seq >= --slices={n}")
        actions = sliced_pipeline_actions(p, m, n, 1)
        plan = plan_context_exchange(actions, n, options.backward_ratio)
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
    print_result(
        bubble_with=overall_bubble(with_exchange),
        bubble_without=overall_bubble(without),
        bytes_vs_eq2=sent / eq2,
        makespan_ratio=with_exchange.makespan / without.makespan,
    )


if __name__ == "__main__":
    main()
