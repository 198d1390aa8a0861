"""gpt-oss's MoE blocks: expert biases, a router bias and the clamped SwiGLU.

The layer equals transformers' `GptOssMLP` on the same weights; its hand-written expert backward
(one rank, pipelined with every memory reuse, expert-parallel) equals plain autograd of an
assignment-by-assignment reference in float64, biases included; the activation's backward equals
autograd on both sides of its clamps. Each parity has an ablation that breaks it.

Legend: T tokens, A assignments, E experts, D model dim, F expert hidden dim, X F or D.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from moe_reference import DIM, EXPERTS, small_moe
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import pipekit.moe.pipelined as pipelined_module
from pipekit.layers.swiglu import gated_grads
from pipekit.moe import EXPERT_ACTIVATIONS, ExpertActivation, MoE, MoEArgs
from pipekit.moe import experts as experts_module
from pipekit.moe.activations import SWIGLU_ALPHA, SWIGLU_LIMIT
from pipekit.moe.execution import ExpertExecution
from pipekit.moe.expert_parallel import apply_expert_parallel
from pipekit.testing import run_on_ranks

CLAMPED = EXPERT_ACTIVATIONS["swiglu_clamped"]
GPT_OSS_ARGS = {
    "expert_biases": True,
    "router_bias": True,
    "activation": "swiglu_clamped",
    "load_balance_weight": 0.0,
}
"""MoEArgs of a gpt-oss layer besides its router, the default "topk_softmax" (and no auxiliary
loss: the references have none)."""


def _reference_hidden(gate: Tensor, up: Tensor) -> Tensor:
    """gpt-oss's clamped SwiGLU, written from its definition (not from pipekit.moe)."""
    gate = gate.clamp(max=7.0)
    return (up.clamp(-7.0, 7.0) + 1) * gate * torch.sigmoid(1.702 * gate)


# -- against transformers --------------------------------------------------------------------------


def _copy_gpt_oss_weights(moe: MoE, hf_mlp: torch.nn.Module) -> None:
    """HF's fused `gate_up_proj` [E, D, 2F] holds the gate in even columns, the up in odd."""
    hf, experts = hf_mlp.experts, moe.experts
    with torch.no_grad():
        experts.w1_EFD.copy_(hf.gate_up_proj[:, :, ::2].transpose(1, 2))
        experts.w3_EFD.copy_(hf.gate_up_proj[:, :, 1::2].transpose(1, 2))
        experts.w2_EDF.copy_(hf.down_proj.transpose(1, 2))
        experts.b1_EF.copy_(hf.gate_up_proj_bias[:, ::2])
        experts.b3_EF.copy_(hf.gate_up_proj_bias[:, 1::2])
        experts.b2_ED.copy_(hf.down_proj_bias)
        moe.router.gate.weight.copy_(hf_mlp.router.weight)
        moe.router.gate.bias.copy_(hf_mlp.router.bias)


def gpt_oss_difference(activation: str = "swiglu_clamped") -> float:
    """Max |pipekit MoE - transformers' GptOssMLP| in float32 on the same weights, its inputs
    beyond the clamps on every side; `activation` replaces gpt-oss's (ablation)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    dim, hidden, experts, top_k = 16, 12, 4, 2
    config = GptOssConfig(
        hidden_size=dim,
        intermediate_size=hidden,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
    )
    assert (config.swiglu_limit, config.swiglu_alpha) == (SWIGLU_LIMIT, SWIGLU_ALPHA)
    generator = torch.Generator().manual_seed(0)
    hf_mlp = GptOssMLP(config).float()
    with torch.no_grad():  # gate/up of std ~6: many beyond the clamp limit of 7
        for param, std in zip(hf_mlp.experts.parameters(), (1.5, 1.0, 0.05, 0.1), strict=True):
            param.copy_(torch.randn(param.shape, generator=generator) * std)
        for param in hf_mlp.router.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    args = MoEArgs(num_experts=experts, top_k=top_k, router="topk_softmax", **GPT_OSS_ARGS)
    moe = MoE(dim, hidden, args, activation=activation)
    _copy_gpt_oss_weights(moe, hf_mlp)
    x_BSD = torch.randn(2, 24, dim, generator=generator)
    with torch.no_grad():
        expected_BSD, _ = hf_mlp(x_BSD)
        actual_BSD = moe(x_BSD)
        x_TD = x_BSD.reshape(-1, dim)
        routing = moe.router(x_TD)
        rows_AD, expert_A = x_TD[routing.token_index_A], routing.expert_index_A
        gate_AF = torch.einsum("ad,afd->af", rows_AD, moe.experts.w1_EFD[expert_A])
        up_AF = torch.einsum("ad,afd->af", rows_AD, moe.experts.w3_EFD[expert_A])
        gate_AF += moe.experts.b1_EF[expert_A]
        up_AF += moe.experts.b3_EF[expert_A]
    # the routed assignments pass every clamp, and stay inside them too
    assert (gate_AF > SWIGLU_LIMIT).any() and (gate_AF < SWIGLU_LIMIT).any()
    assert (up_AF > SWIGLU_LIMIT).any() and (up_AF < -SWIGLU_LIMIT).any()
    assert (up_AF.abs() < SWIGLU_LIMIT).any()
    return (actual_BSD - expected_BSD).abs().max().item()


def test_moe_equals_transformers_gpt_oss_mlp_fp32() -> None:
    assert gpt_oss_difference() <= 1e-5
    assert gpt_oss_difference("swiglu") > 1.0  # ablation: the same weights, no clamps


# -- the activation's hand-written backward --------------------------------------------------------

EDGE = (-12.0, -7.5, -7.0, -6.9, -2.0, -0.3, 0.4, 3.0, 6.9, 7.0, 7.1, 12.0)
"""Points on both sides of the clamps (-7 for the up, 7 for both) and on them (none where a
factor of the product is 0: up = -1, gate = 0)."""


def _activation_grads(
    activation: ExpertActivation, gate: Tensor, up: Tensor, grad: Tensor
) -> tuple[Tensor, Tensor]:
    """(d gate, d up) of `activation.hidden(gate, up)` by the expert backward's chain rule
    (`gated_grads` on the transformed up, then back through the transform)."""
    transformed = activation.transformed_up(up)
    grad_gate, grad_transformed, _ = gated_grads(
        grad, gate, transformed, activation.value, activation.backward
    )
    return grad_gate, activation.up_grad(grad_transformed, up)


def _edge_inputs() -> tuple[Tensor, Tensor, Tensor]:
    """Every (gate, up) pair of EDGE points, and an upstream gradient, as `[A, 1]` columns."""
    points = torch.tensor(EDGE, dtype=torch.float64)
    gate, up = torch.meshgrid(points, points, indexing="ij")
    grad = torch.linspace(-1.5, 2.0, gate.numel(), dtype=torch.float64)
    return gate.reshape(-1, 1), up.reshape(-1, 1), grad.reshape(-1, 1)


def activation_differences() -> dict[str, float]:
    """Max |hand-written - autograd| of the clamped SwiGLU's forward and gradients."""
    gate, up, grad = _edge_inputs()
    leaves = [gate.clone().requires_grad_(), up.clone().requires_grad_()]
    reference = _reference_hidden(*leaves)
    expected = torch.autograd.grad(reference, leaves, grad)
    actual = _activation_grads(CLAMPED, gate, up, grad)
    # zero exactly where a clamp holds (strictly beyond the limit: torch's clamp passes the
    # gradient at the limit), and nowhere else
    assert torch.equal(actual[0] == 0, gate > SWIGLU_LIMIT)
    assert torch.equal(actual[1] == 0, up.abs() > SWIGLU_LIMIT)
    pairs = {"forward": (CLAMPED.hidden(gate, up), reference), "gate": (actual[0], expected[0])}
    pairs["up"] = (actual[1], expected[1])
    return {name: (a - e).abs().max().item() for name, (a, e) in pairs.items()}


def test_clamped_swiglu_backward_equals_autograd_on_both_sides_of_the_clamps_fp64() -> None:
    differences = activation_differences()
    assert max(differences.values()) < 1e-14, differences


def _unmasked_gate_backward(grad: Tensor, gate: Tensor) -> Tensor:
    """The gate's derivative at the clamped value, its mask forgotten (ablation)."""
    return torch.ops.aten.silu_backward(grad, SWIGLU_ALPHA * gate.clamp(max=SWIGLU_LIMIT))


@pytest.mark.parametrize("ablation", ["gate", "up"])
def test_ignoring_a_clamps_gradient_mask_breaks_the_backward(ablation: str) -> None:
    """Ablation: the gate's derivative taken through its clamp, or the up's mask dropped."""
    if ablation == "gate":
        broken = dataclasses.replace(CLAMPED, backward=_unmasked_gate_backward)
    else:
        broken = dataclasses.replace(CLAMPED, up_backward=None)
    gate, up, grad = _edge_inputs()
    expected = _activation_grads(CLAMPED, gate, up, grad)
    actual = _activation_grads(broken, gate, up, grad)
    index = 0 if ablation == "gate" else 1
    assert (actual[index] - expected[index]).abs().max() > 1e-2


# -- the layer's gradients: one rank, pipelined, expert-parallel -----------------------------------


def _gpt_oss_moe(num_shared_experts: int = 0) -> MoE:
    """The tests' float64 MoE as gpt-oss's: gate/up weights scaled so that some gate and up
    values pass the clamps, every bias non-zero."""
    moe = small_moe(
        "topk_softmax", 2, None, z_loss_weight=0.0, num_shared_experts=num_shared_experts,
        **GPT_OSS_ARGS,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        moe.experts.w1_EFD.mul_(8.0)
        moe.experts.w3_EFD.mul_(8.0)
        for name, param in moe.named_parameters():
            if param.dim() == 1 or name.startswith("experts.b"):
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return moe


def _reference_forward(moe: MoE, x_BSD: Tensor) -> Tensor:
    """The layer by plain autograd, assignment by assignment, from the full weights."""
    experts = moe.experts
    x_TD = x_BSD.reshape(-1, DIM)
    routing = moe.router(x_TD)
    rows_AD, expert_A = x_TD[routing.token_index_A], routing.expert_index_A
    gate_AF = torch.einsum("ad,afd->af", rows_AD, experts.w1_EFD[expert_A])
    up_AF = torch.einsum("ad,afd->af", rows_AD, experts.w3_EFD[expert_A])
    hidden_AF = _reference_hidden(
        gate_AF + experts.b1_EF[expert_A], up_AF + experts.b3_EF[expert_A]
    )
    out_AD = torch.einsum("af,adf->ad", hidden_AF, experts.w2_EDF[expert_A])
    out_AD = out_AD + experts.b2_ED[expert_A]
    out_TD = torch.zeros_like(x_TD).index_add(
        0, routing.token_index_A, out_AD * routing.weight_A[:, None]
    )
    shared = moe.shared_experts
    if shared is not None:
        hidden_TH = _reference_hidden(shared.w1(x_TD), shared.w3(x_TD))
        out_TD = out_TD + hidden_TH @ shared.w2.weight.T + shared.w2.bias
    return out_TD.view_as(x_BSD)


def _loss_and_grads(moe: MoE, x_BSD: Tensor, forward) -> dict[str, Tensor]:
    moe.zero_grad()
    x_BSD = x_BSD.detach().requires_grad_()
    out_BSD = forward(moe, x_BSD)
    upstream = torch.linspace(-1, 1, out_BSD.numel(), dtype=out_BSD.dtype).view_as(out_BSD)
    loss = (out_BSD * upstream).sum()
    loss.backward()
    grads = {
        name: param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad.clone()
        for name, param in moe.named_parameters()
    }
    return {"loss": loss.detach(), "x": x_BSD.grad, **grads}


def _max_differences(actual: dict, expected: dict) -> dict[str, float]:
    assert actual.keys() == expected.keys()
    return {name: (actual[name] - expected[name]).abs().max().item() for name in expected}


def _input(seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, 9, DIM, dtype=torch.float64, generator=generator)


def pipelined_differences(
    partitions: int | str, memory_reuse: str, shared: int
) -> dict[str, float]:
    """Max |layer - plain autograd| of the loss and every gradient, on one rank."""
    moe = _gpt_oss_moe(shared)
    x_BSD = _input(1)
    expected = _loss_and_grads(moe, x_BSD, _reference_forward)
    assert "experts.b3_EF" in expected and "router.gate.bias" in expected
    assert all(grad.abs().max() > 0 for grad in expected.values())
    moe.execution = ExpertExecution(partitions=partitions, memory_reuse=memory_reuse)
    return _max_differences(_loss_and_grads(moe, x_BSD, MoE.forward), expected)


PIPELINE_CASES = [
    (1, "none", 1),
    (3, "none", 0),
    (3, "S1", 0),
    (3, "S2", 1),
    (3, "S3", 0),
    (4, "S4", 0),
    ("auto", "auto", 0),
]
"""(partitions, memory reuse, shared experts): one rank unpipelined, then MPipeMoE's
strategies (S3 and S4 recompute T_M, biases included), and Algorithm 1's trials."""


@pytest.mark.parametrize(("partitions", "memory_reuse", "shared"), PIPELINE_CASES)
def test_pipelined_experts_match_plain_autograd_fp64(
    partitions: int | str, memory_reuse: str, shared: int
) -> None:
    differences = pipelined_differences(partitions, memory_reuse, shared)
    assert max(differences.values()) < 1e-10, differences


def _recompute_without_biases(*args, out=None, biases=None) -> Tensor:
    """`expert_middle` that drops the biases when it recomputes T_M (out None) (ablation)."""
    return _EXPERT_MIDDLE(*args, out=out, biases=None if out is None else biases)


_EXPERT_MIDDLE = pipelined_module.expert_middle


@pytest.mark.parametrize("ablation", ["bias_recompute", "up_mask"])
def test_pipelined_ablations_break_parity(ablation: str, monkeypatch) -> None:
    """Ablation: the recomputed T_M (S4) forgets the biases, or the up's clamp mask is dropped."""
    moe = _gpt_oss_moe()
    x_BSD = _input(1)
    expected = _loss_and_grads(moe, x_BSD, _reference_forward)
    if ablation == "bias_recompute":
        monkeypatch.setattr(pipelined_module, "expert_middle", _recompute_without_biases)
        moe.execution = ExpertExecution(partitions=4, memory_reuse="S4")
    else:
        moe.experts.activation = dataclasses.replace(CLAMPED, up_backward=None)
        moe.execution = ExpertExecution(partitions=3, memory_reuse="S1")
    differences = _max_differences(_loss_and_grads(moe, x_BSD, MoE.forward), expected)
    assert differences["loss"] < 1e-10  # the forward is right: only the backward is broken
    assert differences["experts.w3_EFD"] > 1e-3, differences


_ROW_SUM = experts_module.grouped_row_sum


def _zero_row_sum(x_AX: Tensor, counts_E: list[int]) -> Tensor:
    """Bias gradients dropped (ablation)."""
    return _ROW_SUM(x_AX, counts_E) * 0


def _expert_parallel_runs(rank: int, world_size: int) -> list[dict[str, Tensor]]:
    """On one gloo group: the EP layer (pipelined, S4), then the same with the bias gradients
    dropped (ablation)."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    results = []
    for drop_bias_grads in (False, True):
        moe = _gpt_oss_moe()
        apply_expert_parallel(moe, mesh, partitions=2, memory_reuse="S4")
        for bias in (moe.experts.b1_EF, moe.experts.b3_EF, moe.experts.b2_ED):
            assert isinstance(bias, DTensor) and bias.to_local().shape[0] == EXPERTS // world_size
        if drop_bias_grads:
            experts_module.grouped_row_sum = _zero_row_sum
        try:
            results.append(_loss_and_grads(moe, _input(10 + rank), MoE.forward))
        finally:
            experts_module.grouped_row_sum = _ROW_SUM
    return results


def _expert_parallel_differences(results: list[dict], references: list[dict]) -> dict[str, float]:
    """Max differences: per-rank loss and input gradient; experts joined over the ranks' blocks,
    the replicated router's gradients summed (as data parallelism would)."""
    differences = {
        key: max(
            (result[key] - ref[key]).abs().max().item()
            for result, ref in zip(results, references, strict=True)
        )
        for key in ("loss", "x")
    }
    for name in references[0].keys() - {"loss", "x"}:
        expected = sum(ref[name] for ref in references)
        join = torch.cat if name.startswith("experts.") else sum
        actual = join([result[name] for result in results])
        differences[name] = (actual - expected).abs().max().item()
    return differences


def expert_parallel_differences() -> tuple[dict[str, float], dict[str, float]]:
    """(max differences of the EP layer, of its ablation) against plain autograd, 2 ranks."""
    per_rank = run_on_ranks(_expert_parallel_runs, 2)
    moe = _gpt_oss_moe()
    references = [_loss_and_grads(moe, _input(10 + rank), _reference_forward) for rank in (0, 1)]
    return tuple(
        _expert_parallel_differences([runs[run] for runs in per_rank], references) for run in (0, 1)
    )


def test_expert_parallel_matches_plain_autograd_fp64_and_needs_bias_grads() -> None:
    right, dropped = expert_parallel_differences()
    assert max(right.values()) < 1e-10, right
    for name in ("experts.b1_EF", "experts.b3_EF", "experts.b2_ED"):
        assert dropped[name] > 1e-3, (name, dropped)
    assert dropped["experts.w1_EFD"] < 1e-10  # only the biases' gradients were dropped


# -- wiring ----------------------------------------------------------------------------------------


def test_biases_are_zero_initialised_and_only_where_asked() -> None:
    moe = MoE(DIM, 12, MoEArgs(num_experts=EXPERTS, **GPT_OSS_ARGS))
    moe.reset_parameters(0.02)
    shapes = {name: tuple(param.shape) for name, param in moe.named_parameters()}
    assert shapes["experts.b1_EF"] == shapes["experts.b3_EF"] == (EXPERTS, 12)
    assert shapes["experts.b2_ED"] == (EXPERTS, DIM) and shapes["router.gate.bias"] == (EXPERTS,)
    biases = [p for name, p in moe.named_parameters() if name.endswith(("_EF", "_ED", ".bias"))]
    assert len(biases) == 4 and all(bias.abs().max() == 0 for bias in biases)
    plain = MoE(DIM, 12, MoEArgs(num_experts=EXPERTS, activation="gelu", expert_biases=True))
    assert plain.experts.b3_EF is None and plain.experts.b1_EF is not None
    default = MoE(DIM, 12, MoEArgs(num_experts=EXPERTS))
    assert list(default.experts.state_dict()) == ["w1_EFD", "w3_EFD", "w2_EDF"]
    assert default.router.gate.bias is None
