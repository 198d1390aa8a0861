"""The rank parts of `packed-documents`: the same packed batch dealt to ranks statically and by
its attention work within documents, in work and in measured compute and tokens/s.

- `cp`: context-parallel ranks holding head and tail of every row (`cp_balance = "sequence"`)
  against each batch's pieces dealt by their work (`cp_balance = "documents"`), whole
  sequences by the `auto` variant.
- `dp`: data-parallel ranks (FSDP2) taking the rows in order against rows dealt by their work
  (`[data] balance_attention`: `equal_work_bins` over `row_attention_work`).

The work table gives each deal's per-rank causal attention work (the keys its queries see in
their own documents) over the mean rank's. The ranks (gloo, one thread each, the fair allocator)
then train the same model under both deals alternately; a rank's compute per step is its main
thread's CPU seconds (gloo moves bytes on threads of its own and a rank waiting for its peer
sleeps), and the measured imbalance is the slowest rank's over the mean. `<kind>_balanced_vs_
static` is the median per-round ratio of the two deals' step times.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from pipekit.attention.across.token_shards import context_parallel_tokens
from pipekit.attention.context import AttentionContext, CausalAttention
from pipekit.attention.work import equal_work_bins, keys_seen
from pipekit.bench._pipeline_launch import bench_model, rank_core_sets, run_ranks, synthetic_batch
from pipekit.bench._schedule_timing import FAIR_ALLOCATOR
from pipekit.bench.report import max_over_mean, paired_ratios, print_table
from pipekit.config.job_config import ParallelismConfig
from pipekit.distributed.context_parallel import context_parallel_ranks
from pipekit.layers.loss import count_label_tokens, token_sum_cross_entropy
from pipekit.testing.data_parallel import data_parallel_model
from pipekit.train.data.balance import row_attention_work

__all__ = ["DEALS", "rank_deal_part", "time_rank_deals"]

DEALS = {"cp": ("sequence", "documents"), "dp": ("in_order", "by_work")}
"""Per kind of ranks, the static deal and the one by attention work."""


def _row_order(document_ids_BS: torch.Tensor, ranks: int, deal: str) -> torch.Tensor:
    """Rows in the order the data-parallel ranks take consecutive runs of them."""
    if deal == "in_order":
        return torch.arange(document_ids_BS.shape[0])
    return equal_work_bins(row_attention_work(document_ids_BS), ranks)


def work_imbalance(
    document_ids_BS: torch.Tensor, kind: str, ranks: int, deal: str, pieces: int
) -> float:
    """The busiest rank's causal attention work over the mean rank's, under one deal."""
    work_BS = keys_seen(document_ids_BS).double()
    if kind == "dp":
        order_B = _row_order(document_ids_BS, ranks, deal)
        return max_over_mean([float(part.sum()) for part in work_BS[order_B].chunk(ranks)])
    documents = document_ids_BS if deal == "documents" else None
    table_CS = context_parallel_tokens(document_ids_BS.shape[1], ranks, 1, documents, pieces)
    work_S = work_BS.sum(dim=0)
    return max_over_mean([float(work_S[tokens].sum()) for tokens in table_CS])


def _deal_steps(
    rank: int, num_ranks: int, spec: dict[str, Any], batch: TensorDict
) -> tuple[torch.nn.Module, dict[str, Callable[[], tuple[TensorDict, AttentionContext]]]]:
    """The model and, per deal, this rank's part of the batch with its attention context."""
    family, args = bench_model(spec["model"])
    kind = spec["kind"]
    cp = num_ranks if kind == "cp" else 1
    model, _, mesh = data_parallel_model(num_ranks, family, args, cp=cp, dtype=torch.float32)
    parts: dict[str, Callable[[], tuple[TensorDict, AttentionContext]]] = {}
    for deal in DEALS[kind]:
        if kind == "cp":
            config = ParallelismConfig(cp=cp, cp_balance=deal, cp_balance_pieces=spec["pieces"])
            ranks = context_parallel_ranks(mesh, config, batch.batch_size[1])

            def shard(ranks=ranks) -> tuple[TensorDict, AttentionContext]:
                local = ranks.shard(batch)
                return local, ranks.attention(local, "cpu")
        else:
            rows = _row_order(batch["document_ids"], num_ranks, deal).chunk(num_ranks)[rank]

            def shard(rows=rows) -> tuple[TensorDict, AttentionContext]:
                local = batch[rows]
                return local, CausalAttention(local["document_ids"], backend="cpu")

        parts[deal] = shard
    return model, parts


def time_rank_deals(rank: int, num_ranks: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Worker: one model over `num_ranks` cp or dp ranks, a step of each deal in turn (after
    the warm-up), each step's seconds between barriers and this rank's thread CPU seconds."""
    document_ids_BS = torch.tensor(spec["document_ids"])
    rows, seq_len = document_ids_BS.shape
    batch = synthetic_batch(rows, seq_len, spec["model"]["vocab_size"], document_ids_BS)
    normaliser = count_label_tokens(batch["labels"])
    model, parts = _deal_steps(rank, num_ranks, spec, batch)

    def step(deal: str) -> tuple[float, float]:
        dist.barrier()
        start, thread_start = time.perf_counter(), time.thread_time()
        local, context = parts[deal]()
        logits_BSV = model(local["tokens"], local["positions"], context)
        token_sum_cross_entropy(logits_BSV, local["labels"], normaliser).backward()
        thread_s = time.thread_time() - thread_start
        dist.barrier()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start, thread_s

    deals = DEALS[spec["kind"]]
    for _ in range(spec["warmup"]):
        for deal in deals:
            step(deal)
    samples: dict[str, list[float]] = {deal: [] for deal in deals}
    compute: dict[str, list[float]] = {deal: [] for deal in deals}
    for _ in range(spec["repeats"]):
        for deal in deals:
            seconds, thread_s = step(deal)
            samples[deal].append(seconds)
            compute[deal].append(thread_s)
    return {"samples": samples, "compute": compute}


def rank_deal_part(
    kind: str,
    document_ids_BS: torch.Tensor,
    model: dict[str, Any],
    *,
    ranks: int,
    pieces: int,
    warmup: int,
    repeats: int,
    pin: bool,
    timeout: float,
    measure: bool,
) -> dict[str, float]:
    """One kind's work table and, with `measure`, its timed deals; their RESULT figures."""
    rows, seq_len = document_ids_BS.shape
    how = f"documents dealt in {pieces} pieces per rank" if kind == "cp" else "rows dealt whole"
    print(f"\n{kind} {ranks} ranks: {rows} rows x {seq_len} tokens; {how}")
    deals = DEALS[kind]
    work = {deal: work_imbalance(document_ids_BS, kind, ranks, deal, pieces) for deal in deals}
    figures = {f"{kind}_work_imbalance_{deal}": work[deal] for deal in deals}
    if not measure:
        print_table(["deal", "work max/mean"], [[deal, work[deal]] for deal in deals])
        return figures
    spec = {
        "kind": kind,
        "model": model,
        "document_ids": document_ids_BS.tolist(),
        "pieces": pieces,
        "warmup": warmup,
        "repeats": repeats,
    }
    results = run_ranks(
        "pipekit.bench._rank_deals:time_rank_deals", ranks, spec,
        env={"GLIBC_TUNABLES": FAIR_ALLOCATOR}, timeout=timeout, cores=rank_core_sets(ranks, pin),
    )  # fmt: skip
    samples = results[0]["samples"]
    imbalance = {}
    for deal in deals:
        per_rank = [statistics.median(result["compute"][deal]) for result in results]
        imbalance[deal] = max_over_mean(per_rank)
    tokens = rows * seq_len
    print_table(
        ["deal", "work max/mean", "median s", "tokens/s", "compute max/mean"],
        [
            [deal, work[deal], statistics.median(samples[deal]),
             tokens / statistics.median(samples[deal]), imbalance[deal]]
            for deal in deals
        ],
    )  # fmt: skip
    figures |= {f"{kind}_time_imbalance_{deal}": imbalance[deal] for deal in deals}
    static, balanced = deals
    ratios = paired_ratios(samples[static], samples[balanced])
    figures[f"{kind}_balanced_vs_static"] = statistics.median(ratios)
    return figures
