"""Shared cases of the context-parallel attention tests: one full sequence (q, k, v, an upstream
gradient, packed documents, attention sinks), its single-process attention and gradients (with
a window, or ALiBi's score bias), and the whole-sequence run of the trainer's context by a
variant, compared in float64."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from attention_reference import alibi_bias, reference_attention

from pipekit.attention import ALIBI, alibi_slopes
from pipekit.attention.across.hierarchical import HierarchicalGroups
from pipekit.attention.across.token_shards import (
    document_balanced_indices,
    load_balanced_indices,
)
from pipekit.attention.context import ContextParallelAttention
from pipekit.attention.patterns import AttentionPattern
from pipekit.attention.work import keys_seen

BATCH, HEADS, KV_HEADS, LENGTH, HEAD_DIM = 2, 4, 2, 32, 8
SLICES = 4
TOLERANCE = 1e-12
WINDOW = AttentionPattern(window=6)
"""A sliding window shorter than a slice: later slices see only the end of the one before."""
ALIBI_PATTERN = AttentionPattern(
    score_bias=ALIBI, bias_H=torch.tensor(alibi_slopes(HEADS), dtype=torch.float64)
)
"""Causal, each head's scores biased by its ALiBi slope times the tokens' distance."""
PATTERNS = {"window": WINDOW, "alibi": ALIBI_PATTERN}


def case_pattern(case: str) -> AttentionPattern | None:
    """The pattern a case's name mentions (None: causal)."""
    return next((pattern for name, pattern in PATTERNS.items() if name in case), None)


def case_inputs() -> dict[str, torch.Tensor]:
    """The same full sequence on every rank: q, k, v, the upstream gradient and two packed
    documents per row (split at a row-dependent point)."""
    generator = torch.Generator().manual_seed(5)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=torch.float64, generator=generator)

    split_B1 = torch.tensor([[11], [20]])
    return {
        "q": draw(BATCH, HEADS, LENGTH, HEAD_DIM),
        "k": draw(BATCH, KV_HEADS, LENGTH, HEAD_DIM),
        "v": draw(BATCH, KV_HEADS, LENGTH, HEAD_DIM),
        "upstream": draw(BATCH, HEADS, LENGTH, HEAD_DIM),
        "documents": (torch.arange(LENGTH) >= split_B1).long(),
        "sinks": draw(HEADS),
    }


def case_reference(
    inputs: dict[str, torch.Tensor], pattern: AttentionPattern | None = None, sinks: bool = False
) -> dict[str, torch.Tensor]:
    """One process: causal (or `pattern`'s: a window, a score bias) attention within documents
    (with the attention sinks if `sinks`), its output and gradients."""
    q, k, v, sinks_H = (inputs[name].clone().requires_grad_() for name in ("q", "k", "v", "sinks"))
    tokens = torch.arange(LENGTH)
    documents = inputs["documents"]
    window = pattern.window if pattern and pattern.window else LENGTH
    allowed_SK = (tokens[:, None] >= tokens[None, :]) & (tokens[:, None] - tokens[None, :] < window)
    allowed_BSK = allowed_SK & (documents[:, :, None] == documents[:, None, :])
    allowed = allowed_BSK[:, None].expand(BATCH, HEADS, LENGTH, LENGTH)
    bias = None
    if pattern is not None and pattern.score_bias == ALIBI:
        bias = alibi_bias(pattern.bias_H, tokens, tokens)
    out, _ = reference_attention(q, k, v, allowed, HEAD_DIM**-0.5, sinks_H if sinks else None, bias)
    (out * inputs["upstream"]).sum().backward()
    grads = {"out": out.detach(), "q": q.grad, "k": k.grad, "v": v.grad}
    return grads | ({"sinks": sinks_H.grad} if sinks else {})


def case_leaves(
    inputs: dict[str, torch.Tensor], shared: bool = False, sinks: bool = False
) -> dict[str, torch.Tensor]:
    """q, k, v (and the sinks) as leaves; `shared`: the keys are also the values (one leaf, as
    multi-head latent attention's latent form hands them over)."""
    names = ("q", "k", "v", "sinks") if sinks else ("q", "k", "v")
    leaves = {name: inputs[name].clone().requires_grad_() for name in names}
    if shared:
        leaves["v"] = leaves["k"]
    return leaves


def summed_grads(leaves: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each rank's gradients cover its own tokens; their sum is the whole sequence's."""
    grads = {}
    for name, leaf in leaves.items():
        grad = leaf.grad.clone()
        dist.all_reduce(grad)
        grads[name] = grad
    return grads


def case_sinks(leaves: dict[str, torch.Tensor], ablate: bool) -> torch.Tensor | None:
    """The attention sinks of a run that has them; the ablation counts them twice (2 e^s =
    e^(s + ln 2)), as a merge that added them per partial would."""
    if "sinks" not in leaves:
        return None
    return leaves["sinks"] + math.log(2) if ablate else leaves["sinks"]


DEAL_PIECES = 4
"""Pieces per rank of the document deal: finer than head and tail, so the deal differs."""


def document_deal(world: int) -> torch.Tensor:
    """`[world, LENGTH / world]`: the ranks' tokens dealt by the case's documents' work."""
    work_S = keys_seen(case_inputs()["documents"]).sum(dim=0)
    return document_balanced_indices(work_S, world, DEAL_PIECES)


def whole_sequence_run(
    variant: str,
    pattern: AttentionPattern | None = None,
    shared: bool = False,
    sinks: bool = False,
    hierarchy: Callable[[bool], HierarchicalGroups] | None = None,
    documents_dealt: bool = False,
) -> Callable[[int, int, bool], dict[str, torch.Tensor]]:
    """The trainer's context outside pipelines, by `variant`, over the unsliced sequence; the
    ablation masks each rank's tokens as if they were the first of the sequence (with a
    `pattern`: ignores the pattern). `hierarchy(ablate)`: the groups of hierarchical context
    parallelism (its ablation's own). `documents_dealt`: each rank holds its tokens of the
    document deal (`document_deal`); its ablation tells the attention head and tail instead."""

    def run(rank: int, world: int, ablate: bool) -> dict[str, torch.Tensor]:
        inputs = case_inputs()
        leaves = case_leaves(inputs, shared, sinks)
        sinks_H, ablate = case_sinks(leaves, ablate), ablate and not sinks
        tokens = load_balanced_indices(LENGTH, world)[rank]
        masked_tokens = tokens
        if documents_dealt:
            tokens = document_deal(world)[rank]
            masked_tokens = masked_tokens if ablate else tokens
        elif ablate and pattern is None and hierarchy is None:
            masked_tokens = torch.arange(len(tokens))
        groups = None if hierarchy is None else hierarchy(ablate and not documents_dealt)
        context = ContextParallelAttention(
            masked_tokens, inputs["documents"][:, tokens], None, "cpu", variant, groups
        )
        local = {name: leaves[name][:, :, tokens] for name in "qk"}
        local["v"] = local["k"] if shared else leaves["v"][:, :, tokens]
        seen = None if ablate and hierarchy is None and not documents_dealt else pattern
        out = context.attend(
            "0", local["q"], local["k"], local["v"], HEAD_DIM**-0.5, seen, sinks_H=sinks_H
        )
        (out * inputs["upstream"][:, :, tokens]).sum().backward()
        full_out = torch.zeros_like(inputs["q"])
        full_out[:, :, tokens] = out.detach()
        dist.all_reduce(full_out)
        return {"out": full_out, **summed_grads(leaves)}

    return run


def worst_difference(
    results: list[dict[str, torch.Tensor]],
    pattern: AttentionPattern | None = None,
    shared: bool = False,
    sinks: bool = False,
) -> float:
    reference = case_reference(case_inputs(), pattern, sinks)
    if shared:  # the one leaf collects the keys' and the values' gradients
        inputs = case_inputs()
        inputs["v"] = inputs["k"]
        reference = case_reference(inputs, pattern)
        reference["k"] = reference["k"] + reference.pop("v")
    worst = 0.0
    for result in results:
        for name, want in reference.items():
            scale = want.abs().max()
            worst = max(worst, ((result[name] - want).abs().max() / scale).item())
    return worst
