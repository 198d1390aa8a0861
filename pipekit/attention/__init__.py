"""Attention that returns (out, lse): masks, kernels, exact LSE merge, attention contexts."""

from pipekit.attention.across.lending import (
    AttentionLoan,
    Lending,
    LentChunk,
    attention_with_lending,
    serve_attention_loan,
    serve_attention_loan_backward,
)
from pipekit.attention.across.ring import ring_context_attention
from pipekit.attention.across.token_shards import (
    commutated_context_attention,
    kv_passing_context_attention,
    load_balanced_indices,
)
from pipekit.attention.chunked import KVChunk, attention, attention_over_chunks
from pipekit.attention.context import ContextParallelAttention
from pipekit.attention.kernels.backends import (
    AttentionBackend,
    RingBackend,
    available_backends,
    get_backend,
    select_backend,
    use_backend,
)
from pipekit.attention.kernels.score_mod import ALIBI, ScoreBiasRule, alibi_slopes
from pipekit.attention.kv_cache import ChunkedKVCache, SliceAttention
from pipekit.attention.masks import (
    MaskMod,
    and_masks,
    causal_mask,
    causal_within_documents,
    document_mask,
    offset_causal_mask,
    or_masks,
    sliding_window_mask,
    token_order_mask,
)
from pipekit.attention.merge import merge_attention
from pipekit.attention.patterns import CAUSAL, AttentionPattern
from pipekit.attention.work import attention_work, equal_work_bins, keys_seen, token_costs

__all__ = [
    "ALIBI",
    "CAUSAL",
    "AttentionBackend",
    "AttentionLoan",
    "AttentionPattern",
    "ChunkedKVCache",
    "ContextParallelAttention",
    "KVChunk",
    "Lending",
    "LentChunk",
    "MaskMod",
    "RingBackend",
    "ScoreBiasRule",
    "SliceAttention",
    "alibi_slopes",
    "and_masks",
    "attention",
    "attention_over_chunks",
    "attention_with_lending",
    "attention_work",
    "available_backends",
    "causal_mask",
    "causal_within_documents",
    "commutated_context_attention",
    "document_mask",
    "equal_work_bins",
    "get_backend",
    "keys_seen",
    "kv_passing_context_attention",
    "load_balanced_indices",
    "merge_attention",
    "offset_causal_mask",
    "or_masks",
    "ring_context_attention",
    "select_backend",
    "serve_attention_loan",
    "serve_attention_loan_backward",
    "sliding_window_mask",
    "token_costs",
    "token_order_mask",
    "use_backend",
]
