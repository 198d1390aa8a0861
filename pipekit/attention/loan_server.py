"""`LoanServer`: a serving pass answers its loans on helper threads, beside its own work.

In context exchange a light pass computes part of a heavy pass's attention (SlimPipe §4.2). The
light pass has its own layers to run, and the lender's requests come one per attention layer, each
after the answer to the one before. A server that answers at fixed layers of its own pass makes
one of the two wait at every layer: the server for a request not yet sent, or the lender for a
server still inside its own layer. Measured with a 2-rank pipeline at 8K context, those waits
were nearly all of the exchange's added in-action time.

So the answers come from a helper thread per lender, started at the pass's first attention call:
it receives each request as it arrives, computes, and answers, while the pass runs its own
layers (on a GPU the two would be two streams; on a CPU they share the rank's cores, and the
attention kernels release the GIL). `finish` joins the threads; in a pipeline the schedule's
serving action calls it just before the rank's next pass that lends or serves. Each peer's
requests are answered in the order it sent them (messages between two ranks are ordered), so
the pairing needs no tags.

**Deadlock-free.** A lender waits only for answers, and its next request follows the answer to
its last. The threads wait only for requests of lenders whose passes run in the same moment of
the plan (`pipekit.pipelining.features.exchange_plan`), which depend on nothing this rank runs
after `finish`: every request they wait for is sent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

from pipekit.attention.backends import AttentionBackend
from pipekit.attention.exchange import (
    AttentionLoan,
    serve_attention_loan,
    serve_attention_loan_backward,
)

__all__ = ["LoanRequest", "LoanServer"]


class LoanRequest(NamedTuple):
    """A request a serving pass answers: from `peer`, of its forward or its backward pass (the
    kind of the lending pass, whatever the kind of the serving one)."""

    peer: int
    backward: bool


class LoanServer:
    """The requests one serving pass answers (`requests`, in the order each peer sends them);
    `loan(peer)` gives the peer's `AttentionLoan` (group and timeout)."""

    def __init__(
        self,
        requests: Sequence[LoanRequest],
        loan: Callable[[int], AttentionLoan],
        backend: str | AttentionBackend,
    ) -> None:
        self.backend = backend
        self._kinds: dict[int, list[bool]] = {}
        for peer, backward in requests:
            self._kinds.setdefault(peer, []).append(backward)
        self._loans = {peer: loan(peer) for peer in self._kinds}
        self._threads: list[threading.Thread] = []
        self._errors: list[BaseException] = []
        self.answered = 0
        """Requests answered so far."""

    @property
    def started(self) -> bool:
        return bool(self._threads)

    def start(self, scale: float | None) -> None:
        """At the pass's first attention call: answer every peer's requests as they come
        (`scale`: the softmax scale; None: 1/sqrt(head dim))."""
        if self.started:
            return
        for peer, kinds in self._kinds.items():
            thread = threading.Thread(
                target=self._answer_all,
                args=(self._loans[peer], kinds, scale),
                name=f"pipekit-serve-rank-{peer}",
                daemon=True,
            )
            self._threads.append(thread)
            thread.start()

    def finish(self) -> None:
        """Wait until every request is answered; re-raise a helper's error. (A pass that never
        reached an attention call starts answering here, at the default scale.)"""
        self.start(None)
        for thread in self._threads:
            thread.join()
        if self._errors:
            raise self._errors[0]

    def _answer_all(self, loan: AttentionLoan, kinds: list[bool], scale: float | None) -> None:
        try:
            for backward in kinds:
                serve = serve_attention_loan_backward if backward else serve_attention_loan
                serve(loan, scale, self.backend)
                self.answered += 1
        except BaseException as error:
            self._errors.append(error)
