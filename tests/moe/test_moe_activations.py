"""Expert activations (SwiGLU, GeGLU, plain GELU): the hand-written expert backward against a
per-expert autograd loop in float64, on one rank, pipelined, and expert-parallel."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from moe_reference import DIM, EXPERTS, small_moe
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from pipekit.moe import EXPERT_ACTIVATIONS, MoE, MoEArgs
from pipekit.moe.execution import ExpertExecution
from pipekit.moe.expert_parallel import apply_expert_parallel
from pipekit.moe.experts import GroupedExperts
from pipekit.testing import run_on_ranks

REFERENCE_FORMS: dict[str, tuple[Callable[[Tensor], Tensor], bool]] = {
    "swiglu": (F.silu, True),
    "geglu": (lambda gate: F.gelu(gate, approximate="tanh"), True),
    "gelu": (F.gelu, False),
    "swiglu_clamped": (
        lambda gate: gate.clamp(max=7.0) * torch.sigmoid(1.702 * gate.clamp(max=7.0)),
        True,
    ),
}
"""(act, gated) of each activation, written independently of `pipekit.moe.activations`."""
UP_FORMS: dict[str, Callable[[Tensor], Tensor]] = {
    "swiglu_clamped": lambda up: up.clamp(-7.0, 7.0) + 1
}
"""The transform of the up projection of the activations that have one (gpt-oss's)."""


def _moe(activation: str) -> MoE:
    """The tests' float64 MoE, without auxiliary losses (the reference has none)."""
    return small_moe(
        "topk_softmax", 2, None, z_loss_weight=0.0, load_balance_weight=0.0, activation=activation
    )


def _per_expert_reference(moe: MoE, x_BSD: Tensor) -> Tensor:
    """The layer's output by plain autograd, expert by expert, from the full weights."""
    act, gated = REFERENCE_FORMS[moe.args.activation]
    experts = moe.experts
    x_TD = x_BSD.reshape(-1, DIM)
    routing = moe.router(x_TD)
    out_TD = torch.zeros_like(x_TD)
    for expert in range(EXPERTS):
        mine_A = routing.expert_index_A == expert
        tokens = routing.token_index_A[mine_A]
        rows_AD = x_TD[tokens]
        hidden_AF = act(rows_AD @ experts.w1_EFD[expert].T)
        if gated:
            up = UP_FORMS.get(moe.args.activation, lambda up_AF: up_AF)
            hidden_AF = hidden_AF * up(rows_AD @ experts.w3_EFD[expert].T)
        expert_AD = hidden_AF @ experts.w2_EDF[expert].T
        out_TD = out_TD.index_add(0, tokens, expert_AD * routing.weight_A[mine_A, None])
    return out_TD.view_as(x_BSD)


def _loss(out_BSD: Tensor) -> Tensor:
    upstream = torch.linspace(-1, 1, out_BSD.numel(), dtype=out_BSD.dtype).view_as(out_BSD)
    return (out_BSD * upstream).sum()


def _loss_and_grads(moe: MoE, x_BSD: Tensor, forward) -> dict[str, Tensor]:
    moe.zero_grad()
    x_BSD = x_BSD.detach().requires_grad_()
    loss = _loss(forward(moe, x_BSD))
    loss.backward()
    grads = {name: param.grad.clone() for name, param in moe.named_parameters()}
    return {"loss": loss.detach(), "x": x_BSD.grad, **grads}


def _assert_close(actual: dict, expected: dict, tol: float = 1e-10) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("activation", sorted(EXPERT_ACTIVATIONS))
@pytest.mark.parametrize(
    ("partitions", "memory_reuse"),
    [(1, "none"), (3, "none"), (3, "S1"), (3, "S2"), (3, "S3"), (4, "S4"), ("auto", "auto")],
)
def test_expert_backward_equals_per_expert_autograd_fp64(
    activation: str, partitions: int | str, memory_reuse: str
) -> None:
    moe = _moe(activation)
    x_BSD = torch.randn(2, 9, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = _loss_and_grads(moe, x_BSD, _per_expert_reference)
    moe.execution = ExpertExecution(partitions=partitions, memory_reuse=memory_reuse)
    _assert_close(_loss_and_grads(moe, x_BSD, MoE.forward), expected)
    assert all(grad.abs().max() > 0 for grad in expected.values())


@pytest.mark.parametrize(("activation", "wrong"), [("geglu", "swiglu"), ("gelu", "geglu")])
def test_another_activations_derivative_breaks_parity(activation: str, wrong: str) -> None:
    """Ablation: the forward right, the backward through another activation's derivative."""
    moe = _moe(activation)
    x_BSD = torch.randn(2, 9, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = _loss_and_grads(moe, x_BSD, _per_expert_reference)
    moe.experts.activation = dataclasses.replace(
        moe.experts.activation, backward=EXPERT_ACTIVATIONS[wrong].backward
    )
    moe.execution = ExpertExecution(partitions=3, memory_reuse="S3")
    actual = _loss_and_grads(moe, x_BSD, MoE.forward)
    torch.testing.assert_close(actual["loss"], expected["loss"], rtol=1e-10, atol=1e-10)
    with pytest.raises(AssertionError):
        _assert_close(actual, expected)
    for name in ("x", "experts.w1_EFD"):  # wrong by far more than rounding (1e-3 at least)
        assert (actual[name] - expected[name]).abs().max() > 1e-4, name


def test_plain_experts_have_no_up_projection_and_gated_names_stay() -> None:
    names = {
        activation: list(GroupedExperts(DIM, 12, EXPERTS, activation).state_dict())
        for activation in EXPERT_ACTIVATIONS
    }
    assert names["swiglu"] == names["geglu"] == ["w1_EFD", "w3_EFD", "w2_EDF"]
    assert names["gelu"] == ["w1_EFD", "w2_EDF"]
    moe = MoE(DIM, 12, MoEArgs(num_experts=EXPERTS), activation="gelu")
    assert moe.args.activation == "gelu" and moe.experts.w3_EFD is None
    assert MoE(DIM, 12, MoEArgs(num_experts=EXPERTS)).experts.activation.name == "swiglu"


def test_unknown_activation_names_the_known_ones() -> None:
    for build in (
        lambda: MoEArgs(activation="relu"),
        lambda: GroupedExperts(DIM, 12, EXPERTS, "silu"),
        lambda: MoE(DIM, 12, MoEArgs(), activation="reglu"),
    ):
        with pytest.raises(ValueError, match=r"\['geglu', 'gelu', 'swiglu', 'swiglu_clamped'\]"):
            build()


def _rank_input(rank: int) -> Tensor:
    return torch.randn(
        2, 7 + rank, DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(rank)
    )


def _expert_parallel_run(rank: int, world_size: int, activation: str) -> dict[str, Tensor]:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    moe = _moe(activation)
    apply_expert_parallel(moe, mesh, partitions=2, memory_reuse="S4")
    result = _loss_and_grads(moe, _rank_input(rank), MoE.forward)
    return {
        name: grad.to_local() if isinstance(grad, DTensor) else grad
        for name, grad in result.items()
    }


@pytest.mark.parametrize("activation", ["geglu", "gelu"])
def test_expert_parallel_activation_matches_reference_fp64(activation: str) -> None:
    results = run_on_ranks(_expert_parallel_run, 2, activation)
    moe = _moe(activation)
    references = [_loss_and_grads(moe, _rank_input(rank), _per_expert_reference) for rank in (0, 1)]
    for result, reference in zip(results, references, strict=True):
        _assert_close(
            {k: result[k] for k in ("loss", "x")}, {k: reference[k] for k in ("loss", "x")}
        )
    for name in references[0]:
        if name in ("loss", "x"):
            continue
        expected = references[0][name] + references[1][name]
        # Experts: each rank holds its half; the replicated router's gradients sum over ranks.
        join = torch.cat if name.startswith("experts.") else sum
        actual = join([result[name] for result in results])
        torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10, msg=name)
