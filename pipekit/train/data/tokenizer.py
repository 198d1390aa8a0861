"""Tokenizers: text to token ids, plus the BOS/EOS ids that frame every packed document.

Two implementations: `ByteTokenizer` (UTF-8 bytes, no files, what the `debug` model trains on)
and `HFTokenizer` (a Hugging Face `tokenizer.json`, e.g. Llama 3's, through the optional
`tokenizers` package). Both also offer `encode_many`, which encodes a list of documents into one
flat id tensor: packing calls it instead of `encode` so that tens of MB of text never go through
a Python loop per token.

Legend: T tokens (flat, all documents), D documents.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "LLAMA3_BOS",
    "LLAMA3_EOS",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "build_tokenizer",
]

LLAMA3_BOS = "<|begin_of_text|>"
LLAMA3_EOS = "<|end_of_text|>"


@runtime_checkable
class Tokenizer(Protocol):
    """What packing needs from a tokenizer. `encode` adds no special tokens: packing frames each
    document with `bos_id`/`eos_id` itself. An optional `encode_many(texts) -> (ids_T, lengths_D)`
    is used when present (see the module docstring)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str) -> list[int] | Tensor: ...


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes of the text, 256 is BOS, 257 is EOS (vocab 258).

    Needs no file and round-trips any text exactly, which makes it the tokenizer of tests and of
    the `debug` Llama flavor (vocab_size=258)."""

    vocab_size: int = 258
    bos_id: int = 256
    eos_id: int = 257

    def encode(self, text: str) -> Tensor:
        """int64 ids of the UTF-8 bytes of `text`."""
        ids_T, _ = self.encode_many([text])
        return ids_T.long()

    def encode_many(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """`(ids_T, lengths_D)`: all texts' bytes back to back (uint8) and each text's length."""
        encoded = [text.encode("utf-8") for text in texts]
        lengths_D = torch.tensor([len(blob) for blob in encoded], dtype=torch.int64)
        joined = bytearray(b"".join(encoded))  # writable, so torch.frombuffer does not warn
        if not joined:
            return torch.empty(0, dtype=torch.uint8), lengths_D
        return torch.frombuffer(joined, dtype=torch.uint8), lengths_D

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        """Text of the byte ids; BOS/EOS are dropped, invalid UTF-8 becomes U+FFFD."""
        ids_T = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        return bytes(ids_T[ids_T < 256].to(torch.uint8).tolist()).decode("utf-8", "replace")


def _import_tokenizers() -> Any:
    """The `tokenizers` package, imported only when a Hugging Face tokenizer is asked for."""
    try:
        import tokenizers
    except ImportError as err:
        raise ImportError(
            "A Hugging Face tokenizer.json needs the 'tokenizers' package, which is not "
            "installed: pip install 'pipekit[hf]' (or use tokenizer = \"bytes\")"
        ) from err
    return tokenizers


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (Llama 3 by default) read with the `tokenizers` package.

    BOS/EOS are looked up by name (Llama 3's `<|begin_of_text|>` / `<|end_of_text|>` unless told
    otherwise); the tokenizer's own post-processor is bypassed (`add_special_tokens=False`)
    because packing adds them."""

    def __init__(
        self, path: str | Path, *, bos_token: str = LLAMA3_BOS, eos_token: str = LLAMA3_EOS
    ) -> None:
        tokenizers = _import_tokenizers()
        self.path = Path(path)
        self._tokenizer = tokenizers.Tokenizer.from_file(str(self.path))
        self.bos_token, self.eos_token = bos_token, eos_token
        """The special tokens' text (what a chat template writes for them)."""
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_id: int = self._special_id(bos_token, "BOS")
        self.eos_id: int = self._special_id(eos_token, "EOS")

    def _special_id(self, token: str, role: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(
                f"{self.path}: the tokenizer has no {role} token {token!r}; pipekit expects a "
                f"Llama 3 tokenizer.json ({LLAMA3_BOS}, {LLAMA3_EOS}); pass bos_token=/eos_token= "
                'to HFTokenizer for another family, or use tokenizer = "bytes"'
            )
        return int(token_id)

    def encode(self, text: str) -> list[int]:
        """Ids of `text` without special tokens."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_many(self, texts: Sequence[str]) -> tuple[Tensor, Tensor]:
        """`(ids_T, lengths_D)` of many texts, encoded in parallel by the Rust library."""
        encodings = self._tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
        id_lists = [encoding.ids for encoding in encodings]
        lengths_D = torch.tensor([len(ids) for ids in id_lists], dtype=torch.int64)
        # numpy (a tensordict dependency) fills from the iterator 3x faster than torch.tensor
        flat = chain.from_iterable(id_lists)
        ids_T = np.fromiter(flat, dtype=np.int32, count=int(lengths_D.sum()))
        return torch.from_numpy(ids_T), lengths_D

    def decode(self, ids: Sequence[int] | Tensor) -> str:
        """Text of the ids, special tokens dropped."""
        id_list = torch.as_tensor(ids).reshape(-1).tolist()
        return self._tokenizer.decode(id_list, skip_special_tokens=True)


def build_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """`"bytes"`, or the path of a Hugging Face `tokenizer.json` (or of a folder holding one)."""
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(
            f'data.tokenizer={spec!r}: no such file {str(path)!r}; use "bytes" or the path of a '
            "Hugging Face tokenizer.json (e.g. the one in a Llama 3 checkpoint folder)"
        )
    return HFTokenizer(path)
