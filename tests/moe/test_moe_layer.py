"""Single-process MoE: routers, capacity, losses, grouped matmuls, partitions and restores."""

from __future__ import annotations

import math

import pytest
import torch
from moe_reference import DIM, EXPERTS, reference_moe_forward, small_moe

from pipekit.moe import MoE, MoEArgs, aux_loss_scale
from pipekit.moe.aux_loss import importance_cv2_loss, router_z_loss, switch_balance_loss
from pipekit.moe.execution import ExpertExecution
from pipekit.moe.grouped_mm import grouped_kernel_applies, grouped_matmul, grouped_weight_grad
from pipekit.moe.restore import RESTORE_STRATEGIES, RestoreStrategy
from pipekit.moe.routers import build_router
from pipekit.moe.routing import expert_capacity

ROUTER_CASES = [
    ("topk_softmax", 2, None),
    ("topk_softmax", 2, 0.5),
    ("softmax_topk", 2, 0.75),
    ("noisy_topk", 2, None),
    ("switch", 1, 1.0),
    ("expert_choice", 2, 1.5),
]


def _loss_and_grads(
    moe: MoE, x_BSD: torch.Tensor, forward, seed: int = 1
) -> dict[str, torch.Tensor]:
    moe.zero_grad()
    x_BSD = x_BSD.detach().requires_grad_()
    torch.manual_seed(seed)  # the noisy router draws its noise here
    out_BSD = forward(moe, x_BSD)
    upstream = torch.linspace(-1, 1, out_BSD.numel(), dtype=out_BSD.dtype).view_as(out_BSD)
    loss = (out_BSD * upstream).sum()
    loss.backward()
    grads = {name: param.grad.clone() for name, param in moe.named_parameters()}
    return {"loss": loss.detach(), "x": x_BSD.grad, **grads}


def _reference(moe: MoE, x_BSD: torch.Tensor) -> dict[str, torch.Tensor]:
    experts = moe.experts
    return _loss_and_grads(
        moe,
        x_BSD,
        lambda m, x: reference_moe_forward(m, x, experts.w1_EFD, experts.w3_EFD, experts.w2_EDF),
    )


def _assert_close(actual: dict, expected: dict, tol: float = 1e-10) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize(("router", "top_k", "capacity"), ROUTER_CASES)
@pytest.mark.parametrize(
    ("partitions", "strategy"), [(1, "none"), (3, "none"), (3, "S1"), (4, "S4")]
)
def test_moe_matches_assignment_by_assignment_reference_fp64(
    router: str, top_k: int, capacity: float | None, partitions: int, strategy: str
) -> None:
    moe = small_moe(router, top_k, capacity)
    moe.execution = ExpertExecution(partitions=partitions, memory_reuse=strategy)
    x_BSD = torch.randn(2, 9, DIM, dtype=torch.float64)
    expected = _reference(moe, x_BSD)
    _assert_close(_loss_and_grads(moe, x_BSD, MoE.forward), expected)
    assert any(grad.abs().sum() > 0 for name, grad in expected.items() if "gate" in name)


@pytest.mark.parametrize("strategy", sorted(RESTORE_STRATEGIES))
def test_every_restore_strategy_gives_identical_gradients(strategy: str) -> None:
    moe = small_moe("topk_softmax", 2, None)
    x_BSD = torch.randn(3, 8, DIM, dtype=torch.float64)
    moe.execution = ExpertExecution(partitions=1, memory_reuse="none")
    expected = _loss_and_grads(moe, x_BSD, MoE.forward)
    moe.execution = ExpertExecution(partitions=4, memory_reuse=strategy)
    _assert_close(_loss_and_grads(moe, x_BSD, MoE.forward), expected)


def test_keeping_views_of_shared_buffers_breaks_gradients() -> None:
    """Ablation: share the partition buffers but restore nothing; later partitions overwrite."""
    moe = small_moe("topk_softmax", 2, None)
    x_BSD = torch.randn(3, 8, DIM, dtype=torch.float64)
    expected = _reference(moe, x_BSD)
    moe.execution = ExpertExecution(partitions=4, memory_reuse="S4")
    moe.execution._restore_strategy = lambda *args: RestoreStrategy("shared", "keep", "keep")
    actual = _loss_and_grads(moe, x_BSD, MoE.forward)
    torch.testing.assert_close(actual["loss"], expected["loss"], rtol=1e-10, atol=1e-10)
    assert (actual["experts.w1_EFD"] - expected["experts.w1_EFD"]).abs().max() > 1e-3


def test_capacity_drops_the_lowest_probability_tokens_which_get_zero() -> None:
    router = build_router("topk_softmax", DIM, EXPERTS, 1, capacity_factor=1.0).double()
    router.gate.weight.data.zero_()
    router.gate.weight.data[0, 0] = 1.0  # expert 0 wins every token with x[:, 0] > 0
    x_TD = torch.zeros(8, DIM, dtype=torch.float64)
    x_TD[:, 0] = torch.arange(1.0, 9.0, dtype=torch.float64)
    routing = router(x_TD)
    capacity = expert_capacity(8, EXPERTS, 1, 1.0)
    assert capacity == 2
    assert routing.tokens_per_expert_E.tolist() == [2, 0, 0, 0]
    assert routing.token_index_A.tolist() == [6, 7]  # the two most confident tokens
    moe = small_moe("topk_softmax", 1, 1.0)
    moe.router = router
    out_TD = moe(x_TD[None])[0]
    assert out_TD[:6].abs().max() == 0 and out_TD[6:].abs().min() > 0


def test_dropless_keeps_every_choice_and_expert_choice_is_balanced() -> None:
    x_TD = torch.randn(16, DIM, dtype=torch.float64)
    dropless = build_router("softmax_topk", DIM, EXPERTS, 2, None).double()
    assert dropless(x_TD).token_index_A.numel() == 32
    expert_choice = build_router("expert_choice", DIM, EXPERTS, 1, 2.0).double()
    routing = expert_choice(x_TD)
    assert routing.tokens_per_expert_E.tolist() == [8] * EXPERTS


def test_mixtral_weights_sum_to_one_and_softmax_topk_weights_do_not() -> None:
    x_TD = torch.randn(16, DIM, dtype=torch.float64)
    for name, sums_to_one in (("topk_softmax", True), ("softmax_topk", False)):
        router = build_router(name, DIM, EXPERTS, 2, None).double()
        routing = router(x_TD)
        per_token = torch.zeros(16, dtype=torch.float64).index_add(
            0, routing.token_index_A, routing.weight_A
        )
        assert torch.allclose(per_token, torch.ones(16, dtype=torch.float64)) == sums_to_one


def test_balance_losses_follow_their_definitions() -> None:
    router = build_router("topk_softmax", DIM, EXPERTS, 2, None).double()
    x_TD = torch.randn(32, DIM, dtype=torch.float64)
    routing = router(x_TD)
    probs_TE = torch.softmax(routing.logits_TE, -1)
    top_TK = torch.topk(routing.logits_TE, 2, -1).indices
    fraction_E = torch.bincount(top_TK.reshape(-1), minlength=EXPERTS) / 64
    expected = EXPERTS * (fraction_E * probs_TE.mean(0)).sum()
    torch.testing.assert_close(switch_balance_loss(routing), expected)
    importance_E = torch.zeros(EXPERTS, dtype=torch.float64)
    for expert, weight in zip(routing.expert_index_A, routing.weight_A, strict=True):
        importance_E[expert] += weight
    cv = importance_E.std(unbiased=False) / importance_E.mean()
    torch.testing.assert_close(importance_cv2_loss(routing), cv**2)
    torch.testing.assert_close(
        router_z_loss(routing), (torch.logsumexp(routing.logits_TE, -1) ** 2).mean()
    )
    router.gate.weight.data.zero_()  # uniform probabilities: switch loss is exactly 1
    uniform = router(x_TD)
    assert math.isclose(float(switch_balance_loss(uniform).detach()), 1.0, rel_tol=1e-12)


def test_aux_loss_reaches_the_router_scaled_by_the_context() -> None:
    moe = small_moe("topk_softmax", 2, None, load_balance_weight=0.5)
    x_BSD = torch.randn(2, 6, DIM, dtype=torch.float64)
    routing = moe.router(x_BSD.reshape(-1, DIM))
    aux = 0.5 * switch_balance_loss(routing) + 0.001 * router_z_loss(routing)
    (aux_grad,) = torch.autograd.grad(aux, moe.router.gate.weight)
    grads = []
    for scale in (1.0, 0.25):
        moe.zero_grad()
        with aux_loss_scale(scale):
            out = moe(x_BSD)
        (out * 0).sum().backward()  # only the auxiliary losses have a gradient
        grads.append(moe.router.gate.weight.grad.clone())
    torch.testing.assert_close(grads[0], aux_grad)
    torch.testing.assert_close(grads[1], 0.25 * aux_grad)
    moe.eval()
    moe.zero_grad()
    (moe(x_BSD) * 0).sum().backward()
    assert moe.router.gate.weight.grad.abs().max() == 0


def test_grouped_kernel_equals_per_expert_loop_fp32() -> None:
    counts = [3, 0, 5, 8]
    x_AI = torch.randn(16, 8)
    w_EIO = torch.randn(4, 8, 12)
    b_AO = torch.randn(16, 12)
    assert grouped_kernel_applies(x_AI, w_EIO)
    loop_mm = torch.cat(
        [
            x_AI[s : s + c] @ w_EIO[e]
            for e, (s, c) in enumerate(zip([0, 3, 3, 8], counts, strict=True))
        ]
    )
    torch.testing.assert_close(grouped_matmul(x_AI, w_EIO, counts), loop_mm)
    fallback = grouped_matmul(x_AI.double(), w_EIO.double(), counts)  # float64: the loop
    torch.testing.assert_close(fallback, loop_mm.double(), rtol=1e-5, atol=1e-5)
    grad = grouped_weight_grad(x_AI, b_AO, counts)
    assert grad[1].abs().max() == 0
    torch.testing.assert_close(grad[3], x_AI[8:].t() @ b_AO[8:])
    torch.testing.assert_close(
        grouped_weight_grad(x_AI.double(), b_AO.double(), counts),
        grad.double(),
        rtol=1e-5,
        atol=1e-5,
    )


def test_bad_moe_arguments_name_the_fix() -> None:
    with pytest.raises(ValueError, match="known routers"):
        MoEArgs(router="hash")
    with pytest.raises(ValueError, match="routes each token to 1 expert"):
        build_router("switch", DIM, EXPERTS, 2, None)
    with pytest.raises(ValueError, match="needs a capacity_factor"):
        build_router("expert_choice", DIM, EXPERTS, 1, None)
    with pytest.raises(ValueError, match="partitions"):
        ExpertExecution(partitions=0)
    with pytest.raises(ValueError, match="memory-reuse strategy"):
        ExpertExecution(memory_reuse="S5")


def test_bfloat16_activations_run_the_experts_in_bfloat16() -> None:
    """Mixed precision: float32 router scores and weights meet bf16 activations."""
    moe = small_moe("topk_softmax", 2, None).float()
    moe.eval()
    x_BSD = torch.randn(2, 8, DIM).to(torch.bfloat16)
    out_BSD = moe(x_BSD.requires_grad_())
    out_BSD.float().sum().backward()
    assert out_BSD.dtype == torch.bfloat16 and x_BSD.grad.dtype == torch.bfloat16
    expected = moe(x_BSD.detach().float())
    torch.testing.assert_close(out_BSD.float(), expected, rtol=5e-2, atol=2e-2)


@pytest.mark.parametrize("memory_reuse", ["auto", "S3"])
def test_automatic_partitions_work_inside_activation_checkpointing(memory_reuse: str) -> None:
    """Algorithm 1's trials run a backward inside the layer's forward; under a checkpoint they
    must not unpack through its hooks (that recomputes the block inside its own forward)."""
    from torch.utils.checkpoint import checkpoint

    moe = small_moe("noisy_topk", 2, None)
    x_BSD = torch.randn(2, 9, DIM, dtype=torch.float64)
    expected = _reference(moe, x_BSD)
    moe.execution = ExpertExecution(partitions="auto", memory_reuse=memory_reuse)
    actual = _loss_and_grads(
        moe, x_BSD, lambda m, x: checkpoint(m, x, use_reentrant=False, preserve_rng_state=True)
    )
    _assert_close(actual, expected)
    assert moe.execution.granularity.trials_run >= 2
