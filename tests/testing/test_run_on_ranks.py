"""`run_on_ranks`: results come back in rank order, a rank's standard error reaches the real one,
a rank that dies natively fails the call with the end of its standard error, and a hung one
with its threads' stacks."""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch
import torch.distributed as dist

from pipekit.testing import RankFailedError, run_on_ranks


def _sum_and_say(rank: int, world: int) -> float:
    print(f"rank {rank} of {world} says hello", file=sys.stderr)
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return total.item()


def _abort_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        print("about to abort like a gloo I/O thread would", file=sys.stderr)
        os.abort()
    dist.barrier()


def test_results_in_rank_order_and_stderr_reaches_the_real_one(
    capfd: pytest.CaptureFixture[str],
) -> None:
    assert run_on_ranks(_sum_and_say, 2) == [3.0, 3.0]
    err = capfd.readouterr().err
    assert "rank 0 of 2 says hello" in err and "rank 1 of 2 says hello" in err


def test_a_native_abort_reports_the_ranks_stderr() -> None:
    threads = len(os.listdir("/proc/self/task"))
    with pytest.raises(RankFailedError) as failure:
        run_on_ranks(_abort_on_rank_one, 2, timeout=20)
    message = str(failure.value)
    assert "rank 1 died with exit code -6" in message
    assert f"forked from a process running {threads} threads" in message
    assert "about to abort like a gloo I/O thread would" in message
    assert "Fatal Python error: Aborted" in message  # faulthandler's stacks follow
    assert "_abort_on_rank_one" in message


def _stuck_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        _stuck_here()  # rank 0 returns and waits in run_on_ranks's closing barrier


def _stuck_here() -> None:
    signal.pause()


def test_a_hung_rank_reports_where_its_threads_are() -> None:
    with pytest.raises(RankFailedError) as failure:
        run_on_ranks(_stuck_on_rank_one, 2, timeout=2)
    message = str(failure.value)
    assert "ranks [0, 1] did not finish within 2 s" in message
    assert "rank 1's threads:" in message and "_stuck_here" in message
    assert "rank 0's threads:" in message and "barrier" in message
