"""Training data: tokenizers, document sources, sequence packing and the data-parallel loader.

The trainer calls `build_data_loader(job_config.data, ...)`; the pieces are public so that tests
and tools can pack their own documents (`pack_documents` + `PackedDataLoader`).
"""

from pipekit.train.data.corpus import (
    DOCUMENT_SUFFIXES,
    STDLIB_SOURCE,
    iter_documents,
    source_files,
    stdlib_files,
)
from pipekit.train.data.loader import PackedDataLoader, build_data_loader, load_token_stream
from pipekit.train.data.packing import IGNORE_INDEX, TokenStream, pack_documents
from pipekit.train.data.tokenizer import (
    LLAMA3_BOS,
    LLAMA3_EOS,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    build_tokenizer,
)

__all__ = [
    "DOCUMENT_SUFFIXES",
    "IGNORE_INDEX",
    "LLAMA3_BOS",
    "LLAMA3_EOS",
    "STDLIB_SOURCE",
    "ByteTokenizer",
    "HFTokenizer",
    "PackedDataLoader",
    "TokenStream",
    "Tokenizer",
    "build_data_loader",
    "build_tokenizer",
    "iter_documents",
    "load_token_stream",
    "pack_documents",
    "source_files",
    "stdlib_files",
]
