"""FSDP2 data parallelism equals one process on the same global batch: loss, every gradient, the
clipped global norm and the parameters after two AdamW steps (float32), for sharding, replication
and HSDP, with untied and tied embeddings. The ablation keeps FSDP's default mean reduction and
breaks the parity by exactly the data-parallel degree."""

import pytest
import torch
import torch.distributed as dist
from tiny_models import TINY_LLAMA, tiny_llama
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from pipekit.config.job_config import ParallelismConfig
from pipekit.distributed.fsdp import apply_data_parallel
from pipekit.distributed.grad_clip import clip_grad_norm_
from pipekit.distributed.parallel_dims import ParallelDims
from pipekit.models.materialize import seeded_materializer
from pipekit.testing import run_on_ranks

GLOBAL_BATCH, SEQ_LEN, STEPS, MAX_NORM = 4, 16, 2, 0.5


def _model(tied: bool) -> nn.Module:
    return tiny_llama(seed=0, tied=tied)


def _batches() -> list[Tensor]:
    generator = torch.Generator().manual_seed(1)
    shape = (GLOBAL_BATCH, SEQ_LEN + 1)
    return [
        torch.randint(0, TINY_LLAMA.vocab_size, shape, generator=generator) for _ in range(STEPS)
    ]


def _loss(model: nn.Module, tokens_BS: Tensor, global_tokens: int) -> Tensor:
    """Sum of this rank's token losses over the global token count (pipekit's convention)."""
    logits_BSV = model(tokens_BS[:, :-1])
    token_losses = nn.functional.cross_entropy(
        logits_BSV.flatten(0, 1), tokens_BS[:, 1:].flatten(), reduction="sum"
    )
    return token_losses / global_tokens


def _full(tensor: Tensor) -> Tensor:
    """A detached copy of the whole tensor (full_tensor of a Replicate DTensor is no copy)."""
    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return full.detach().clone()


def _train(model: nn.Module, rank: int, dp_degree: int) -> dict[str, object]:
    """Two AdamW steps on this rank's share of each global batch; what the parity compares."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    per_rank = GLOBAL_BATCH // dp_degree
    result: dict[str, object] = {"losses": [], "norms": []}
    for step, tokens_BS in enumerate(_batches()):
        global_tokens = tokens_BS[:, 1:].numel()
        loss = _loss(model, tokens_BS[rank * per_rank : (rank + 1) * per_rank], global_tokens)
        loss.backward()
        loss = loss.detach()
        if dp_degree > 1:
            dist.all_reduce(loss)  # the step's loss is the sum of the ranks' shares
        if step == 0:
            result["grads"] = {name: _full(p.grad) for name, p in model.named_parameters()}
        result["losses"].append(loss.item())
        result["norms"].append(clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
    result["params"] = {name: _full(p) for name, p in model.named_parameters()}
    return result


@pytest.fixture(scope="module")
def reference() -> dict[bool, dict[str, object]]:
    """Single-process runs on the global batches, untied and tied."""
    return {tied: _train(_model(tied), rank=0, dp_degree=1) for tied in (False, True)}


def _data_parallel_run(rank: int, world_size: int, config: ParallelismConfig) -> dict:
    parallel_dims = ParallelDims.from_config(config, world_size)
    mesh = parallel_dims.build_mesh("cpu")
    assert parallel_dims.dp_rank(mesh) == rank
    results = {}
    for tied in (False, True):
        model = apply_data_parallel(_model(tied), mesh, parallel_dims)
        results[tied] = _train(model, rank, parallel_dims.dp_degree)
    ablation = apply_data_parallel(_model(False), mesh, parallel_dims, sum_gradients=False)
    results["mean_reduced"] = _train(ablation, rank, parallel_dims.dp_degree)
    return results


DATA_PARALLEL = {
    "fsdp": (2, ParallelismConfig(dp_shard=-1)),
    "replicate": (2, ParallelismConfig(dp_replicate=-1, dp_shard=1)),
    "hsdp": (4, ParallelismConfig(dp_replicate=2, dp_shard=-1)),
}


@pytest.fixture(scope="module", params=list(DATA_PARALLEL))
def data_parallel(request) -> tuple[int, list[dict]]:
    """One spawned group per layout; every check below reads its results."""
    world_size, config = DATA_PARALLEL[request.param]
    return world_size, run_on_ranks(_data_parallel_run, world_size, config, timeout=120)


def _max_relative_error(got: dict[str, Tensor], want: dict[str, Tensor]) -> float:
    assert got.keys() == want.keys()
    return max(((got[name] - want[name]).norm() / want[name].norm()).item() for name in want)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_data_parallel_equals_single_process(data_parallel, reference, tied):
    _, per_rank = data_parallel
    want = reference[tied]
    for rank, results in enumerate(per_rank):
        got = results[tied]
        for step in range(STEPS):
            loss_error = abs(got["losses"][step] - want["losses"][step]) / want["losses"][step]
            assert loss_error <= 1e-5, f"rank {rank} step {step}: loss off by {loss_error:.1e}"
            norm_error = abs(got["norms"][step] - want["norms"][step]) / want["norms"][step]
            assert norm_error <= 1e-5, f"rank {rank} step {step}: norm off by {norm_error:.1e}"
        assert _max_relative_error(got["grads"], want["grads"]) <= 1e-5
        # AdamW divides by sqrt(v): on near-zero gradients float32 summation order moves an
        # update by ~1e-4 of lr (1e-2), hence atol 1e-5 on the parameters.
        for name, param in got["params"].items():
            torch.testing.assert_close(
                param, want["params"][name], rtol=1e-5, atol=1e-5, msg=f"param {name}"
            )
    if tied:
        assert "output.weight" not in want["grads"]  # one shared parameter, not two


def test_mean_reduced_gradients_break_parity(data_parallel, reference):
    """Ablation: FSDP's default mean over dp ranks scales every gradient by 1 / dp degree."""
    world_size, per_rank = data_parallel
    want = reference[False]["grads"]
    got = per_rank[0]["mean_reduced"]["grads"]
    assert _max_relative_error(got, want) > 0.1
    for name in want:
        torch.testing.assert_close(got[name] * world_size, want[name], rtol=1e-5, atol=1e-7)


def test_clip_grad_norm_equals_torch_on_plain_tensors():
    grads = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2, 2)]
    params = [nn.Parameter(torch.zeros_like(grad)) for grad in grads]
    twins = [nn.Parameter(torch.zeros_like(grad)) for grad in grads]
    for param, twin, grad in zip(params, twins, grads, strict=True):
        param.grad, twin.grad = grad.clone(), grad.clone()
    for norm_type in (2.0, 1.0, float("inf")):
        norm = clip_grad_norm_(params, 0.3, norm_type)
        want = torch.nn.utils.clip_grad_norm_(twins, 0.3, norm_type)
        torch.testing.assert_close(norm, want)
        for param, twin in zip(params, twins, strict=True):
            torch.testing.assert_close(param.grad, twin.grad)


def test_clip_grad_norm_counts_duplicates_once_and_still_clips_them():
    """A tied weight's second copy (a pipeline holds one per stage) is scaled with the rest but
    not counted: the norm is that of the distinct parameters."""
    param, copy, other = (nn.Parameter(torch.zeros(4)) for _ in range(3))
    param.grad, copy.grad, other.grad = torch.full((4,), 3.0), torch.full((4,), 3.0), torch.ones(4)
    norm = clip_grad_norm_([param, copy, other], 1.0, duplicates=[copy])
    torch.testing.assert_close(norm, torch.tensor((4 * 9.0 + 4) ** 0.5))
    torch.testing.assert_close(copy.grad, param.grad)
    torch.testing.assert_close(param.grad, torch.full((4,), 3.0 / norm.item()))


def _tensor_split_norm(rank: int, world: int) -> tuple[float, float]:
    """Each rank: its own rows of a split parameter (rank + 1 everywhere), and a replicated one;
    the norm with the split declared, and without (the ablation)."""
    rows, shared = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))
    norms = []
    for split in (True, False):
        rows.grad, shared.grad = torch.full((3,), rank + 1.0), torch.full((2,), 2.0)
        declared = ([rows], dist.group.WORLD) if split else None
        norms.append(float(clip_grad_norm_([rows, shared], 1e9, tensor_split=declared)))
    return norms[0], norms[1]


def test_clip_grad_norm_adds_tensor_split_parameters_over_their_group():
    """Vocabulary rows split over tp ranks count once per rank's rows; replicated parameters
    once. Undeclared, each rank would see only its own rows (ranks disagreeing)."""
    per_rank = run_on_ranks(_tensor_split_norm, 2, timeout=60)
    want = (3 * 1.0 + 3 * 4.0 + 2 * 4.0) ** 0.5
    assert all(abs(split - want) < 1e-6 for split, _ in per_rank)
    assert abs(per_rank[0][1] - per_rank[1][1]) > 0.5  # undeclared: each rank its own rows


def test_one_process_materialization_keeps_tied_weights_tied() -> None:
    """Without FSDP, `to_empty` gives each registration its own tensor: the one-process job
    once trained an untied model (two weights, two optimizer states) where every sharded
    layout trained the tied one. The materializer re-ties them; plain `to_empty` does not."""
    from pipekit.families.llama import Llama

    args = TINY_LLAMA.with_updates(tie_embeddings=True)
    with torch.device("meta"):
        model = Llama(args)
    seeded_materializer("cpu", seed=0)(model)
    assert model.output.weight is model.tok_embeddings.weight
    assert len(list(model.parameters())) == len({id(p) for p in model.parameters()})
    with torch.device("meta"):
        plain = Llama(args)
    plain.to_empty(device="cpu")  # the ablation: what the materializer must undo
    assert plain.output.weight is not plain.tok_embeddings.weight
