"""Multi-head latent attention: its two forms are one function, and the latent form's KV cache
holds (and context parallelism moves) the latent once per token.

The sliced-pipeline, context-exchange and context-parallel rows of the latent form against one
process are in the parity matrix (`deepseek_v3`); here: the forms' equality, the sliced KV cache
on one process (every gradient in float64, its ablation, and the bytes it keeps), and the
bytes context parallelism moves for keys that are their own values.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor

from pipekit.attention.across import context_parallel_bytes
from pipekit.attention.across import token_shards as context_parallel_module
from pipekit.attention.across.token_shards import gather_keys_values
from pipekit.attention.kv_cache import ChunkedKVCache
from pipekit.families.deepseek_v3 import DeepSeekV3, DeepSeekV3Args, deepseek_v3_flavor
from pipekit.layers.rope import YarnScaling
from pipekit.memory_plan.activations import profile_activations
from pipekit.models import get_model_spec

SEQ_LEN, SLICES, BATCH = 32, 4, 2
YARN = YarnScaling(
    factor=4.0, original_max_position_embeddings=16, mscale=0.707, mscale_all_dim=1.0
)


def _args(cache: str, **changes: object) -> DeepSeekV3Args:
    base = deepseek_v3_flavor("debug")
    # no balance loss: a slice alone is not the sequence its statistics are over (the
    # pipeline runtime gathers them; the parity matrix holds that)
    moe = dataclasses.replace(base.moe, load_balance_weight=0.0)
    fields = {"n_layers": 2, "max_seq_len": SEQ_LEN, "attention_cache": cache, "moe": moe}
    fields |= changes
    return dataclasses.replace(base, **fields)


def _model(args: DeepSeekV3Args, seed: int = 0) -> DeepSeekV3:
    with torch.device("meta"):
        model = DeepSeekV3(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model.double()


def _pair(**changes: object) -> tuple[DeepSeekV3, DeepSeekV3]:
    expanded = _model(_args("expanded", **changes))
    latent = _model(_args("latent", **changes))
    latent.load_state_dict(expanded.state_dict())
    return expanded, latent


def _tokens() -> Tensor:
    return torch.randint(0, 258, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(1))


def _grads(model: DeepSeekV3) -> dict[str, Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _worst(grads: dict[str, Tensor], reference: dict[str, Tensor]) -> float:
    assert grads.keys() == reference.keys()
    return max(
        ((grads[n] - ref).abs().max() / ref.abs().max()).item() for n, ref in reference.items()
    )


@pytest.mark.parametrize(
    "changes",
    [{}, {"q_lora_rank": None}, {"rope_scaling": YARN}],
    ids=["query_lora", "full_query", "yarn"],
)
def test_latent_form_equals_expanded_form_fp64(changes: dict) -> None:
    """Absorbing W_uk into the queries and W_uv into the outputs changes no logit and no
    gradient; YaRN's softmax-scale correction and the full query projection included."""
    expanded, latent = _pair(**changes)
    tokens = _tokens()
    logits = {}
    for name, model in (("expanded", expanded), ("latent", latent)):
        logits[name] = model(tokens)
        logits[name].square().mean().backward()
    torch.testing.assert_close(logits["latent"], logits["expanded"], rtol=1e-12, atol=1e-12)
    assert _worst(_grads(latent), _grads(expanded)) < 1e-10


def _sliced_step(model: DeepSeekV3, cache: ChunkedKVCache) -> tuple[dict[str, Tensor], int]:
    """Slices forward in order, backward in reverse (one microbatch); the grads, and the
    cache's bytes once every slice is cached."""
    model.zero_grad()
    tokens, slice_len, losses = _tokens(), SEQ_LEN // SLICES, []
    for index in range(SLICES):
        positions = torch.arange(index * slice_len, (index + 1) * slice_len)
        context = cache.slice_context(0, index)
        logits = model(tokens[:, positions], positions, context)
        losses.append(logits.square().mean())
    cached_bytes = cache.nbytes
    for index in reversed(range(SLICES)):
        losses[index].backward()
        cache.release(0, index)
    return _grads(model), cached_bytes


def test_latent_kv_cache_keeps_the_latent_and_every_gradient_fp64() -> None:
    """Sliced with the chunked KV cache, the latent form's gradients equal the unsliced
    expanded model's; its cache holds (latent + RoPE) dims per token, the expanded one
    2 x heads x head_dim; without the cache's gradients (ablation) parity breaks."""
    expanded, latent = _pair()
    expanded(_tokens()).square().mean().backward()  # the mean of the slices' means
    reference = {name: grad * SLICES for name, grad in _grads(expanded).items()}
    grads, latent_bytes = _sliced_step(latent, ChunkedKVCache(backend="cpu"))
    assert _worst(grads, reference) < 1e-10
    _, expanded_bytes = _sliced_step(expanded, ChunkedKVCache(backend="cpu"))
    args = latent.args
    per_token = {
        "latent": args.kv_lora_rank + args.qk_rope_head_dim,
        "expanded": 2 * args.n_heads * max(args.per_head_dim, args.v_head_dim),
    }
    tokens = BATCH * SEQ_LEN * args.n_layers * 8  # float64
    assert latent_bytes == per_token["latent"] * tokens
    assert expanded_bytes == per_token["expanded"] * tokens
    ablated, _ = _sliced_step(latent, ChunkedKVCache(backend="cpu", drop_cached_gradients=True))
    assert _worst(ablated, reference) > 1e-3


def test_keys_that_are_values_travel_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """K/V passing gathers one tensor for keys that are their own values (and two otherwise),
    and the bytes rule counts it once."""
    gathered: list[Tensor] = []

    def one_rank_gather(tensor: Tensor, group: object) -> list[Tensor]:
        gathered.append(tensor)
        return [tensor.clone()]

    monkeypatch.setattr(context_parallel_module, "_all_gather", one_rank_gather)
    k_BGKD, v_BGKD = torch.randn(2, 1, 8, 6), torch.randn(2, 1, 8, 6)
    keys, values = gather_keys_values(k_BGKD, k_BGKD, None)
    assert len(gathered) == 1 and keys[0] is values[0]
    gathered.clear()
    gather_keys_values(k_BGKD, v_BGKD, None)
    assert len(gathered) == 2
    shape = {"slice_index": 3, "slice_tokens": 64, "cp": 2, "q_heads": 4, "head_dim": 6}
    separate = context_parallel_bytes("kv_passing", kv_heads=1, **shape)
    shared = context_parallel_bytes("kv_passing", kv_heads=1, keys_are_values=True, **shape)
    assert shared == separate / 2


def test_deepseek_v3_args_refuse_what_they_cannot_build() -> None:
    with pytest.raises(ValueError, match="attention_cache='compressed' must be one of"):
        _args("compressed")
    with pytest.raises(ValueError, match="head_dim=64 is set by qk_nope_head_dim"):
        _args("latent", head_dim=64)
    with pytest.raises(ValueError, match="first_dense_layers=2 must be in"):
        _args("latent", first_dense_layers=2)


def test_memory_plan_counts_the_latent_kv_cache() -> None:
    """The plan measures what a layer's attention caches: the latent form's bytes per token
    are (latent + RoPE) dims, the expanded form's 2 x heads x head_dim."""
    spec = get_model_spec("deepseek_v3")
    per_token = {}
    for cache in ("expanded", "latent"):
        profile = profile_activations(spec, _args(cache), torch.bfloat16)
        per_token[cache] = set(profile.kv_bytes.values())
    args = _args("latent")
    assert per_token["latent"] == {2.0 * (args.kv_lora_rank + args.qk_rope_head_dim)}
    assert per_token["expanded"] == {2.0 * 2 * args.n_heads * args.per_head_dim}


def test_ulysses_gathers_a_latent_once_instead_of_repeating_it_per_head() -> None:
    """Kv heads fewer than the cp ranks (the latent's one) are all-gathered whole, once: the
    bytes rule counts (cp-1)/cp x T x C for them, not heads x C; kv heads that neither split
    over the ranks nor divide them are refused."""
    from pipekit.attention.across.ulysses import check_ulysses_heads

    tokens, cp, heads, latent = 1024, 4, 128, 576
    shape = {"slice_index": 0, "slice_tokens": tokens, "cp": cp, "q_heads": heads}
    sent = context_parallel_bytes(
        "ulysses", kv_heads=1, head_dim=latent, keys_are_values=True, element_bytes=1, **shape
    )
    queries = (cp - 1) / cp * tokens / cp * 2 * heads * latent
    assert sent == pytest.approx(queries + (cp - 1) / cp * tokens * latent)
    with pytest.raises(ValueError, match="3 kv heads per rank on cp=2 ranks"):
        check_ulysses_heads(6, 2, 3)
