"""`python -m pipekit.bench chunked-loss --tokens 32768 --vocab 131072 --chunk 1024`.

The output layer and cross-entropy of N tokens, forward and backward, whole (`N x V` logits)
and chunked (`[training] loss_chunk_tokens`): the peak bytes of every tensor the head's ops
allocate (`PeakTensorMemory`, by storage), against `head_peak_bytes`'s formula.

The whole head at 32K tokens and a 128K vocabulary needs 48 GiB: more than this machine has.
Its peak is counted on the meta device, where tensors have sizes and lifetimes but no bytes;
the same two heads at `--check-tokens` are counted on both the CPU and the meta device, and
the table shows the two counts equal. The chunked head at full size runs on the CPU too
(`--no-cpu` skips it: minutes on 2 cores).

RESULT: `chunked_peak_gib`, `whole_peak_gib` (meta), `chunked_vs_formula` (the CPU run's
peak over the formula, or the meta count's with `--no-cpu`), `whole_over_chunked`, and
`meta_equals_cpu` (yes when the small size counted the same bytes on both).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pipekit.bench.report import machine_description, print_result, print_table
from pipekit.layers.chunked_loss import chunked_linear_cross_entropy, head_peak_bytes
from pipekit.layers.loss import token_sum_cross_entropy
from pipekit.memory.live_tensors import PeakTensorMemory

__all__ = ["main"]

_GIB = 2**30


def _head_peak(
    tokens: int, vocab: int, dim: int, chunk_tokens: int | None, device: str
) -> tuple[int, float]:
    """Peak bytes the head's forward and backward allocate, and its seconds."""
    generator = torch.Generator().manual_seed(0)
    hidden_ND = torch.randn(tokens, dim, generator=generator).to(device).requires_grad_()
    weight_VD = torch.randn(vocab, dim, generator=generator).mul_(0.02).to(device)
    weight_VD.requires_grad_()
    labels_N = torch.randint(0, vocab, (tokens,), generator=generator).to(device)
    started = time.perf_counter()
    with PeakTensorMemory(meta=True) as memory:
        if chunk_tokens is None:  # the logits unnamed, as in the trainer: freed once used
            logits = F.linear(hidden_ND, weight_VD).unsqueeze(0)
            loss = token_sum_cross_entropy(logits, labels_N.unsqueeze(0), 1.0)
            del logits
        else:
            loss = chunked_linear_cross_entropy(
                hidden_ND, labels_N, weight_VD, chunk_tokens=chunk_tokens
            )
        loss.backward()
    return memory.peak_bytes, time.perf_counter() - started


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipekit.bench chunked-loss")
    parser.add_argument("--tokens", type=int, default=32768, help="tokens per rank (N)")
    parser.add_argument("--vocab", type=int, default=131072, help="vocabulary (V)")
    parser.add_argument("--dim", type=int, default=64, help="model dim (D)")
    parser.add_argument("--chunk", type=int, default=1024, help="loss_chunk_tokens")
    parser.add_argument(
        "--check-tokens", type=int, default=1024, help="size counted on CPU and meta alike"
    )
    parser.add_argument("--no-cpu", action="store_true", help="skip the full-size CPU run")
    options = parser.parse_args(argv)
    vocab, dim, chunk = options.vocab, options.dim, options.chunk
    runs = [(options.check_tokens, None, device) for device in ("cpu", "meta")]
    runs += [(options.check_tokens, chunk, device) for device in ("cpu", "meta")]
    runs += [(options.tokens, None, "meta"), (options.tokens, chunk, "meta")]
    if not options.no_cpu:
        runs.append((options.tokens, chunk, "cpu"))
    peaks, rows = {}, []
    for tokens, chunk_tokens, device in runs:
        peak, seconds = _head_peak(tokens, vocab, dim, chunk_tokens, device)
        formula = head_peak_bytes(tokens, vocab, dim, chunk_tokens)
        peaks[tokens, chunk_tokens, device] = peak
        rows.append([
            "whole" if chunk_tokens is None else f"chunks of {chunk_tokens}", device, tokens,
            peak / _GIB, formula / _GIB, peak / formula, seconds if device == "cpu" else "-",
        ])  # fmt: skip
    print(machine_description())
    print(f"head: N tokens x D {dim} -> V {vocab}, float32, forward and backward")
    print_table(
        ["head", "counted on", "tokens", "peak GiB", "formula GiB", "peak/formula", "seconds"],
        rows,
    )
    check = options.check_tokens
    meta_equals_cpu = all(peaks[check, c, "cpu"] == peaks[check, c, "meta"] for c in (None, chunk))
    whole = peaks[options.tokens, None, "meta"]
    chunked_device = "meta" if options.no_cpu else "cpu"
    chunked = peaks[options.tokens, chunk, chunked_device]
    print_result(
        chunked_peak_gib=chunked / _GIB,
        whole_peak_gib=whole / _GIB,
        chunked_vs_formula=chunked / head_peak_bytes(options.tokens, vocab, dim, chunk),
        whole_over_chunked=whole / chunked,
        meta_equals_cpu="yes" if meta_equals_cpu else "no",
    )
