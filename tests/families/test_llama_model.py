"""The Llama model: sliced evaluation with a KV cache equals one full call (outputs and every
gradient, float64), meta-device construction, tied embeddings, and the public flavors' sizes."""

import dataclasses

import pytest
import torch
from torch import nn

from pipekit.attention.context import CausalAttention, SlicedKVCache
from pipekit.families.llama import Llama, LlamaArgs, llama_flavor

SEQ_LEN = 48
TINY = LlamaArgs(
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=50,
    ffn_dim=48,
    rope_theta=10000.0,
    rope_scaling=None,
    max_seq_len=128,
)


def _model(args=TINY, seed=0, dtype=torch.float64):
    with torch.device("meta"):
        model = Llama(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    with torch.no_grad():  # larger projections than the training init: sharp attention patterns
        for name, param in model.named_parameters():
            if name.startswith("layers") and param.dim() == 2:
                param.mul_(10)
    return model.to(dtype)


def _tokens(batch=2, seq_len=SEQ_LEN, vocab=TINY.vocab_size):
    return torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(1))


def _sliced_forward(model, tokens_BS, num_slices, context):
    slice_len = tokens_BS.shape[1] // num_slices
    logits = []
    for j in range(num_slices):
        positions = torch.arange(j * slice_len, (j + 1) * slice_len)
        logits.append(model(tokens_BS[:, j * slice_len : (j + 1) * slice_len], positions, context))
    return torch.cat(logits, dim=1)


def _loss_and_grads(model, logits_BSV, tokens_BS):
    loss = nn.functional.cross_entropy(logits_BSV[:, :-1].flatten(0, 1), tokens_BS[:, 1:].flatten())
    return loss, torch.autograd.grad(loss, list(model.parameters()))


DOCUMENTS_BS = torch.tensor([[0] * 13 + [1] * 20 + [2] * 15, [0] * 40 + [1] * 8])


@pytest.mark.parametrize("num_slices", [2, 3, 4])
@pytest.mark.parametrize("documents", [None, DOCUMENTS_BS], ids=["causal", "documents"])
def test_sliced_with_kv_cache_equals_full_sequence_fp64(num_slices, documents):
    model, tokens = _model(), _tokens()
    full = model(tokens, attention_context=CausalAttention(documents, backend="cpu"))
    sliced = _sliced_forward(model, tokens, num_slices, SlicedKVCache(documents, backend="cpu"))
    torch.testing.assert_close(sliced, full, rtol=1e-10, atol=1e-10)
    full_loss, full_grads = _loss_and_grads(model, full, tokens)
    sliced_loss, sliced_grads = _loss_and_grads(model, sliced, tokens)
    torch.testing.assert_close(sliced_loss, full_loss, rtol=1e-12, atol=1e-12)
    names = [name for name, _ in model.named_parameters()]
    for name, got, want in zip(names, sliced_grads, full_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10, msg=f"grad of {name}")


class _ForgetfulCache(SlicedKVCache):
    """Ablation: a cache that drops the earlier slices' keys and values."""

    def attend(self, layer_id, q_BHSD, k_BGSD, v_BGSD, scale, pattern=None):
        out = super().attend(layer_id, q_BHSD, k_BGSD, v_BGSD, scale)
        self.chunks[layer_id] = [(0, k[:, :, :0], v[:, :, :0]) for _, k, v in self.chunks[layer_id]]
        return out


def test_sliced_parity_breaks_without_cache_or_with_wrong_positions():
    model, tokens = _model(), _tokens()
    full = model(tokens)
    assert (
        _sliced_forward(model, tokens, 4, _ForgetfulCache(backend="cpu")) - full
    ).abs().max() > 1e-3
    cache = SlicedKVCache(backend="cpu")
    restarted = torch.cat(
        [model(tokens[:, j * 12 : (j + 1) * 12], torch.arange(12), cache) for j in range(4)], dim=1
    )
    assert (restarted - full).abs().max() > 1e-3


def test_sliced_inference_with_flex_equals_cpu_backend():
    # head_dim 32: compiled flex on CPU refuses smaller head dims
    model, tokens = _model(dataclasses.replace(TINY, dim=128), dtype=torch.float32), _tokens()
    with torch.no_grad():
        full = model(tokens, attention_context=CausalAttention(backend="cpu"))
        sliced = _sliced_forward(model, tokens, 3, SlicedKVCache(backend="flex"))
    torch.testing.assert_close(sliced, full, rtol=1e-5, atol=1e-5)


def test_hidden_state_input_skips_the_embedding():
    model, tokens = _model(), _tokens()
    torch.testing.assert_close(model(model.tok_embeddings(tokens)), model(tokens))


def test_meta_init_is_complete_and_seeded():
    model = _model(dtype=torch.float32)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    again = _model(dtype=torch.float32)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    other_seed = _model(seed=1, dtype=torch.float32)
    wq = "layers.0.attention.wq.weight"
    assert not torch.equal(other_seed.state_dict()[wq], model.state_dict()[wq])


def test_tied_embeddings_share_one_tensor_after_meta_init():
    model = _model(TINY.with_updates(tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for n, p in model.named_parameters() if n != "output.weight"
    )


def test_layers_are_keyed_by_index():
    names = set(_model().state_dict())
    assert "layers.1.attention.wq.weight" in names and "layers.0.feed_forward.w2.weight" in names


def test_positions_must_match_the_sequence():
    model, tokens = _model(), _tokens()
    with pytest.raises(ValueError, match="positions"):
        model(tokens, torch.arange(SEQ_LEN - 1))


@pytest.mark.parametrize(
    ("flavor", "num_params"),
    # Published parameter counts of Llama 3.2 1B/3B and Llama 3.1 8B/70B.
    [("1B", 1_235_814_400), ("3B", 3_212_749_824), ("8B", 8_030_261_248), ("70B", 70_553_706_496)],
)
def test_flavor_shapes_match_the_public_models(flavor, num_params):
    with torch.device("meta"):
        model = Llama(llama_flavor(flavor))
    assert sum(p.numel() for p in model.parameters()) == num_params


def test_bad_args_and_flavors_are_rejected():
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        TINY.with_updates(n_kv_heads=3)
    with pytest.raises(ValueError, match="unknown Llama flavor 'huge'"):
        llama_flavor("huge")
