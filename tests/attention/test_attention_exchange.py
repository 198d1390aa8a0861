"""Attention over chunks lent to another rank equals attention over all chunks on one rank
(float64, gloo): output, lse and the gradients of the query and of every chunk, with packed
documents, grouped-query heads and a backward served by a different rank than the forward. The
ablation drops the lent chunks' dK/dV on the server and must fail. A `LoanServer` answers its
requests beside its pass, with the same results; the ablation makes the pass wait for them
before it lets the lender start, which must hang. Two consecutive serving passes of one peer
answer in turn through a `ServingChain`; without it their threads take each other's requests."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from attention_reference import dense_allowed, reference_attention

from pipekit.attention.across.lending import (
    AttentionLoan,
    Lending,
    LentChunk,
    attention_with_lending,
    serve_attention_loan,
    serve_attention_loan_backward,
)
from pipekit.attention.across.loan_server import LoanRequest, LoanServer, ServingChain
from pipekit.attention.chunked import KVChunk, attention_over_chunks
from pipekit.attention.kernels.backends import AutogradRingBackend
from pipekit.attention.kernels.cpu_flash import CpuFlashBackend
from pipekit.attention.masks import causal_within_documents, documents_or_all
from pipekit.testing import RankFailedError, run_on_ranks

B, H, G, S, D = 2, 4, 2, 8, 16  # S: keys and queries per slice


def _inputs() -> dict[str, torch.Tensor]:
    """Slice 3 of a sequence: its query, three earlier KV slices and its own, two documents."""
    generator = torch.Generator().manual_seed(0)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    docs_BT = (torch.arange(4 * S) >= 13 + torch.arange(B).unsqueeze(1)).long()  # [B, 4 slices]
    return {
        "q": draw(B, H, S, D),
        "k": draw(4, B, G, S, D),
        "v": draw(4, B, G, S, D),
        "grad_out": draw(B, H, S, D),
        "docs": docs_BT,
    }


def _chunks(inputs, k, v) -> tuple[list[KVChunk], list[LentChunk], torch.Tensor]:
    docs = inputs["docs"]
    q_docs = docs[:, 3 * S :]
    own = KVChunk(k[3], v[3], causal_within_documents(q_docs))
    earlier = [LentChunk(k[i], v[i], docs[:, i * S : (i + 1) * S]) for i in range(3)]
    return [own], earlier, q_docs


def _reference(inputs) -> dict[str, torch.Tensor]:
    q, k, v = (inputs[name].clone().requires_grad_() for name in ("q", "k", "v"))
    own, earlier, q_docs = _chunks(inputs, k, v)
    chunks = own + [
        KVChunk(c.k_BGKD, c.v_BGKD, documents_or_all(q_docs, c.document_ids_BK)) for c in earlier
    ]
    out, lse = attention_over_chunks(q, chunks, backend="cpu")
    out.backward(inputs["grad_out"])
    return {"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _lend(rank: int, world: int, drop_lent_grads: bool) -> dict[str, torch.Tensor] | None:
    """Rank 0 keeps its own slice and slice 2 and lends slices 0 and 1: in forward slice 0 to
    rank 1 and slice 1 to the last rank, in backward both to the last rank."""
    inputs = _inputs()
    last = world - 1
    if rank > 0:
        for _ in range((rank == 1) + (rank == last)):  # the forward parts sent to this rank
            serve_attention_loan(AttentionLoan(0), backend="cpu")
        if rank == last:
            _serve_backward(drop_lent_grads)
        dist.barrier()
        return None
    q, k, v = (inputs[name].clone().requires_grad_() for name in ("q", "k", "v"))
    own, earlier, q_docs = _chunks(inputs, k, v)
    forward = Lending(((AttentionLoan(1), (0,)), (AttentionLoan(last), (1,))))
    out, lse = attention_with_lending(
        q,
        own,
        earlier,
        forward,
        Lending(((AttentionLoan(last), (0, 1)),)),
        q_document_ids_BS=q_docs,
        backend="cpu",
    )
    out.backward(inputs["grad_out"])
    dist.barrier()
    return {"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _serve_backward(drop_lent_grads: bool) -> None:
    if not drop_lent_grads:
        serve_attention_loan_backward(AttentionLoan(0), backend="cpu")
        return
    backward_chunk = CpuFlashBackend.backward_chunk

    def zero_kv(self, *args, **kwargs):
        dq, dk, dv = backward_chunk(self, *args, **kwargs)
        return dq, dk * 0, dv * 0

    with mock.patch.object(CpuFlashBackend, "backward_chunk", zero_kv):
        serve_attention_loan_backward(AttentionLoan(0), backend="cpu")


def _max_difference(world: int, drop_lent_grads: bool = False) -> float:
    lent = run_on_ranks(_lend, world, drop_lent_grads)[0]
    reference = _reference(_inputs())
    return max((lent[name] - reference[name]).abs().max().item() for name in reference)


@pytest.mark.parametrize("world", [2, 3])
def test_lent_attention_equals_local_attention(world: int) -> None:
    assert _max_difference(world) < 1e-12


def test_dropping_the_lent_chunks_gradients_breaks_it() -> None:
    assert _max_difference(2, drop_lent_grads=True) > 1e-2


def _serve_a_late_lender(rank: int, world: int, wait_inside_the_pass: bool) -> dict:
    """Rank 1 serves two forward requests and one backward request of rank 0, which starts
    lending only once rank 1's pass, having started serving, tells it to. The ablation's server
    gives up after 2 s; the working one waits as long as a loaded machine may need."""
    inputs = _inputs()
    if rank == 1:
        patience = timedelta(seconds=2 if wait_inside_the_pass else 60)
        loan = lambda peer: AttentionLoan(peer, timeout=patience)
        server = LoanServer([LoanRequest(0, False)] * 2 + [LoanRequest(0, True)], loan, "cpu")
        started = time.perf_counter()
        server.start()
        if wait_inside_the_pass:  # the ablation: the pass waits for its answers first
            server.finish()
        dist.send(torch.ones(1), dst=0)  # the pass goes on; the lender starts now
        server.finish()
        served_s = time.perf_counter() - started
        dist.barrier()
        return {"answered": server.answered, "cpu_s": server.cpu_s, "served_s": served_s}
    dist.recv(torch.empty(1), src=1)
    q, k, v = (inputs[name].clone().requires_grad_() for name in ("q", "k", "v"))
    own, earlier, q_docs = _chunks(inputs, k, v)
    lend_all = Lending(((AttentionLoan(1), (0, 1, 2)),))
    results: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name in ("out0", "out1"):
            results[name] = attention_with_lending(
                q, own, earlier, lend_all, q_document_ids_BS=q_docs, backend="cpu"
            )[0]
    out, _ = attention_with_lending(
        q, own, earlier, Lending(), lend_all, q_document_ids_BS=q_docs, backend="cpu"
    )
    out.backward(inputs["grad_out"])
    dist.barrier()
    return {**results, "dq": q.grad, "dk": k.grad, "dv": v.grad}


def test_a_loan_server_answers_beside_its_pass() -> None:
    lender, server = run_on_ranks(_serve_a_late_lender, 2, False)
    assert server["answered"] == 3
    assert 0 < server["cpu_s"] <= server["served_s"]  # one thread's CPU time, within its time
    reference = _reference(_inputs())
    expected = {"out0": "out", "out1": "out", "dq": "dq", "dk": "dk", "dv": "dv"}
    for name, reference_name in expected.items():
        assert (lender[name] - reference[reference_name]).abs().max().item() < 1e-12, name


def test_a_server_that_waits_inside_its_pass_hangs_on_a_late_lender() -> None:
    with pytest.raises(RankFailedError, match="rank 1 of the exchange group waited more than 2 s"):
        run_on_ranks(_serve_a_late_lender, 2, True, timeout=60)


def test_a_lent_chunk_without_document_ids_needs_a_query_without_them() -> None:
    q = torch.zeros(B, H, S, D)
    chunk = LentChunk(torch.zeros(B, G, S, D), torch.zeros(B, G, S, D))
    with pytest.raises(ValueError, match="document ids"):
        attention_with_lending(
            q, [], [chunk], Lending(), q_document_ids_BS=torch.zeros(B, S).long()
        )


def test_lending_parts_must_be_disjoint_indices() -> None:
    q = torch.zeros(B, H, S, D)
    chunk = LentChunk(torch.zeros(B, G, S, D), torch.zeros(B, G, S, D))
    twice = Lending(((AttentionLoan(1), (0,)), (AttentionLoan(2), (0,))))
    with pytest.raises(ValueError, match="disjoint"):
        attention_with_lending(q, [], [chunk], twice)


class _DifferentiableReference:
    """A backend whose lse carries a gradient (as FlexAttention's does on CUDA), by the dense
    float64 reference."""

    name, lse_has_grad, work_block = "reference", True, 1

    def forward_chunk(self, q_BHSD, k_BGKD, v_BGKD, mask, scale):
        batch, heads, queries, _ = q_BHSD.shape
        allowed = dense_allowed(mask, batch, heads, queries, k_BGKD.shape[2])
        return reference_attention(q_BHSD, k_BGKD, v_BGKD, allowed, scale)


def test_autograd_ring_backend_differentiates_a_chunk_like_backward_chunk() -> None:
    """Per-chunk gradients given the merged (O, lse), by autograd through the chunk's forward,
    equal the cpu kernel's backward_chunk; a chunk's weight in the merge matters (ablation:
    ignoring it changes dQ)."""
    inputs = _inputs()
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    mask = causal_within_documents(None)
    chunks = [(k[0], v[0], None), (k[3], v[3], mask)]
    cpu, adapted = CpuFlashBackend(), AutogradRingBackend(_DifferentiableReference())
    scale = D**-0.5
    out, lse = attention_over_chunks(q, [KVChunk(*chunk) for chunk in chunks], scale, backend="cpu")
    grad_out = inputs["grad_out"]
    for k_c, v_c, mask_c in chunks:
        expected = cpu.backward_chunk(grad_out, q, k_c, v_c, out, lse, mask_c, scale)
        got = adapted.backward_chunk(grad_out, q, k_c, v_c, out, lse, mask_c, scale)
        for name, e, g in zip("qkv", expected, got, strict=True):
            assert (e - g).abs().max() < 1e-12, name
    k_0, v_0, _ = chunks[0]
    reference_dq = cpu.backward_chunk(grad_out, q, k_0, v_0, out, lse, None, scale)[0]
    wrong_weight_dq = adapted.backward_chunk(grad_out, q, k_0, v_0, out, lse + 5.0, None, scale)[0]
    assert (wrong_weight_dq - reference_dq).abs().max() > 1e-3


@dataclass(frozen=True)
class _PostedLoan(AttentionLoan):
    """A loan that sets `posted` once its first receive is posted."""

    posted: threading.Event = field(default_factory=threading.Event)

    def post_receives(self, *tensors: torch.Tensor) -> list:
        works = super().post_receives(*tensors)
        self.posted.set()
        return works


def _serve_two_passes(rank: int, world: int, chained: bool) -> dict:
    """Rank 1 runs two serving passes of rank 0 back to back: the first answers two forward
    requests, the second one backward request. Both passes' threads start before rank 0 lends.
    Without a chain, the ablation lets rank 0 start only once the second pass's thread is
    receiving, so the two threads compete for rank 0's messages (and give up after 2 s)."""
    if rank == 0:
        return _serve_a_late_lender(rank, world, wait_inside_the_pass=False)
    timeout = timedelta(seconds=60 if chained else 2)
    second_loan = _PostedLoan(0, timeout=timeout)
    chain = ServingChain() if chained else None
    first = LoanServer(
        [LoanRequest(0, False)] * 2, lambda peer: AttentionLoan(peer, timeout=timeout), "cpu", chain
    )
    second = LoanServer([LoanRequest(0, True)], lambda peer: second_loan, "cpu", chain)
    first.start()
    second.start()
    if not chained:
        second_loan.posted.wait()
    dist.send(torch.ones(1), dst=0)
    first.finish()
    second.finish()
    dist.barrier()
    return {"answered": (first.answered, second.answered)}


def test_a_serving_chain_answers_consecutive_passes_in_turn() -> None:
    """The second pass's thread reads rank 0's messages only after the first pass's has
    answered its last request: the lender's results equal local attention."""
    lender, server = run_on_ranks(_serve_two_passes, 2, True)
    assert server["answered"] == (2, 1)
    reference = _reference(_inputs())
    expected = {"out0": "out", "out1": "out", "dq": "dq", "dk": "dk", "dv": "dv"}
    for name, reference_name in expected.items():
        assert (lender[name] - reference[reference_name]).abs().max().item() < 1e-12, name


def test_two_serving_passes_without_a_chain_take_each_others_requests() -> None:
    """The ablation: the second pass's thread takes part of the first pass's requests, and the
    lender never gets its answers."""
    with pytest.raises(
        RankFailedError,
        match=r"rank 0 of the exchange group (lost|waited more than 2 s for) rank 1",
    ):
        run_on_ranks(_serve_two_passes, 2, False, timeout=60)
