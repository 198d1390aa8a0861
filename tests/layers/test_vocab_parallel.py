"""Vocabulary parallelism equals the full vocabulary on one process (float64, gloo, 2 and 3 ranks,
uneven shards): the cross-entropy's loss, d loss/d hidden and each rank's d loss/d weight-shard,
with ignore_index targets, a loss mask and z-loss; the embedding; tied embedding and output. The
loss's backward issues no collective and its forward exactly two all-reduces; ablations drop
either all-reduce and break the parity."""

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn import functional as F

from pipekit.layers.vocab_parallel import (
    VocabParallelEmbedding,
    VocabParallelOutput,
    vocab_parallel_cross_entropy,
    vocab_shard_range,
)
from pipekit.testing import run_on_ranks

VOCAB, DIM, BATCH, SEQ = 11, 8, 2, 5
IGNORE = -100
TOLERANCE = 1e-12
_COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather")


def _data(seed: int = 0) -> dict[str, Tensor]:
    """Full output weight, hidden states, labels with ignored targets, a fractional loss mask."""
    generator = torch.Generator().manual_seed(seed)
    labels_BS = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    labels_BS[0, 1] = labels_BS[1, 3] = IGNORE
    loss_mask_BS = torch.ones(BATCH, SEQ, dtype=torch.float64)
    loss_mask_BS[0, 4] = loss_mask_BS[1, 0] = 0.0
    loss_mask_BS[1, 2] = 0.5
    return {
        "weight_VD": torch.randn(VOCAB, DIM, generator=generator, dtype=torch.float64),
        "hidden_BSD": 3 * torch.randn(BATCH, SEQ, DIM, generator=generator, dtype=torch.float64),
        "labels_BS": labels_BS,
        "loss_mask_BS": loss_mask_BS,
    }


def _reference_loss(
    logits_BSV: Tensor, labels_BS: Tensor, loss_mask_BS: Tensor, z_loss_weight: float
) -> Tensor:
    """Masked full-vocabulary token sum (F.cross_entropy) plus z * logsumexp**2 per kept row."""
    per_token = F.cross_entropy(
        logits_BSV.flatten(0, 1), labels_BS.flatten(), ignore_index=IGNORE, reduction="none"
    ).view(labels_BS.shape)
    z_term = z_loss_weight * torch.logsumexp(logits_BSV, dim=-1).square()
    kept_BS = (labels_BS != IGNORE).to(logits_BSV.dtype) * loss_mask_BS
    return ((per_token + z_term) * kept_BS).sum()


def _reference(z_loss_weight: float) -> dict[str, Tensor]:
    data = _data()
    weight_VD = data["weight_VD"].clone().requires_grad_()
    hidden_BSD = data["hidden_BSD"].clone().requires_grad_()
    loss = _reference_loss(
        hidden_BSD @ weight_VD.T, data["labels_BS"], data["loss_mask_BS"], z_loss_weight
    )
    loss.backward()
    return {"loss": loss.detach(), "hidden_grad": hidden_BSD.grad, "weight_grad": weight_VD.grad}


def _rel_diff(actual: Tensor, expected: Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


def _sharded_loss_run(
    rank: int,
    world_size: int,
    z_loss_weight: float,
    use_mesh: bool = False,
    broken: str | None = None,
) -> dict[str, object]:
    """Output layer + cross-entropy on this rank's shard; `broken` names an all-reduce to skip."""
    data = _data()
    group = init_device_mesh("cpu", (world_size,)) if use_mesh else None
    output = VocabParallelOutput(DIM, VOCAB, group).double()
    output.load_full_weight(data["weight_VD"])
    hidden_BSD = data["hidden_BSD"].clone().requires_grad_()
    real_all_reduce = dist.all_reduce

    def all_reduce_unless_broken(tensor: Tensor, op=dist.ReduceOp.SUM, **kwargs):
        if (broken == "max" and op == dist.ReduceOp.MAX) or (
            broken == "fused" and tensor.dim() == 2 and tensor.shape[-1] == 2
        ):
            return None
        return real_all_reduce(tensor, op=op, **kwargs)

    with mock.patch.object(dist, "all_reduce", all_reduce_unless_broken):
        loss = vocab_parallel_cross_entropy(
            output(hidden_BSD),
            data["labels_BS"],
            group,
            vocab_start=output.vocab_start,
            vocab_size=VOCAB,
            loss_mask_BS=data["loss_mask_BS"],
            z_loss_weight=z_loss_weight,
        )
        loss.backward()
    return {
        "loss": loss.detach(),
        "hidden_grad": hidden_BSD.grad,
        "weight_grad": output.weight.grad,
        "rows": (output.vocab_start, output.vocab_end),
    }


def _assert_matches_reference(results: list[dict], reference: dict[str, Tensor]) -> None:
    for result in results:
        start, end = result["rows"]
        assert _rel_diff(result["loss"], reference["loss"]) <= TOLERANCE
        assert _rel_diff(result["hidden_grad"], reference["hidden_grad"]) <= TOLERANCE
        assert _rel_diff(result["weight_grad"], reference["weight_grad"][start:end]) <= TOLERANCE


def test_uneven_shards_cover_the_vocabulary() -> None:
    assert [vocab_shard_range(10, rank, 4) for rank in range(4)] == [
        (0, 3),
        (3, 6),
        (6, 8),
        (8, 10),
    ]
    assert [vocab_shard_range(VOCAB, rank, 3) for rank in range(3)] == [(0, 4), (4, 8), (8, 11)]
    explicit = [vocab_shard_range(10, rank, 3, shard_sizes=[5, 1, 4]) for rank in range(3)]
    assert explicit == [(0, 5), (5, 6), (6, 10)]


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_loss_and_grads_equal_full_vocabulary_fp64(world_size: int) -> None:
    results = run_on_ranks(_sharded_loss_run, world_size, 0.0)
    _assert_matches_reference(results, _reference(z_loss_weight=0.0))


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_z_loss_equals_logsumexp_reference_fp64(world_size: int) -> None:
    results = run_on_ranks(_sharded_loss_run, world_size, 0.1)
    _assert_matches_reference(results, _reference(z_loss_weight=0.1))


def test_accepts_a_1d_device_mesh() -> None:
    results = run_on_ranks(_sharded_loss_run, 2, 0.1, True)
    _assert_matches_reference(results, _reference(z_loss_weight=0.1))


@pytest.mark.parametrize("broken", ["fused", "max"])
def test_skipping_an_all_reduce_breaks_parity(broken: str) -> None:
    """Without the fused sum each rank sees only its shard's softmax; without the global max the
    ranks' exponentials are summed on different scales."""
    results = run_on_ranks(_sharded_loss_run, 3, 0.0, False, broken)
    reference = _reference(z_loss_weight=0.0)
    assert max(_rel_diff(result["loss"], reference["loss"]) for result in results) > 1e-3


def _count_collectives_run(rank: int, world_size: int, reduce_input_grad: bool) -> dict[str, int]:
    """How many collectives the forward and the backward of output + loss issue."""
    data = _data()
    output = VocabParallelOutput(DIM, VOCAB, reduce_input_grad=reduce_input_grad).double()
    hidden_BSD = data["hidden_BSD"].clone().requires_grad_()
    counts = {"forward": 0, "backward": 0}
    phase = "forward"

    def counting(real):
        def collective(*args, **kwargs):
            counts[phase] += 1
            return real(*args, **kwargs)

        return collective

    patches = [
        mock.patch.object(dist, name, counting(getattr(dist, name))) for name in _COLLECTIVES
    ]
    for patch in patches:
        patch.start()
    try:
        loss = vocab_parallel_cross_entropy(
            output(hidden_BSD),
            data["labels_BS"],
            vocab_start=output.vocab_start,
            loss_mask_BS=data["loss_mask_BS"],
            z_loss_weight=0.1,
        )
        phase = "backward"
        loss.backward()
    finally:
        for patch in patches:
            patch.stop()
    return counts


def test_loss_backward_issues_no_collective_and_forward_two() -> None:
    assert run_on_ranks(_count_collectives_run, 2, False) == [{"forward": 2, "backward": 0}] * 2
    # reduce_input_grad adds the one all-reduce of d hidden, in the matmul's backward
    assert run_on_ranks(_count_collectives_run, 2, True) == [{"forward": 2, "backward": 1}] * 2


def _embedding_run(rank: int, world_size: int) -> dict[str, object]:
    data = _data()
    ids_BS = data["labels_BS"].clamp(min=0)
    grad_BSD = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(5)).double()
    embedding = VocabParallelEmbedding(VOCAB, DIM).double()
    embedding.load_full_weight(data["weight_VD"])
    embedded_BSD = embedding(ids_BS)
    embedded_BSD.backward(grad_BSD)  # the same (replicated) gradient on every rank
    partial = VocabParallelEmbedding(VOCAB, DIM, reduce=False).double()
    partial.load_full_weight(data["weight_VD"])
    return {
        "embedded": embedded_BSD.detach(),
        "partial": partial(ids_BS).detach(),
        "weight_grad": embedding.weight.grad,
        "rows": (embedding.vocab_start, embedding.vocab_end),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_embedding_equals_nn_embedding_fp64(world_size: int) -> None:
    data = _data()
    ids_BS = data["labels_BS"].clamp(min=0)
    reference = nn.Embedding(VOCAB, DIM).double()
    with torch.no_grad():
        reference.weight.copy_(data["weight_VD"])
    embedded_BSD = reference(ids_BS)
    embedded_BSD.backward(
        torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(5)).double()
    )
    results = run_on_ranks(_embedding_run, world_size)
    for result in results:
        start, end = result["rows"]
        assert torch.equal(result["embedded"], embedded_BSD.detach())
        assert torch.equal(result["weight_grad"], reference.weight.grad[start:end])
    # reduce=False: the partial sums add up to the embedding
    assert torch.equal(sum(result["partial"] for result in results), embedded_BSD.detach())


def _tied_forward(embed, project, ids_BS: Tensor) -> Tensor:
    """A toy tied language model: embed, a nonlinearity, project onto the vocabulary."""
    return project(torch.tanh(embed(ids_BS)))


def _tied_run(rank: int, world_size: int) -> dict[str, object]:
    data = _data()
    ids_BS = data["labels_BS"].clamp(min=0)
    embedding = VocabParallelEmbedding(VOCAB, DIM).double()
    embedding.load_full_weight(data["weight_VD"])
    output = VocabParallelOutput(DIM, VOCAB, weight=embedding.weight)
    assert output.weight is embedding.weight
    loss = vocab_parallel_cross_entropy(
        _tied_forward(embedding, output, ids_BS),
        ids_BS.roll(1, dims=1),
        vocab_start=output.vocab_start,
        loss_mask_BS=data["loss_mask_BS"],
        z_loss_weight=0.1,
    )
    loss.backward()
    return {
        "loss": loss.detach(),
        "weight_grad": embedding.weight.grad,
        "rows": (embedding.vocab_start, embedding.vocab_end),
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_tied_embedding_and_output_grads_add_up_fp64(world_size: int) -> None:
    data = _data()
    ids_BS = data["labels_BS"].clamp(min=0)
    weight_VD = data["weight_VD"].clone().requires_grad_()
    logits_BSV = _tied_forward(lambda ids: weight_VD[ids], lambda h: h @ weight_VD.T, ids_BS)
    loss = _reference_loss(logits_BSV, ids_BS.roll(1, dims=1), data["loss_mask_BS"], 0.1)
    loss.backward()
    for result in run_on_ranks(_tied_run, world_size):
        start, end = result["rows"]
        assert _rel_diff(result["loss"], loss.detach()) <= TOLERANCE
        assert _rel_diff(result["weight_grad"], weight_VD.grad[start:end]) <= TOLERANCE


def test_bfloat16_logits_keep_float32_statistics() -> None:
    """One rank, no process group: the loss is float32, the logits' gradient bfloat16."""
    data = _data()
    logits_BSV = (data["hidden_BSD"] @ data["weight_VD"].T).bfloat16().requires_grad_()
    loss = vocab_parallel_cross_entropy(logits_BSV, data["labels_BS"], vocab_start=0)
    loss.backward()
    upcast_BSV = logits_BSV.detach().float().requires_grad_()
    reference = F.cross_entropy(
        upcast_BSV.flatten(0, 1), data["labels_BS"].flatten(), reduction="sum"
    )
    reference.backward()
    assert loss.dtype == torch.float32 and logits_BSV.grad.dtype == torch.bfloat16
    assert _rel_diff(loss, reference) <= 1e-6
    # Both gradients are float32 rounded to bfloat16; float32 round-off (which varies with the
    # CPU's vector width) can put them one bfloat16 step apart, 2^-7 of the value at most.
    torch.testing.assert_close(
        logits_BSV.grad.float(), upcast_BSV.grad.bfloat16().float(), rtol=2**-7, atol=0
    )


def test_per_token_losses_with_reduction_none() -> None:
    data = _data()
    logits_BSV = data["hidden_BSD"] @ data["weight_VD"].T
    per_token_BS = vocab_parallel_cross_entropy(
        logits_BSV, data["labels_BS"], vocab_start=0, reduction="none"
    )
    expected_BS = F.cross_entropy(
        logits_BSV.flatten(0, 1), data["labels_BS"].flatten(), reduction="none"
    ).view(BATCH, SEQ)
    assert per_token_BS.shape == (BATCH, SEQ)
    assert _rel_diff(per_token_BS, expected_BS) <= TOLERANCE


def test_second_backward_through_the_loss_is_refused() -> None:
    """The backward reuses the saved softmax in place; torch's saved-tensor check catches reuse."""
    logits_BSV = torch.randn(BATCH, SEQ, VOCAB, dtype=torch.float64, requires_grad=True)
    loss = vocab_parallel_cross_entropy(logits_BSV, _data()["labels_BS"], vocab_start=0)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace operation"):
        loss.backward()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: vocab_shard_range(10, 0, 3, shard_sizes=[3, 3, 3]), "sum to vocab_size=10"),
        (lambda: vocab_shard_range(10, 0, 3, shard_sizes=[5, 5]), "2 entries for a group of 3"),
        (lambda: vocab_shard_range(10, 0, 2, shard_sizes=[11, -1]), "must be positive"),
        (lambda: vocab_shard_range(2, 0, 3), "smaller than the group's 3 ranks"),
        (lambda: vocab_shard_range(10, 3, 3), "rank=3 is outside"),
        (lambda: VocabParallelEmbedding(10, 4, shard_sizes=[9]), "sum to vocab_size=10"),
        (
            lambda: VocabParallelOutput(4, 10, weight=nn.Parameter(torch.empty(10, 3))),
            r"needs \(10, 4\)",
        ),
        (
            lambda: vocab_parallel_cross_entropy(
                torch.zeros(2, 5, 4), torch.zeros(2, 4, dtype=torch.long), vocab_start=0
            ),
            "do not match the logits' leading dims",
        ),
        (
            lambda: vocab_parallel_cross_entropy(
                torch.zeros(2, 5, 4), torch.zeros(2, 5, dtype=torch.long), vocab_start=-1
            ),
            "vocab_start=-1 must be >= 0",
        ),
        (
            lambda: vocab_parallel_cross_entropy(
                torch.zeros(2, 5, 4),
                torch.zeros(2, 5, dtype=torch.long),
                vocab_start=8,
                vocab_size=10,
            ),
            "ends past vocab_size=10",
        ),
        (
            lambda: vocab_parallel_cross_entropy(
                torch.zeros(2, 5, 4),
                torch.zeros(2, 5, dtype=torch.long),
                vocab_start=0,
                loss_mask_BS=torch.ones(5),
            ),
            "loss_mask of shape",
        ),
        (
            lambda: vocab_parallel_cross_entropy(
                torch.zeros(2, 5, 4),
                torch.zeros(2, 5, dtype=torch.long),
                vocab_start=0,
                reduction="mean",
            ),
            "use 'sum' or 'none'",
        ),
    ],
)
def test_user_errors_name_the_value_and_the_fix(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
