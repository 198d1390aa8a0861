"""`LoanServer`: a serving pass answers its loans on helper threads, beside its own work.

In context exchange a light pass computes part of a heavy pass's attention (SlimPipe §4.2). The
light pass has its own layers to run, and the lender's requests come one per attention layer, each
after the answer to the one before. A server that answers at fixed layers of its own pass makes
one of the two wait at every layer: the server for a request not yet sent, or the lender for a
server still inside its own layer. Measured with a 2-rank pipeline at 8K context, those waits
were nearly all of the exchange's added in-action time.

So the answers come from a helper thread per lender: it receives each request as it arrives,
computes, and answers, while the pass runs its own layers (on a GPU the two would be two streams;
on a CPU they share the rank's cores, and the attention kernels release the GIL). Requests carry
the softmax scale, so a thread can start before its pass; in a pipeline every serving pass's
threads start with the step. Each peer's requests are answered in the order it sent them
(messages between two ranks are ordered), so the pairing needs no tags; a `ServingChain` makes
the thread of each serving pass for a peer start receiving only after the previous pass's thread
for that peer has answered its last request. With early KV exchange the peer sends the lent
chunks of all its requests to one pass before the first request; the thread receives them first.
`finish` joins the threads (in a pipeline, the schedule's serving actions at the end of the step).

**Deadlock-free.** A lender waits only for answers, and its next request follows the answer to
its last. A thread waits only for its chain's previous thread of the same peer and for that
peer's messages, which the peer sends in the same order as the threads read them: each message a
thread waits for is sent once the peer's earlier messages to this rank are, and those are read by
the threads before it. The rank's own passes never wait for the threads until `finish`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from pipekit.attention.across.lending import answer_loan
from pipekit.attention.across.loan_wire import AttentionLoan, receive_lent_chunks, receive_loan
from pipekit.attention.kernels.backends import AttentionBackend

__all__ = ["LoanRequest", "LoanServer", "ServingChain"]


class LoanRequest(NamedTuple):
    """A request a serving pass answers: from `peer`, of its forward or its backward pass (the
    kind of the lending pass, whatever the kind of the serving one); `chunks_ahead`: the peer
    sends the lent chunks of all its requests to this pass before the first (early KV
    exchange)."""

    peer: int
    backward: bool
    chunks_ahead: bool = False


class ServingChain:
    """The serving passes of one step, in the order they start, per peer: the thread that answers
    a peer reads that peer's messages only after the previous pass's thread for it has ended
    (two readers of one peer would take each other's requests)."""

    def __init__(self) -> None:
        self._last: dict[int, LoanServer] = {}

    def follow(self, peer: int, server: LoanServer) -> LoanServer | None:
        """`server` answers `peer` next; returns the server that answered it before (None: the
        first this step)."""
        previous, self._last[peer] = self._last.get(peer), server
        return previous

    def clear(self) -> None:
        """At the end of a step, when every server has finished."""
        self._last.clear()


class LoanServer:
    """The requests one serving pass answers (`requests`, in the order each peer sends them);
    `loan(peer)` gives the peer's `AttentionLoan` (group and timeout). With a `chain`, each
    peer's thread first waits for the thread of the chain's previous server of that peer."""

    def __init__(
        self,
        requests: Sequence[LoanRequest],
        loan: Callable[[int], AttentionLoan],
        backend: str | AttentionBackend,
        chain: ServingChain | None = None,
    ) -> None:
        self.backend, self.chain = backend, chain
        self._requests: dict[int, list[LoanRequest]] = {}
        for request in requests:
            self._requests.setdefault(request.peer, []).append(request)
        for peer, of_peer in self._requests.items():
            if len({request.chunks_ahead for request in of_peer}) > 1:
                raise ValueError(
                    f"rank {peer}'s requests to one serving pass must all have their chunks "
                    "sent ahead, or none"
                )
        self._loans = {peer: loan(peer) for peer in self._requests}
        self._threads: dict[int, threading.Thread] = {}
        self._errors: list[BaseException] = []
        self.answered = 0
        """Requests answered so far."""
        self.chunk_leads_s: list[float] = []
        """Per peer that sent its chunks ahead: how long they had been here when its first
        request arrived."""
        self._thread_cpu_s: list[float] = []

    @property
    def cpu_s(self) -> float:
        """CPU seconds the finished threads spent receiving, computing and sending (their
        waits excluded): on a CPU, what the moved attention costs the serving rank."""
        return sum(self._thread_cpu_s)

    @property
    def started(self) -> bool:
        return bool(self._threads)

    def start(self) -> None:
        """Answer every peer's requests as they come, on a thread per peer (the requests carry
        the softmax scale)."""
        if self.started:
            return
        for peer, requests in self._requests.items():
            previous = self.chain.follow(peer, self) if self.chain is not None else None
            thread = threading.Thread(
                target=self._answer_all,
                args=(self._loans[peer], requests, previous),
                name=f"pipekit-serve-rank-{peer}",
                daemon=True,
            )
            self._threads[peer] = thread
            thread.start()

    def finish(self) -> None:
        """Wait until every request is answered; re-raise a helper's error."""
        self.start()
        for thread in self._threads.values():
            thread.join()
        if self._errors:
            raise self._errors[0]

    def _answer_all(
        self, loan: AttentionLoan, requests: list[LoanRequest], previous: LoanServer | None
    ) -> None:
        try:
            self._answer_in_turn(loan, requests, previous)
        except BaseException as error:
            self._errors.append(error)
        finally:
            self._thread_cpu_s.append(time.thread_time())

    def _answer_in_turn(
        self, loan: AttentionLoan, requests: list[LoanRequest], previous: LoanServer | None
    ) -> None:
        """After the previous server's thread for this peer, answer its requests in order."""
        if previous is not None:
            previous._threads[loan.peer].join()
            if previous._errors:
                raise RuntimeError(
                    f"context exchange: an earlier serving pass for rank {loan.peer} failed; "
                    "its error is raised where that pass's serving action waits"
                )
        ahead = [
            receive_lent_chunks(loan) if request.chunks_ahead else None for request in requests
        ]
        chunks_at = time.perf_counter()
        for index, (request, chunks) in enumerate(zip(requests, ahead, strict=True)):
            received = receive_loan(loan, request.backward, chunks)
            if chunks is not None and index == 0:
                self.chunk_leads_s.append(time.perf_counter() - chunks_at)
            answer_loan(loan, received, self.backend)
            self.answered += 1
