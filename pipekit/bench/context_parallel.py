"""`python -m pipekit.bench context-parallel`: bytes per slice of commutated attention against KV
passing, the choice per slice, and both measured on gloo ranks; over a whole sequence, Ulysses
and hierarchical too.

Part 1, formula: for a model shape (default Llama 3 70B: 64 query heads, 8 kv heads, head dim
128) and a sliced sequence on `cp` ranks, the bytes one rank sends per layer for each slice
(`context_parallel_bytes`), which variant "auto" takes, and the totals over the sequence.

Part 2, measured (`--measure-ranks`, default 2; 0 skips it): a small shape on gloo ranks. Each
variant attends slice after slice over a chunked KV cache, forward and backward. The bytes each
rank sent are counted at the collectives, and compared with the formula (forward), beside the
wall time per slice. Timings with as many ranks as cores say little about a GPU; the bytes are
what carry over.

Part 3, multi-head latent attention (default DeepSeek-V3's shape): the same per slice for its
expanded form (every head's K and V) and its latent form (one latent key that is its own value).

Part 4, hierarchical context parallelism (Ulysses inside groups of `--cp-ulysses` ranks, the
cheaper of commutated and K/V passing across the groups, per slice) against "auto" over all cp
ranks.

RESULT: auto_vs_commutated and auto_vs_kv_passing (the formula's total bytes of "auto" over each
fixed variant's), mha_commutated_vs_kv_bytes (the formula's commutated over KV-passing total
with as many kv heads as query heads); whole_auto_vs_best, whole_ulysses_vs_kv_passing and
whole_hierarchical_vs_kv_passing (outside pipelines, over the whole sequence, Ulysses and
hierarchical among the variants: what "auto" takes over the fewest bytes, and each one's bytes
over KV passing's); hierarchical_vs_flat_auto (part 4: inside a pipeline, hierarchical with the
cheaper variant across per slice, over "auto" on all cp ranks) and hierarchical_chosen_vs_best
(1 when the per-slice choice across never loses); measured: commutated_vs_kv_bytes (total
forward bytes over the sequence, commutated over KV passing) beside `formula` (the same ratio
predicted); mla_auto_vs_expanded_auto (the latent form's bytes under "auto" over the expanded
form's), mla_kv_passing_vs_expanded (K/V passing, latent over expanded), mla_chosen_vs_best (the
latent form's "auto" over the fewest bytes per slice: 1 when the rule never loses); measured:
chosen_vs_best (the measured bytes of the variant the rule chose per slice over the
cheaper one's: 1 when the rule always picks the cheaper), measured_vs_formula (the largest
|measured - formula| / formula of any slice's forward bytes).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from pipekit.bench._pipeline_launch import run_ranks
from pipekit.bench.report import machine_description, print_result, print_table

__all__ = ["main"]

_MIB = 2**20


def _formula_rows(
    options: argparse.Namespace,
) -> tuple[list[list[Any]], dict[str, float], float]:
    """Per slice rows, the totals of each variant and of "auto", and the commutated over
    KV-passing total with as many kv heads as query heads (MHA)."""

    shape = {
        "slice_tokens": options.slice_tokens,
        "cp": options.cp,
        "q_heads": options.heads,
        "kv_heads": options.kv_heads,
        "head_dim": options.head_dim,
        "element_bytes": 2,
    }
    mha = dict(shape, kv_heads=options.heads)
    mha_totals = _slice_bytes(mha, options.slices)[1]
    mha_ratio = mha_totals["commutated"] / mha_totals["kv_passing"]
    rows, totals = _slice_bytes(shape, options.slices)
    return rows, totals, mha_ratio


def _slice_bytes(shape: dict[str, Any], slices: int) -> tuple[list[list[Any]], dict[str, float]]:
    """Per slice of a sequence: the bytes of commutated and KV passing (`shape`:
    `context_parallel_bytes`' keywords), what "auto" takes; and the totals of each and of
    "auto"."""
    from pipekit.attention.across import (
        choose_context_parallel,
        context_parallel_bytes,
    )

    rows, totals = [], {"commutated": 0.0, "kv_passing": 0.0, "auto": 0.0}
    for index in range(slices):
        sent = {
            v: context_parallel_bytes(v, slice_index=index, **shape) for v in totals if v != "auto"
        }
        choice = choose_context_parallel(slice_index=index, **shape)
        for variant, size in sent.items():  # the two fixed variants
            totals[variant] += size
        totals["auto"] += sent[choice]
        rows.append([index, sent["commutated"] / _MIB, sent["kv_passing"] / _MIB, choice])
    return rows, totals


def _latent_attention_bytes(options: argparse.Namespace) -> dict[str, float]:
    """Part 3: per slice, the bytes of multi-head latent attention's two forms (expanded: every
    head's key and value, padded to the key's dims; latent: one key of latent + RoPE dims that
    is its own value, queries absorbed to those dims), each variant and auto's pick; RESULT
    figures."""
    heads, key_dim = options.mla_heads, options.mla_nope + options.mla_rope
    latent_dim = options.mla_latent + options.mla_rope
    common = {"slice_tokens": options.slice_tokens, "cp": options.cp, "element_bytes": 2}
    forms = {
        "expanded": common
        | {"q_heads": heads, "kv_heads": heads, "head_dim": max(key_dim, options.mla_v)},
        "latent": common
        | {"q_heads": heads, "kv_heads": 1, "head_dim": latent_dim, "keys_are_values": True},
    }
    print(
        f"\nmulti-head latent attention ({heads} heads, key {key_dim}, value {options.mla_v}, "
        f"latent {options.mla_latent} + RoPE {options.mla_rope}), cp {options.cp}, "
        f"{options.slices} slices of {options.slice_tokens} tokens; MiB one rank sends per "
        "layer (forward)"
    )
    per_form = {form: _slice_bytes(shape, options.slices) for form, shape in forms.items()}
    rows = [
        [index, *expanded[1:], *latent[1:]]
        for index, (expanded, latent) in enumerate(
            zip(per_form["expanded"][0], per_form["latent"][0], strict=True)
        )
    ]
    print_table(
        [
            "slice",
            "expanded commutated",
            "expanded kv passing",
            "auto takes",
            "latent commutated",
            "latent kv passing",
            "auto takes",
        ],
        rows,
    )
    expanded, latent = per_form["expanded"][1], per_form["latent"][1]
    best_latent = sum(min(row[4], row[5]) for row in rows) * _MIB
    return {
        "mla_auto_vs_expanded_auto": latent["auto"] / expanded["auto"],
        "mla_kv_passing_vs_expanded": latent["kv_passing"] / expanded["kv_passing"],
        "mla_chosen_vs_best": latent["auto"] / best_latent,
    }


def _whole_sequence_bytes(options: argparse.Namespace) -> tuple[dict[str, float], str]:
    """Outside pipelines (one slice: the whole sequence), each variant's bytes by the formula
    (Ulysses among them when the heads split over the ranks, hierarchical when they split over
    a group of `--cp-ulysses`) and what "auto" takes (the trainer's rule)."""
    from pipekit.attention.across import (
        auto_candidates,
        context_parallel_bytes,
        context_parallel_variant,
    )

    tokens = options.slice_tokens * options.slices
    shape = {
        "slice_index": 0, "slice_tokens": tokens, "cp": options.cp, "q_heads": options.heads,
        "kv_heads": options.kv_heads, "head_dim": options.head_dim, "element_bytes": 2,
        "ulysses_size": options.cp_ulysses,
    }  # fmt: skip
    q_BHSD = torch.empty(1, options.heads, 0, options.head_dim, dtype=torch.bfloat16)
    k_BGSD = torch.empty(1, options.kv_heads, 0, options.head_dim, dtype=torch.bfloat16)
    choice = context_parallel_variant(
        "auto", q_BHSD, k_BGSD, slice_index=0, slice_tokens=tokens, cp=options.cp,
        whole_sequence=True, ulysses_size=options.cp_ulysses,
    )  # fmt: skip
    variants = auto_candidates(
        options.heads, options.kv_heads, options.cp, options.cp_ulysses, whole_sequence=True
    )
    sizes = {variant: context_parallel_bytes(variant, **shape) for variant in variants}
    return sizes, choice


def _hierarchical_slices(options: argparse.Namespace) -> dict[str, float]:
    """Part 4, inside a sliced pipeline: per slice, hierarchical context parallelism's bytes
    (Ulysses in groups of `--cp-ulysses`, the cheaper of commutated and K/V passing across),
    against "auto" over all cp ranks; RESULT figures of the totals over the sequence."""
    from pipekit.attention.across.variants.hierarchical import hierarchical_bytes

    if not 1 < options.cp_ulysses < options.cp:
        return {}
    shape = {
        "slice_tokens": options.slice_tokens, "cp": options.cp, "q_heads": options.heads,
        "kv_heads": options.kv_heads, "head_dim": options.head_dim, "element_bytes": 2,
    }  # fmt: skip
    flat_rows, flat = _slice_bytes(shape, options.slices)
    rows, totals = [], {"commutated": 0.0, "kv_passing": 0.0, "auto": 0.0}
    for index, flat_row in enumerate(flat_rows):
        sent = {
            across: hierarchical_bytes(
                across, slice_index=index, ulysses_size=options.cp_ulysses, **shape
            )
            for across in totals
        }
        for across, size in sent.items():
            totals[across] += size
        rows.append([index, *(sent[v] / _MIB for v in totals), flat_row[-1]])
    print(
        f"part 4, hierarchical: Ulysses in groups of {options.cp_ulysses}, cp / "
        f"{options.cp_ulysses} groups across (MiB one rank sends per layer and slice)"
    )
    print_table(
        ["slice", "across commutated", "across kv passing", "across auto", "flat auto"], rows
    )
    print(
        f"totals (MiB): hierarchical {totals['auto'] / _MIB:.1f}, flat auto "
        f"{flat['auto'] / _MIB:.1f}"
    )
    best = sum(min(row[1], row[2]) for row in rows) * _MIB
    return {
        "hierarchical_vs_flat_auto": totals["auto"] / flat["auto"],
        "hierarchical_chosen_vs_best": totals["auto"] / best,
    }


def _measure_worker(rank: int, num_ranks: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Each variant over the slices of one sequence: bytes sent (forward, backward) and time."""
    import pipekit.attention.across.token_shards as cp_module
    from pipekit.attention.across.token_shards import (
        CachedShard,
        TokenShard,
        commutated_context_attention,
        kv_passing_context_attention,
        load_balanced_indices,
    )

    sent = [0]
    gather, exchange = cp_module._all_gather, cp_module._exchange

    def counted_gather(tensor, group):
        sent[0] += tensor.nbytes * (num_ranks - 1)  # one copy to every peer
        return gather(tensor, group)

    def counted_exchange(parts, group):
        sent[0] += sum(part.nbytes for index, part in enumerate(parts) if index != rank)
        return exchange(parts, group)

    cp_module._all_gather, cp_module._exchange = counted_gather, counted_exchange
    heads, kv_heads, head_dim = spec["heads"], spec["kv_heads"], spec["head_dim"]
    slice_tokens, slices = spec["slice_tokens"], spec["slices"]
    local = slice_tokens // num_ranks
    generator = torch.Generator().manual_seed(rank)
    results: dict[str, Any] = {}
    for name, attend in (
        ("commutated", commutated_context_attention),
        ("kv_passing", kv_passing_context_attention),
    ):
        cache: list[CachedShard] = []
        forward_bytes, backward_bytes, seconds = [], [], []
        for index in range(slices):
            tokens = load_balanced_indices(slice_tokens, num_ranks, start=index * slice_tokens)
            shard = TokenShard(tokens[rank])

            def draw(count: int) -> torch.Tensor:
                size = (1, count, local, head_dim)
                return torch.randn(size, generator=generator, dtype=torch.bfloat16)

            q = draw(heads).requires_grad_()
            k, v = draw(kv_heads).requires_grad_(), draw(kv_heads).requires_grad_()
            cache.append(CachedShard(k, v, shard))
            torch.distributed.barrier()
            start, sent[0] = time.perf_counter(), 0
            out, _ = attend(q, shard, cache, backend="cpu")
            forward_bytes.append(sent[0])
            sent[0] = 0
            out.float().sum().backward()
            backward_bytes.append(sent[0])
            seconds.append(time.perf_counter() - start)
        results[name] = {"forward": forward_bytes, "backward": backward_bytes, "s": seconds}
    return results


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pipekit.bench context-parallel", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--heads", type=int, default=64, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=8, help="key/value heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--cp", type=int, default=4, help="context-parallel ranks (formula)")
    parser.add_argument("--slices", type=int, default=16, help="slices per sequence")
    parser.add_argument("--slice-tokens", type=int, default=8192, help="tokens per slice")
    parser.add_argument(
        "--seq", type=int, default=0, help="tokens per sequence (sets --slice-tokens to seq/slices)"
    )
    parser.add_argument(
        "--cp-ulysses", type=int, default=2, help="ranks per Ulysses group, hierarchical (part 4)"
    )
    parser.add_argument("--mla-heads", type=int, default=128, help="MLA query heads (part 3)")
    parser.add_argument("--mla-latent", type=int, default=512, help="MLA kv_lora_rank")
    parser.add_argument("--mla-rope", type=int, default=64, help="MLA qk_rope_head_dim")
    parser.add_argument("--mla-nope", type=int, default=128, help="MLA qk_nope_head_dim")
    parser.add_argument("--mla-v", type=int, default=128, help="MLA v_head_dim")
    parser.add_argument("--measure-ranks", type=int, default=2, help="gloo ranks (0: skip)")
    parser.add_argument("--measure-heads", type=int, default=16)
    parser.add_argument("--measure-kv-heads", type=int, default=2)
    parser.add_argument("--measure-slice-tokens", type=int, default=256)
    parser.add_argument("--measure-slices", type=int, default=12)
    options = parser.parse_args(argv)
    if options.seq:
        if options.seq % options.slices:
            parser.error(f"--seq {options.seq} must be a multiple of --slices {options.slices}")
        options.slice_tokens = options.seq // options.slices
    print(machine_description(), flush=True)
    print(
        f"formula: {options.heads} query heads, {options.kv_heads} kv heads, head dim "
        f"{options.head_dim}, bf16, cp {options.cp}, {options.slices} slices of "
        f"{options.slice_tokens} tokens; MiB one rank sends per layer (forward)"
    )
    rows, totals, mha_ratio = _formula_rows(options)
    print_table(["slice", "commutated MiB", "kv passing MiB", "auto takes"], rows)
    print(
        "totals over the sequence (MiB): "
        + ", ".join(f"{name} {size / _MIB:.1f}" for name, size in totals.items())
        + f"; with {options.heads} kv heads (MHA), commutated / kv passing = {mha_ratio:.3f}"
    )
    whole, whole_choice = _whole_sequence_bytes(options)
    print(
        f"whole sequence of {options.slice_tokens * options.slices} tokens outside pipelines "
        "(MiB one rank sends per layer): "
        + ", ".join(f"{name} {size / _MIB:.1f}" for name, size in whole.items())
        + f"; auto takes {whole_choice}"
    )
    figures: dict[str, Any] = {
        "auto_vs_commutated": totals["auto"] / totals["commutated"],
        "auto_vs_kv_passing": totals["auto"] / totals["kv_passing"],
        "mha_commutated_vs_kv_bytes": mha_ratio,
        "whole_auto_vs_best": whole[whole_choice] / min(whole.values()),
        **_latent_attention_bytes(options),
        **_hierarchical_slices(options),
    }
    for variant, size in whole.items():
        if variant not in ("kv_passing", "commutated"):  # the two every table row compares
            figures[f"whole_{variant}_vs_kv_passing"] = size / whole["kv_passing"]
    if options.measure_ranks > 1:
        figures.update(_measure(options))
    print_result(**figures)


def _measure(options: argparse.Namespace) -> dict[str, float]:
    from pipekit.attention.across import (
        choose_context_parallel,
        context_parallel_bytes,
    )

    ranks = options.measure_ranks
    spec = {
        "heads": options.measure_heads,
        "kv_heads": options.measure_kv_heads,
        "head_dim": options.head_dim,
        "slice_tokens": options.measure_slice_tokens,
        "slices": options.measure_slices,
    }
    print(
        f"\nmeasured: {ranks} gloo ranks, {spec['heads']} query heads, {spec['kv_heads']} kv "
        f"heads, head dim {spec['head_dim']}, bf16, {spec['slices']} slices of "
        f"{spec['slice_tokens']} tokens; rank 0's bytes sent (KiB) and time per slice"
    )
    result = run_ranks("pipekit.bench.context_parallel:_measure_worker", ranks, spec)[0]
    shape = {
        "slice_tokens": spec["slice_tokens"],
        "cp": ranks,
        "q_heads": spec["heads"],
        "kv_heads": spec["kv_heads"],
        "head_dim": spec["head_dim"],
        "element_bytes": 2,
    }
    rows, worst = [], 0.0
    measured_total = {"commutated": 0, "kv_passing": 0, "chosen": 0, "best": 0}
    formula_total = {"commutated": 0, "kv_passing": 0}
    for index in range(spec["slices"]):
        row: list[Any] = [index]
        sent = {v: result[v]["forward"][index] for v in ("commutated", "kv_passing")}
        measured_total["chosen"] += sent[choose_context_parallel(slice_index=index, **shape)]
        measured_total["best"] += min(sent.values())
        for variant in ("commutated", "kv_passing"):
            measured = sent[variant]
            formula = context_parallel_bytes(variant, slice_index=index, **shape)
            measured_total[variant] += measured
            formula_total[variant] += formula
            worst = max(worst, abs(measured - formula) / formula)
            row += [
                measured / 1024,
                formula / 1024,
                result[variant]["backward"][index] / 1024,
                result[variant]["s"][index] * 1e3,
            ]
        rows.append(row)
    headers = ["slice"]
    for variant in ("commutated", "kv"):
        headers += [f"{variant} fwd KiB", "formula KiB", "bwd KiB", "ms"]
    print_table(headers, rows)
    return {
        "commutated_vs_kv_bytes": measured_total["commutated"] / measured_total["kv_passing"],
        "formula": formula_total["commutated"] / formula_total["kv_passing"],
        "chosen_vs_best": measured_total["chosen"] / measured_total["best"],
        "measured_vs_formula": worst,
    }
