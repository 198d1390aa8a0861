"""The training data loader: packed rows in a seeded order, sharded over data-parallel ranks.

The order is defined globally first and sharded second. Each epoch has one permutation of all
rows (seeded by `(seed, epoch)`, the same on every rank). Step k of the epoch takes the global
batch `order[p : p + G]`, where p = k*G is the epoch's position and
G = local_batch_size * dp_world_size; rank r takes the contiguous block
`[p + r*B, p + (r+1)*B)` of it (B = local_batch_size), i.e. a share strided by G through the
epoch. Concatenating the ranks' batches in rank order gives the global batch, which is therefore
the same whatever the data-parallel degree. An epoch ends when fewer than G rows are left (those
rows are skipped this epoch; the next permutation differs), and iteration never ends.

The resumable state is `(epoch, position)`, identical on every rank: a loader that loads it
continues exactly where the saved one stopped, even with another dp degree.

A step's rows follow from the step alone (`batch_of_step`), so worker processes
(`num_workers`) assemble batches `k, k + 1, ...` ahead of the trainer and, after a resume, start
again at the saved step. `rows` restricts a loader to a range of the stream's rows: the trainer
holds the last ones out for validation.

Legend: B local batch, S seq_len, G global batch (B * dp_world_size).
"""

from __future__ import annotations

import atexit
import dataclasses
import glob
import hashlib
import itertools
import os
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from pipekit.attention.work import equal_work_bins
from pipekit.config.job_config import DataConfig
from pipekit.train.data.balance import row_attention_work
from pipekit.train.data.chat import chat_conversations, pack_conversations
from pipekit.train.data.chat_template import PLAIN_TEMPLATE, load_chat_template
from pipekit.train.data.corpus import file_fingerprint, iter_documents, source_files
from pipekit.train.data.hf_datasets import (
    HF_SOURCE,
    check_hf_source,
    hf_documents,
    hf_source_key,
    hf_stream,
)
from pipekit.train.data.mixture import MixedTokenStream
from pipekit.train.data.packing import TokenStream, check_batch_args, pack_documents
from pipekit.train.data.streaming import StreamingPackedLoader
from pipekit.train.data.tokenizer import build_tokenizer
from pipekit.train.stop_signals import ignore_stop_signals

__all__ = ["PackedDataLoader", "build_data_loader", "check_data_config", "load_token_stream"]


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed for `(seed, epoch)`, independent of Python's hash salt."""
    digest = hashlib.blake2b(f"pipekit-data/{seed}/{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class PackedDataLoader:
    """Infinite iterator of `[B, S]` TensorDicts (tokens, labels, positions, document_ids; int64)
    cut from a packed `TokenStream` (see the module docstring for the order)."""

    def __init__(
        self,
        stream: TokenStream | MixedTokenStream,
        *,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        rows: range | None = None,
        balance_bins: int = 0,
    ) -> None:
        check_batch_args(seq_len, local_batch_size, dp_rank, dp_world_size)
        if balance_bins and local_batch_size % balance_bins:
            raise ValueError(
                f"local_batch_size={local_batch_size} rows do not deal into {balance_bins} "
                "microbatches; make the local batch a multiple of the microbatches"
            )
        self.balance_bins = balance_bins
        """Microbatches per rank whose attention work a step's rows are dealt to balance
        (`pipekit.attention.work.equal_work_bins`, over every data-parallel rank's); 0: rows
        in order."""
        self.stream = stream
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.seed = seed
        self.shuffle = shuffle
        self.global_batch_size = local_batch_size * dp_world_size
        self.rows = range(stream.num_rows(seq_len)) if rows is None else rows
        """The stream's rows this loader draws from (all, or a training or held-out part)."""
        self.num_rows = len(self.rows)
        if self.num_rows < self.global_batch_size:
            raise ValueError(
                f"the corpus packs into {self.num_rows} rows of seq_len={seq_len} "
                f"({stream.num_tokens} tokens), fewer than one global batch of "
                f"{self.global_batch_size} rows (local_batch_size={local_batch_size} x "
                f"dp={dp_world_size}); use a larger source, a shorter seq_len or a smaller batch"
            )
        self.epoch = 0
        self.position = 0
        self._order_epoch = -1
        self._order_G: Tensor | None = None
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self._worker_batches: Iterator[TensorDict] | None = None
        """With workers: their batches from the current step on (made at the first `next`)."""
        if num_workers:
            atexit.register(self.close)  # runs before multiprocessing's own exit handler

    @property
    def steps_per_epoch(self) -> int:
        """Global batches in one epoch (counted from position 0)."""
        return self.num_rows // self.global_batch_size

    def _epoch_order(self, epoch: int) -> Tensor:
        """Row order of `epoch`, computed once per epoch."""
        if self._order_epoch != epoch or self._order_G is None:
            if self.shuffle:
                generator = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
                self._order_G = torch.randperm(self.num_rows, generator=generator)
            else:
                self._order_G = torch.arange(self.num_rows)
            self._order_epoch = epoch
        return self._order_G

    def batch_of_step(self, step: int) -> TensorDict:
        """This rank's batch of global step `step` (0-based, counted over epochs)."""
        epoch, index = divmod(step, self.steps_per_epoch)
        if self.balance_bins:
            start = index * self.global_batch_size
            row_ids_G = self._epoch_order(epoch)[start : start + self.global_batch_size]
            batch_G = self.stream.rows(self.rows.start + row_ids_G, self.seq_len)
            work_G = row_attention_work(batch_G["document_ids"])
            order_G = equal_work_bins(work_G, self.balance_bins * self.dp_world_size)
            mine = self.dp_rank * self.local_batch_size
            return batch_G[order_G[mine : mine + self.local_batch_size]]
        start = index * self.global_batch_size + self.dp_rank * self.local_batch_size
        row_ids_B = self._epoch_order(epoch)[start : start + self.local_batch_size]
        return self.stream.rows(self.rows.start + row_ids_B, self.seq_len)

    @property
    def step(self) -> int:
        """Global batches taken so far (over epochs)."""
        return self.epoch * self.steps_per_epoch + self.position // self.global_batch_size

    def __iter__(self) -> PackedDataLoader:
        return self

    def __next__(self) -> TensorDict:
        step = self.step
        if self.num_workers and self._worker_batches is None:
            self._worker_batches = self._start_workers(step)
        batch = self.batch_of_step(step) if self._worker_batches is None else None
        self.position += self.global_batch_size
        if self.position + self.global_batch_size > self.num_rows:  # the rest is skipped
            self.epoch, self.position = self.epoch + 1, 0
        return next(self._worker_batches) if batch is None else batch

    def close(self) -> None:
        """Stop the worker processes, if any (the next batch starts them again). Called before
        the interpreter exits: multiprocessing would otherwise stop them with SIGTERM, which
        they ignore (see `ignore_stop_signals`)."""
        iterator, self._worker_batches = self._worker_batches, None
        del iterator  # the last reference: its finalizer joins the workers

    def _start_workers(self, step: int) -> Iterator[TensorDict]:
        """Worker processes that assemble batches `step, step + 1, ...` in order, each
        `prefetch_factor` ahead. The position alone says which rows a step takes, so a restart
        at a saved position (resume, another dp degree) needs no state of the workers."""
        loader = DataLoader(
            _StepBatches(self),
            batch_size=None,
            sampler=itertools.count(step),
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor,
            collate_fn=_unchanged,
            worker_init_fn=ignore_stop_signals,
        )
        return iter(loader)

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is (the same on every rank), plus what makes that position mean
        the same rows on load."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_rows": self.num_rows,
            "mixture": getattr(self.stream, "key", 0),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved `state_dict()`; the order must be the one it was saved with."""
        saved = {"mixture": 0} | {key: int(value) for key, value in state.items()}
        mine = self.state_dict()
        for key in ("seed", "shuffle", "num_rows", "mixture"):
            if saved[key] != int(mine[key]):
                raise ValueError(
                    f"data loader state was saved with {key}={saved[key]}, this loader has "
                    f"{key}={int(mine[key])}: the saved position would name other rows; resume "
                    "with the same data source (and mixture), tokenizer, seq_len, seed and "
                    "shuffle setting"
                )
        if not 0 <= saved["position"] <= self.num_rows or saved["epoch"] < 0:
            raise ValueError(f"data loader state {saved} is out of range ({self.num_rows} rows)")
        self.epoch = saved["epoch"]
        self.position = saved["position"]
        if self.position + self.global_batch_size > self.num_rows:  # saved at an epoch's end
            self.epoch, self.position = self.epoch + 1, 0
        self.close()  # the workers' batches ahead are of the old position


class _StepBatches(Dataset):
    """Map-style view of a loader for its workers: item k is its batch of global step k."""

    def __init__(self, loader: PackedDataLoader) -> None:
        self.loader = loader

    def __getitem__(self, step: int) -> TensorDict:
        return self.loader.batch_of_step(step)


def _unchanged(batch: TensorDict) -> TensorDict:
    return batch


_STREAM_CACHE: OrderedDict[tuple, TokenStream] = OrderedDict()
_STREAM_CACHE_SIZE = 2


def check_data_config(data_config: DataConfig) -> int:
    """Check the [data] section before anything is read; return the tokenizer's vocabulary size.

    ValueError (naming the fix) when the source matches no file or the tokenizer cannot be
    built."""
    source = data_config.source
    if data_config.mix_sources or data_config.mix_weights:
        _check_mixture(data_config)
    elif source == HF_SOURCE:
        check_hf_source(data_config)
    else:
        _check_source(source)
    if data_config.format == "chat" and (source in (HF_SOURCE, "stdlib") or data_config.streaming):
        raise ValueError(
            f"format = 'chat' reads .jsonl files of conversations; source={source!r} is not "
            "one (give a .jsonl file, folder or glob; streaming = false)"
        )
    if data_config.streaming and source != HF_SOURCE:
        raise ValueError(
            f"streaming = true reads a Hugging Face dataset as a stream, but source={source!r}; "
            "set source = 'hf' or streaming = false"
        )
    if data_config.streaming and data_config.num_workers:
        raise ValueError(
            f"streaming = true packs rows in the trainer's process; set num_workers = 0 (it is "
            f"{data_config.num_workers})"
        )
    if data_config.num_workers < 0 or data_config.prefetch_factor < 1:
        raise ValueError(
            f"num_workers={data_config.num_workers} must be >= 0 and prefetch_factor="
            f"{data_config.prefetch_factor} >= 1"
        )
    tokenizer = data_config.tokenizer
    if tokenizer != "bytes" and not Path(tokenizer).is_file():
        raise ValueError(
            f"tokenizer={tokenizer!r} is not a file; use 'bytes' or a tokenizer.json path"
        )
    built = build_tokenizer(tokenizer)
    if data_config.chat_template != PLAIN_TEMPLATE:
        if data_config.format != "chat":
            raise ValueError(
                f"chat_template={data_config.chat_template!r} renders conversations: set "
                "format = 'chat', or chat_template = 'plain'"
            )
        load_chat_template(data_config.chat_template, built)
    return built.vocab_size


def _check_source(source: str, key: str = "source") -> None:
    if source != "stdlib" and not (os.path.exists(source) or glob.glob(source, recursive=True)):
        raise ValueError(
            f"{key}={source!r} matches no file; give a file, a folder, a glob, 'stdlib' or 'hf'"
        )


def _check_mixture(data_config: DataConfig) -> None:
    """One positive weight per mixed source, each source found; not with a `source` of its
    own or a stream."""
    sources, weights = data_config.mix_sources, data_config.mix_weights
    if len(sources) != len(weights) or len(sources) < 2:
        raise ValueError(
            f"mix_sources has {len(sources)} entries and mix_weights {len(weights)}: give two "
            "sources or more, one weight each"
        )
    if any(not weight > 0 for weight in weights):
        raise ValueError(f"mix_weights={weights} must all be positive")
    if data_config.source != "stdlib" or data_config.streaming:
        raise ValueError(
            "mix_sources replaces source and reads corpora packed in memory: leave source at "
            "its default and streaming = false"
        )
    for index, source in enumerate(sources):
        _check_source(source, f"mix_sources[{index}]")


def load_token_stream(data_config: DataConfig) -> TokenStream:
    """The packed stream of `data_config`'s source and tokenizer, kept in memory (no disk
    cache) so that several loaders in one process tokenize once."""
    tokenizer = build_tokenizer(data_config.tokenizer)
    tokenizer_files = [tokenizer.path] if hasattr(tokenizer, "path") else []
    if data_config.source == HF_SOURCE:
        source_key = hf_source_key(data_config)
        documents = hf_documents(data_config)
    else:
        files = source_files(data_config.source)
        source_key = (data_config.source, data_config.jsonl_field, file_fingerprint(files))
        documents = iter_documents(files, jsonl_field=data_config.jsonl_field)
    template = load_chat_template(data_config.chat_template, tokenizer)
    key = (source_key, data_config.format, data_config.tokenizer, file_fingerprint(tokenizer_files))
    key += (template,)
    if key in _STREAM_CACHE:
        _STREAM_CACHE.move_to_end(key)
        return _STREAM_CACHE[key]
    if data_config.format == "chat":  # validated: local .jsonl files
        stream = pack_conversations(chat_conversations(files), tokenizer, template)
    else:
        stream = pack_documents(documents, tokenizer)
    _STREAM_CACHE[key] = stream
    while len(_STREAM_CACHE) > _STREAM_CACHE_SIZE:
        _STREAM_CACHE.popitem(last=False)
    return stream


def build_data_loader(
    data_config: DataConfig,
    *,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_world_size: int,
    seed: int,
    held_out: float = 0.0,
    split: str = "train",
    microbatches: int = 1,
) -> PackedDataLoader | StreamingPackedLoader:
    """The trainer's one entry point: this rank's loader for the `[data]` config section.

    `held_out` is the share of rows kept out of training (the last ones); `split="validation"`
    reads them, in order, in the trainer's process. With `data.balance_attention` a training
    step's rows are dealt over the data-parallel ranks and each rank's `microbatches`."""
    check_batch_args(seq_len, local_batch_size, dp_rank, dp_world_size)  # before tokenizing
    if data_config.streaming and data_config.balance_attention:
        raise ValueError(
            "data.balance_attention deals a step's rows by their documents, which a streamed "
            "corpus packs as they arrive on each rank: set data.streaming = false or "
            "data.balance_attention = false"
        )
    if data_config.streaming:
        if held_out:
            raise ValueError(
                "validation holds out rows of a corpus packed in memory; a streamed one has no "
                "row count to hold out from: set data.streaming = false or validation.enable = "
                "false"
            )
        return StreamingPackedLoader(
            hf_stream(data_config, seed),
            build_tokenizer(data_config.tokenizer),
            seq_len=seq_len,
            local_batch_size=local_batch_size,
            dp_rank=dp_rank,
            dp_world_size=dp_world_size,
        )
    stream: TokenStream | MixedTokenStream
    if data_config.mix_sources:
        streams = [
            load_token_stream(dataclasses.replace(data_config, source=source, mix_sources=[]))
            for source in data_config.mix_sources
        ]
        stream = MixedTokenStream(streams, data_config.mix_weights, seed, seq_len)
    else:
        stream = load_token_stream(data_config)
    total = stream.num_rows(seq_len)
    first_held_out = total - round(total * held_out)
    validation = split == "validation"
    if validation and total - first_held_out < local_batch_size * dp_world_size:
        raise ValueError(
            f"validation.fraction={held_out} holds out {total - first_held_out} of {total} rows, "
            f"fewer than one global batch of {local_batch_size * dp_world_size}; raise it"
        )
    return PackedDataLoader(
        stream,
        seq_len=seq_len,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        seed=seed,
        shuffle=data_config.shuffle and not validation,
        num_workers=0 if validation else data_config.num_workers,
        prefetch_factor=data_config.prefetch_factor,
        rows=range(first_held_out, total) if validation else range(first_held_out),
        balance_bins=microbatches if data_config.balance_attention and not validation else 0,
    )
