"""The context-parallel part of `packed-documents`: cp ranks holding head and tail of every row
(`cp_balance = "sequence"`) against each batch's pieces dealt by their attention work within
documents (`cp_balance = "documents"`), on the same packed batch.

The work table gives each deal's per-rank causal attention work (the keys its queries see in
their own documents, over every row of the batch) over the mean rank's. The ranks (gloo, one
thread each, the fair allocator) then train the same model under both deals alternately, whole
sequences by the `auto` variant; a rank's compute per step is its main thread's CPU seconds
(gloo moves bytes on threads of its own and a rank waiting for its peer sleeps), and the
measured imbalance is the slowest rank's over the mean. `cp_documents_vs_sequence` is the
median per-round ratio of the two deals' step times.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from pipekit.attention.across.token_shards import context_parallel_tokens
from pipekit.attention.work import keys_seen
from pipekit.bench._pipeline_launch import bench_model, rank_core_sets, run_ranks, synthetic_batch
from pipekit.bench._schedule_timing import FAIR_ALLOCATOR
from pipekit.bench.report import paired_ratios, print_table
from pipekit.config.job_config import ParallelismConfig
from pipekit.distributed.context_parallel import context_parallel_ranks
from pipekit.layers.loss import count_label_tokens, token_sum_cross_entropy
from pipekit.testing.data_parallel import data_parallel_model

__all__ = ["CP_DEALS", "context_parallel_part", "time_cp_deals"]

CP_DEALS = ("sequence", "documents")
"""The compared `cp_balance` settings."""


def work_imbalance(document_ids_BS: torch.Tensor, cp: int, balance: str, pieces: int) -> float:
    """The slowest cp rank's causal attention work over the mean rank's, under one deal."""
    documents = document_ids_BS if balance == "documents" else None
    table_CS = context_parallel_tokens(document_ids_BS.shape[1], cp, 1, documents, pieces)
    work_S = keys_seen(document_ids_BS).sum(dim=0).double()
    per_rank = [float(work_S[tokens].sum()) for tokens in table_CS]
    return max(per_rank) * cp / sum(per_rank)


def time_cp_deals(rank: int, num_ranks: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Worker: one model over `num_ranks` cp ranks, a step of each deal in turn (after the
    warm-up), each step's seconds between barriers and this rank's thread CPU seconds."""
    family, args = bench_model(spec["model"])
    model, _, mesh = data_parallel_model(num_ranks, family, args, cp=num_ranks, dtype=torch.float32)
    document_ids_BS = torch.tensor(spec["document_ids"])
    rows, seq_len = document_ids_BS.shape
    batch = synthetic_batch(rows, seq_len, args.vocab_size, document_ids_BS)
    normaliser = count_label_tokens(batch["labels"])
    deals = {
        balance: context_parallel_ranks(
            mesh,
            ParallelismConfig(cp=num_ranks, cp_balance=balance, cp_balance_pieces=spec["pieces"]),
            seq_len,
        )
        for balance in CP_DEALS
    }

    def step(balance: str) -> tuple[float, float]:
        ranks = deals[balance]
        dist.barrier()
        start, thread_start = time.perf_counter(), time.thread_time()
        shard = ranks.shard(batch)
        logits_BSV = model(shard["tokens"], shard["positions"], ranks.attention(shard, "cpu"))
        token_sum_cross_entropy(logits_BSV, shard["labels"], normaliser).backward()
        thread_s = time.thread_time() - thread_start
        dist.barrier()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start, thread_s

    for _ in range(spec["warmup"]):
        for balance in CP_DEALS:
            step(balance)
    samples: dict[str, list[float]] = {balance: [] for balance in CP_DEALS}
    compute: dict[str, list[float]] = {balance: [] for balance in CP_DEALS}
    for _ in range(spec["repeats"]):
        for balance in CP_DEALS:
            seconds, thread_s = step(balance)
            samples[balance].append(seconds)
            compute[balance].append(thread_s)
    return {"samples": samples, "compute": compute}


def context_parallel_part(
    document_ids_BS: torch.Tensor,
    model: dict[str, Any],
    *,
    cp: int,
    pieces: int,
    warmup: int,
    repeats: int,
    pin: bool,
    timeout: float,
    measure: bool,
) -> dict[str, float]:
    """The work table and, with `measure`, the timed deals; their RESULT figures."""
    rows, seq_len = document_ids_BS.shape
    print(
        f"\ncontext parallel: {rows} rows x {seq_len} tokens over cp {cp} ranks, whole "
        f"sequences; documents dealt in {pieces} pieces per rank"
    )
    work = {balance: work_imbalance(document_ids_BS, cp, balance, pieces) for balance in CP_DEALS}
    figures = {f"cp_work_imbalance_{balance}": work[balance] for balance in CP_DEALS}
    if not measure:
        print_table(["cp_balance", "work max/mean"], [[b, work[b]] for b in CP_DEALS])
        return figures
    spec = {
        "model": model,
        "document_ids": document_ids_BS.tolist(),
        "pieces": pieces,
        "warmup": warmup,
        "repeats": repeats,
    }
    ranks = run_ranks(
        "pipekit.bench._document_cp:time_cp_deals", cp, spec,
        env={"GLIBC_TUNABLES": FAIR_ALLOCATOR}, timeout=timeout, cores=rank_core_sets(cp, pin),
    )  # fmt: skip
    samples = ranks[0]["samples"]
    imbalance = {}
    for balance in CP_DEALS:
        per_rank = [statistics.median(rank["compute"][balance]) for rank in ranks]
        imbalance[balance] = max(per_rank) * cp / sum(per_rank)
    tokens = rows * seq_len
    print_table(
        ["cp_balance", "work max/mean", "median s", "tokens/s", "compute max/mean"],
        [
            [balance, work[balance], statistics.median(samples[balance]),
             tokens / statistics.median(samples[balance]), imbalance[balance]]
            for balance in CP_DEALS
        ],
    )  # fmt: skip
    figures |= {f"cp_time_imbalance_{balance}": imbalance[balance] for balance in CP_DEALS}
    ratios = paired_ratios(samples["sequence"], samples["documents"])
    figures["cp_documents_vs_sequence"] = statistics.median(ratios)
    return figures
