"""DeepSeek-V3's MoE pieces: the sigmoid router, shared experts, the sequence-wise balance loss
and auxiliary-loss-free bias balancing.

The router is held to DeepSeek-V3's routing as Hugging Face transformers implements it (or, where
that class is missing, to a hand-written reference of the paper's description). The bias update
is held to the one a single process makes on the whole batch: under data, expert and sliced
pipeline parallelism (on gloo ranks) every rank's biases must equal it exactly, since they are
sign steps of integer counts; without the all-reduce of the loads over the stage's ranks they
do not. The bias is a checkpointed float32 buffer, so a resumed or bf16 model routes as the one
that trained it. Every check comes with an ablation that breaks the mechanism it relies on and
shows the check then fails.

Legend: B rows, S sequence, T tokens, D model dim, E experts, K experts per token, F expert
hidden dim.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from pipekit.attention.context import CausalAttention
from pipekit.families.llama_moe.args import llama_moe_flavor
from pipekit.layers.loss import count_label_tokens, token_sum_cross_entropy
from pipekit.models import get_model_spec
from pipekit.moe import MoE, MoEArgs, Routing
from pipekit.moe import routers as routers_module
from pipekit.moe.aux_loss import aux_loss_scale, sequence_balance_loss, switch_balance_loss
from pipekit.moe.bias_balance import balanced_routers, discard_expert_loads, update_expert_biases
from pipekit.moe.routers import SigmoidTopKRouter, build_router, check_group_limits
from pipekit.testing import (
    build_model,
    data_parallel_model,
    parity_batch,
    pipeline_layout,
    reference_step,
    run_on_ranks,
    runner_step,
)

SPEC = get_model_spec("llama_moe")
ARGS = llama_moe_flavor("debug_balanced").with_updates(
    dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=61, ffn_dim=64, max_seq_len=64
)
"""4 layers, MoE in layers 1 and 3: 8 sigmoid-routed experts in 4 groups (best 2), 1 shared."""
ROWS, SEQ_LEN, SEED = 4, 32, 3
BATCH = parity_batch(ARGS.vocab_size, rows=ROWS, seq_len=SEQ_LEN)
SLICED = {"pipeline_schedule": "sliced", "num_slices": 4, "microbatches": 2}

HF_ROUTER = {"dim": 16, "experts": 8, "top_k": 2, "groups": 4, "topk_groups": 2, "scaling": 2.5}
"""The small DeepSeek-V3 router both implementations build."""


# --- 1. the sigmoid router against DeepSeek-V3's routing ------------------------------------


def _hand_deepseek_router(
    x_TD: Tensor, weight_ED: Tensor, bias_E: Tensor, top_k: int, groups: int, topk_groups: int,
    scaling: float,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """DeepSeek-V3's routing from its description: sigmoid scores; choice = score + bias; a
    group's score the sum of its 2 best choices; top-k within the best `topk_groups` groups;
    weights the chosen scores over their sum times `scaling`. (weights_TK, indices_TK)."""
    scores_TE = torch.sigmoid(x_TD @ weight_ED.t())
    choice_TE = scores_TE + bias_E
    choice_TGX = choice_TE.view(x_TD.shape[0], groups, -1)
    best_groups_TG = choice_TGX.topk(2, dim=-1).values.sum(-1).topk(topk_groups, dim=-1).indices
    allowed_TG = torch.zeros(x_TD.shape[0], groups, dtype=torch.bool)
    allowed_TG.scatter_(1, best_groups_TG, True)
    allowed_TE = allowed_TG.repeat_interleave(choice_TGX.shape[-1], dim=1)
    indices_TK = choice_TE.masked_fill(~allowed_TE, float("-inf")).topk(top_k, dim=-1).indices
    weights_TK = scores_TE.gather(1, indices_TK)
    return weights_TK / weights_TK.sum(-1, keepdim=True) * scaling, indices_TK


def _reference_routing(x_TD: Tensor, weight_ED: Tensor, bias_E: Tensor) -> Tensor:
    """`weights_TE` (0 where not chosen) of transformers' DeepseekV3TopkRouter, or of the hand
    reference where this transformers has none."""
    spec = HF_ROUTER
    try:
        module = importlib.import_module("transformers.models.deepseek_v3.modeling_deepseek_v3")
    except ImportError:
        module = None
    hf_router_class = getattr(module, "DeepseekV3TopkRouter", None)
    if hf_router_class is None:
        weights_TK, indices_TK = _hand_deepseek_router(
            x_TD, weight_ED, bias_E, spec["top_k"], spec["groups"], spec["topk_groups"],
            spec["scaling"],
        )  # fmt: skip
    else:
        config_class = importlib.import_module(
            "transformers.models.deepseek_v3.configuration_deepseek_v3"
        ).DeepseekV3Config
        config = config_class(
            n_routed_experts=spec["experts"], num_experts_per_tok=spec["top_k"],
            n_group=spec["groups"], topk_group=spec["topk_groups"],
            routed_scaling_factor=spec["scaling"], norm_topk_prob=True, hidden_size=spec["dim"],
        )  # fmt: skip
        hf_router = hf_router_class(config)
        with torch.no_grad():
            hf_router.weight.copy_(weight_ED)
            hf_router.e_score_correction_bias.copy_(bias_E)
            _, weights_TK, indices_TK = hf_router(x_TD)
    return torch.zeros(x_TD.shape[0], spec["experts"]).scatter_(1, indices_TK, weights_TK)


def _pipekit_router(weight_ED: Tensor, bias_E: Tensor, **changes: Any) -> SigmoidTopKRouter:
    spec = HF_ROUTER
    options = {"num_groups": spec["groups"], "topk_groups": spec["topk_groups"]} | changes
    router = SigmoidTopKRouter(
        spec["dim"], spec["experts"], spec["top_k"], None,
        routed_scaling=spec["scaling"], **options,
    )  # fmt: skip
    with torch.no_grad():
        router.gate.weight.copy_(weight_ED)
        router.expert_bias.copy_(bias_E)
    return router


def _dense_weights(routing: Routing, num_tokens: int) -> Tensor:
    """`weights_TE`: each assignment's weight at (token, expert), 0 elsewhere."""
    weights_TE = torch.zeros(num_tokens, routing.num_experts, dtype=routing.weight_A.dtype)
    weights_TE[routing.token_index_A, routing.expert_index_A] = routing.weight_A.detach()
    return weights_TE


def _router_inputs(seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """float32 tokens, a gate spread enough that groups and biases decide, a nonzero bias."""
    generator = torch.Generator().manual_seed(seed)
    x_TD = torch.randn(512, HF_ROUTER["dim"], generator=generator)
    weight_ED = 0.3 * torch.randn(HF_ROUTER["experts"], HF_ROUTER["dim"], generator=generator)
    bias_E = 0.1 * torch.randn(HF_ROUTER["experts"], generator=generator)
    return x_TD, weight_ED, bias_E


@pytest.mark.parametrize("shift", [0.0, -1.0], ids=["bias", "negative_bias"])
def test_sigmoid_router_matches_deepseek_v3_routing(
    shift: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same experts per token and the same weights (<= 1e-6) as DeepSeek-V3's router. The
    shifted case (every bias - 1, so every choice is negative) is the same routing, since only
    differences of choices matter: it fails if the experts of the groups a token may not use are
    masked to 0 instead of -inf (ablation)."""
    x_TD, weight_ED, bias_E = _router_inputs(seed=0)
    bias_E = bias_E + shift
    want_TE = _reference_routing(x_TD, weight_ED, bias_E)
    got_TE = _dense_weights(_pipekit_router(weight_ED, bias_E)(x_TD), x_TD.shape[0])
    assert torch.equal(got_TE != 0, want_TE != 0)
    assert (got_TE - want_TE).abs().max().item() <= 1e-6
    assert torch.equal((want_TE != 0).sum(-1), torch.full((x_TD.shape[0],), 2))

    # Ablation: masking the other groups' experts to 0 picks them once choices are negative.
    original = routers_module._within_best_groups
    monkeypatch.setattr(
        routers_module,
        "_within_best_groups",
        lambda choice_TE, *groups: original(choice_TE, *groups).nan_to_num(neginf=0.0),
    )
    zero_masked_TE = _dense_weights(_pipekit_router(weight_ED, bias_E)(x_TD), x_TD.shape[0])
    assert torch.equal(zero_masked_TE != 0, want_TE != 0) == (shift == 0.0)


def test_groups_and_bias_change_choices_but_weights_are_the_scores() -> None:
    """Ablations of the reference check: without groups the choices differ for some token (the
    groups matter on these inputs); the bias moves choices, yet the weights stay the sigmoid
    scores of the chosen experts, normalised and scaled, never score + bias."""
    x_TD, weight_ED, bias_E = _router_inputs(seed=0)
    want_TE = _reference_routing(x_TD, weight_ED, bias_E)
    ungrouped = _pipekit_router(weight_ED, bias_E, num_groups=1, topk_groups=1)
    ungrouped_TE = _dense_weights(ungrouped(x_TD), x_TD.shape[0])
    assert not torch.equal(ungrouped_TE != 0, want_TE != 0)

    biased_TE = _dense_weights(_pipekit_router(weight_ED, bias_E)(x_TD), x_TD.shape[0])
    unbiased = _pipekit_router(weight_ED, torch.zeros_like(bias_E))
    unbiased_TE = _dense_weights(unbiased(x_TD), x_TD.shape[0])
    assert not torch.equal(biased_TE != 0, unbiased_TE != 0)

    chosen_TE = biased_TE != 0
    scores_TE = torch.sigmoid(x_TD @ weight_ED.t())
    for values_TE, should_match in ((scores_TE, True), (scores_TE + bias_E, False)):
        picked_TE = values_TE * chosen_TE
        formula_TE = picked_TE / picked_TE.sum(-1, keepdim=True) * HF_ROUTER["scaling"]
        assert ((formula_TE - biased_TE).abs().max().item() <= 1e-6) == should_match


# --- 2. refusals ---------------------------------------------------------------------------


def test_group_limits_and_moe_args_refuse_in_one_line() -> None:
    """Each impossible setting is a one-line ValueError that names the setting."""
    cases = [
        (lambda: check_group_limits(8, 2, 3, 1), "num_groups=3 must divide"),
        (lambda: check_group_limits(8, 2, 4, 0), "topk_groups=0 must be between"),
        (lambda: check_group_limits(8, 2, 4, 5), "topk_groups=5 must be between"),
        (lambda: check_group_limits(8, 3, 4, 1), "top_k=3 experts cannot be picked"),
        (lambda: build_router("sigmoid_topk", 8, 8, 3, None, num_groups=4), "top_k=3"),
        (lambda: MoEArgs(router="sigmoid_topk", num_groups=3), "num_groups=3"),
        (lambda: MoEArgs(router="sigmoid_topk", num_groups=4, topk_groups=5), "topk_groups=5"),
        (lambda: MoEArgs(router="sigmoid_topk", top_k=4, num_groups=4), "top_k=4"),
        (lambda: MoEArgs(router="sigmoid_topk", bias_update_rate=-1e-3), "bias_update_rate"),
        (lambda: MoEArgs(num_groups=2), "num_groups apply to router='sigmoid_topk' only"),
        (
            lambda: MoEArgs(router="switch", top_k=1, routed_scaling=2.0, bias_update_rate=1e-3),
            "routed_scaling, bias_update_rate apply to router='sigmoid_topk' only",
        ),
        (lambda: MoEArgs(num_shared_experts=-1), "num_shared_experts=-1"),
    ]
    for make, message in cases:
        with pytest.raises(ValueError, match=message) as error:
            make()
        assert "\n" not in str(error.value), str(error.value)
    # The same options are fine where they apply, and other routers get none of them.
    args = MoEArgs(router="sigmoid_topk", num_groups=4, topk_groups=1, routed_scaling=2.5)
    assert args.router_options()["routed_scaling"] == 2.5
    assert MoEArgs().router_options() == {}


# --- 3. shared experts ---------------------------------------------------------------------


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_shared_experts_add_one_dense_ffn_of_their_total_width(activation: str) -> None:
    """MoE with 2 shared experts = the same MoE without them + a dense FFN of hidden 2F from
    `shared_experts.w1/w2/w3`, computed by hand; its gradients reach the shared weights and
    leave the routed ones' as they were. The shared output is far from 0 (else the equality
    would not tell that it is added)."""
    dim, hidden = 8, 12
    args = MoEArgs(router="sigmoid_topk", num_groups=4, topk_groups=2, activation=activation)
    torch.manual_seed(0)
    shared = MoE(dim, hidden, MoEArgs(**{**vars(args), "num_shared_experts": 2})).double()
    shared.reset_parameters(0.3, 0.3)
    plain = MoE(dim, hidden, args).double()
    missing, unexpected = plain.load_state_dict(shared.state_dict(), strict=False)
    assert not missing and unexpected and all("shared_experts." in k for k in unexpected)
    ffn = shared.shared_experts
    assert ffn is not None and ffn.w1.weight.shape == (2 * hidden, dim)
    assert (ffn.w3 is None) == (activation == "gelu")

    x_BSD = torch.randn(2, 5, dim, dtype=torch.float64)
    w1_HD = ffn.w1.weight.detach().clone().requires_grad_()
    w2_DH = ffn.w2.weight.detach().clone().requires_grad_()
    w3_HD = None if ffn.w3 is None else ffn.w3.weight.detach().clone().requires_grad_()
    if w3_HD is None:
        hidden_BSH = F.gelu(x_BSD @ w1_HD.t())
    else:
        hidden_BSH = F.silu(x_BSD @ w1_HD.t()) * (x_BSD @ w3_HD.t())
    dense_BSD = hidden_BSH @ w2_DH.t()

    upstream_BSD = torch.linspace(-1, 1, x_BSD.numel(), dtype=x_BSD.dtype).view_as(x_BSD)
    out_BSD, plain_BSD = shared(x_BSD), plain(x_BSD)
    assert (out_BSD - (plain_BSD + dense_BSD)).abs().max().item() <= 1e-12
    assert (out_BSD - plain_BSD).abs().max().item() > 1e-2
    for output in (out_BSD, plain_BSD, dense_BSD):
        (output * upstream_BSD).sum().backward()

    hand = {"w1": w1_HD, "w2": w2_DH, "w3": w3_HD}
    for name, param in ffn.named_parameters():
        want = hand[name.split(".")[0]].grad
        assert param.grad is not None and param.grad.abs().max().item() > 0
        assert (param.grad - want).abs().max().item() <= 1e-12, name
    plain_grads = dict(plain.named_parameters())
    for name, param in shared.named_parameters():
        if not name.startswith("shared_experts."):
            assert torch.allclose(param.grad, plain_grads[name].grad, rtol=0, atol=1e-12), name


# --- 4. the sequence-wise balance loss -----------------------------------------------------


def _sequence_router(top_k: int = 2) -> SigmoidTopKRouter:
    """4 experts, the gate reading dims 0-3: a token along e_i + e_j picks experts i and j."""
    router = SigmoidTopKRouter(8, 4, top_k, None).double()
    with torch.no_grad():
        router.gate.weight.copy_(3.0 * torch.eye(4, 8, dtype=torch.float64))
    return router


def test_sequence_balance_loss_is_the_mean_of_per_row_switch_losses() -> None:
    """On rows routed differently (row 0 to experts 0-1, row 1 to 2-3, row 2 anywhere) the
    sequence loss is the mean of each row's switch loss computed on its own routing; the
    whole-batch switch loss, balanced overall, is much smaller (ablation: a loss that did not
    keep the rows apart would not see their imbalance)."""
    generator = torch.Generator().manual_seed(0)
    x_BSD = 0.3 * torch.randn(3, 10, 8, dtype=torch.float64, generator=generator)
    x_BSD[0, :, :2] += 2.0
    x_BSD[1, :, 2:4] += 2.0
    router = _sequence_router()
    x_TD = x_BSD.reshape(-1, 8)
    routing = router(x_TD)
    per_row = torch.stack([switch_balance_loss(router(row_SD)) for row_SD in x_BSD]).mean()
    sequence = sequence_balance_loss(routing, rows=3)
    assert (sequence - per_row).abs().item() <= 1e-12
    assert sequence.item() - switch_balance_loss(routing).item() > 0.1
    whole = sequence_balance_loss(routing, rows=1) - switch_balance_loss(routing)
    assert whole.abs().item() <= 1e-12


def test_moe_layer_applies_the_sequence_loss_per_row() -> None:
    """The MoE layer hands the loss its rows: the router's gradient from the attached aux loss
    (the output's gradient 0) is that of the per-row loss, not of the one over all rows."""
    generator = torch.Generator().manual_seed(1)
    x_BSD = 0.3 * torch.randn(3, 10, 8, dtype=torch.float64, generator=generator)
    x_BSD[0, :, :2] += 2.0
    x_BSD[1, :, 2:4] += 2.0
    args = MoEArgs(router="sigmoid_topk", num_experts=4, load_balance="sequence")
    moe = MoE(8, 6, MoEArgs(**{**vars(args), "load_balance_weight": 1.0})).double()
    moe.reset_parameters(0.3, 0.3)
    with torch.no_grad():
        moe.router.gate.weight.copy_(_sequence_router().gate.weight)
    (moe(x_BSD) * 0.0).sum().backward()
    got_ED = moe.router.gate.weight.grad

    def loss_gradient(rows: int) -> Tensor:
        router = _sequence_router()
        sequence_balance_loss(router(x_BSD.reshape(-1, 8)), rows=rows).backward()
        return router.gate.weight.grad

    assert got_ED is not None and got_ED.abs().max().item() > 1e-6
    assert (got_ED - loss_gradient(rows=3)).abs().max().item() <= 1e-12
    assert (got_ED - loss_gradient(rows=1)).abs().max().item() > 1e-4


# --- 5. bias balancing, the same under every layout ---------------------------------------


def _router_state(model: nn.Module) -> dict[str, Tensor]:
    """Every balanced router's bias and load, by its name in the whole model."""
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, SigmoidTopKRouter) and module.bias_update_rate > 0:
            state[f"{name}.expert_bias"] = module.expert_bias.clone()
            state[f"{name}.expert_load"] = module.expert_load.clone()
    return state


def _update_with_and_without_group(
    model: nn.Module, group: dist.ProcessGroup | None
) -> dict[str, dict[str, Tensor]]:
    """The update over `group` (the trainer's), and, from the same loads and biases, the one
    each rank makes alone (ablation, group None); the state before and after each."""
    counted = _router_state(model)
    before = {router: (router.expert_bias.clone(), router.expert_load.clone())
              for router in balanced_routers(model)}  # fmt: skip
    update_expert_biases(model, None)
    alone = _router_state(model)
    for router, (bias_E, load_E) in before.items():
        router.expert_bias.copy_(bias_E)
        router.expert_load.copy_(load_E)
    update_expert_biases(model, group)
    return {"grouped": _router_state(model), "alone": alone, "counted": counted}


def _data_parallel_update(rank: int, world: int, ep: int) -> dict[str, dict[str, Tensor]]:
    """One FSDP2 (+ expert-parallel) step on this data rank's rows, then the bias update over
    the ranks of the stage: the trainer's `dp_cp_tp` mesh."""
    model, dims, mesh = data_parallel_model(world, SPEC, ARGS, ep=ep, seed=SEED)
    rows = ROWS // dims.dp_degree
    part = BATCH[dims.dp_rank(mesh) * rows : (dims.dp_rank(mesh) + 1) * rows]
    with aux_loss_scale(1.0 / dims.dp_degree):
        logits = model(part["tokens"], part["positions"], CausalAttention(part["document_ids"]))
    token_sum_cross_entropy(logits, part["labels"], count_label_tokens(BATCH["labels"])).backward()
    return _update_with_and_without_group(model, dims.mesh("dp_cp_tp").get_group())


def _pipeline_update(
    rank: int, world: int, dp_shard: int, ep: int, activation_checkpoint: str = "none"
) -> dict[str, Any]:
    """One sliced-pipeline step (pp = world / dp_shard), then the update over the ranks of this
    rank's stage (the trainer's `dp_cp_tp` mesh; none with pipeline ranks only)."""
    runner, dims, mesh = pipeline_layout(
        world, SPEC, ARGS, BATCH.batch_size, seed=SEED, dp_shard=dp_shard, ep=ep,
        activation_checkpoint=activation_checkpoint, **SLICED,
    )  # fmt: skip
    data_group = dims.mesh("dp_shard").get_group() if dp_shard > 1 else None
    runner_step(runner, BATCH, data_rank=dims.dp_rank(mesh), data_group=data_group)
    group = dims.mesh("dp_cp_tp").get_group() if dims.has_mesh("dp_cp_tp") else None
    assert (group is None) == (dp_shard == 1)
    assert runner.model is not None
    return _update_with_and_without_group(runner.model, group)


def _two_rank_layouts(rank: int, world: int) -> dict[str, Any]:
    """Data parallel 2, expert parallel 2 over the 2 data ranks, the sliced pipeline pp 2, and
    that pipeline with every block recomputed in backward (its routers count every token twice:
    a uniform factor, which the sign step ignores)."""
    return {
        "dp2": _data_parallel_update(rank, world, ep=1),
        "dp2_ep2": _data_parallel_update(rank, world, ep=2),
        "pp2_sliced": _pipeline_update(rank, world, dp_shard=1, ep=1),
        "pp2_sliced_recompute": _pipeline_update(
            rank, world, dp_shard=1, ep=1, activation_checkpoint="full"
        ),
    }


def _four_rank_layout(rank: int, world: int) -> dict[str, Any]:
    """pp 2 x (dp 2 with ep 2), sliced."""
    return {"pp2_dp2_ep2_sliced": _pipeline_update(rank, world, dp_shard=2, ep=2)}


def _reference_update() -> tuple[nn.Module, dict[str, Tensor], dict[str, Tensor]]:
    """One process: the whole batch in one step, then the update; the model, its routers'
    state after the update, and their loads before it."""
    model = build_model(SPEC, ARGS, SEED, torch.float64)
    assert all(router.expert_bias.abs().max() == 0 for router in balanced_routers(model))
    reference_step(SPEC, ARGS, BATCH, model=model)
    counted = {k: v for k, v in _router_state(model).items() if k.endswith("expert_load")}
    update_expert_biases(model)
    return model, _router_state(model), counted


def test_bias_update_is_identical_under_every_layout() -> None:
    """After one step the biases of every router on every rank (data parallel 2, ep 2, the
    sliced pipeline pp 2 with 2 microbatches x 4 slices, with and without recomputing its
    blocks, and pp 2 x dp 2 x ep 2) EQUAL those of one process on the whole batch, and are
    nonzero; the loads are cleared. Ablation: each data rank updating from its own loads alone
    gets other biases on some rank."""
    _, reference, reference_loads = _reference_update()
    reference_biases = {k: v for k, v in reference.items() if k.endswith("expert_bias")}
    assert len(reference_biases) == 2  # layers 1 and 3
    assert all(bias_E.abs().max() > 0 for bias_E in reference_biases.values())
    assert all(v.abs().max() == 0 for k, v in reference.items() if k.endswith("expert_load"))

    per_rank = run_on_ranks(_two_rank_layouts, 2, timeout=120)
    per_rank += run_on_ranks(_four_rank_layout, 4, timeout=120)
    seen: dict[str, set[str]] = {}
    for results in per_rank:
        for layout, states in results.items():
            grouped = states["grouped"]
            for name, value in grouped.items():
                seen.setdefault(layout, set()).add(name)
                if name.endswith("expert_load"):
                    assert value.abs().max() == 0, (layout, name)
                else:
                    assert torch.equal(value, reference[name]), (layout, name, value)
    for layout, names in seen.items():  # every router of the model is on some rank
        assert names == set(reference), (layout, names)
    assert set(seen) == {
        "dp2", "dp2_ep2", "pp2_sliced", "pp2_sliced_recompute", "pp2_dp2_ep2_sliced"
    }  # fmt: skip

    # The counts themselves: the data ranks' add up to the whole batch's; a pipeline stage sees
    # every token, twice when its blocks are recomputed.
    factors = {"dp2": 1, "dp2_ep2": 1, "pp2_sliced": 1, "pp2_sliced_recompute": 2}
    for layout in seen:
        counted: dict[str, Tensor] = {}
        for results in per_rank:
            for name, load_E in results.get(layout, {}).get("counted", {}).items():
                if name.endswith("expert_load"):
                    counted[name] = counted.get(name, 0) + load_E
        for name, load_E in counted.items():
            want_E = factors.get(layout, 1) * reference_loads[name]
            assert torch.equal(load_E, want_E), (layout, name)
        assert len(counted) == 2, layout

    for layout in ("dp2", "dp2_ep2"):  # ablation: no all-reduce of the loads
        alone = [results[layout]["alone"] for results in per_rank[:2]]
        assert any(
            not torch.equal(state[name], reference[name])
            for state in alone
            for name in reference_biases
        ), layout
    # With all the stage's tokens on each rank a pipeline's update needs no group: the
    # ablation there changes nothing.
    pipeline_alone = [results["pp2_sliced"]["alone"] for results in per_rank[:2]]
    assert all(
        torch.equal(state[name], reference[name]) for state in pipeline_alone for name in state
        if name.endswith("expert_bias")
    )  # fmt: skip


def test_only_training_forwards_count_and_discard_forgets_them() -> None:
    """Loads count training forwards only; `discard_expert_loads` (the trainer's validation)
    clears them and leaves the biases; a router with rate 0 counts nothing and never moves."""
    model, reference, _ = _reference_update()
    routers = balanced_routers(model)
    with torch.no_grad():
        model.eval()
        model(BATCH["tokens"], BATCH["positions"], CausalAttention(BATCH["document_ids"]))
        assert all(router.expert_load.sum() == 0 for router in routers)
        model.train()
        model(BATCH["tokens"], BATCH["positions"], CausalAttention(BATCH["document_ids"]))
    tokens = ROWS * SEQ_LEN
    assert all(router.expert_load.sum() == tokens * ARGS.moe.top_k for router in routers)
    discard_expert_loads(model)
    assert all(router.expert_load.sum() == 0 for router in routers)
    state = _router_state(model)
    assert all(torch.equal(state[name], reference[name]) for name in reference)

    frozen = SigmoidTopKRouter(8, 4, 2, None, bias_update_rate=0.0)
    frozen(torch.randn(6, 8))
    assert frozen.expert_load.sum() == 0 and balanced_routers(frozen) == []
    update_expert_biases(frozen)
    assert frozen.expert_bias.abs().max() == 0


# --- 6. resume ------------------------------------------------------------------------------


def _choices(model: nn.Module) -> list[Tensor]:
    """Every router's `chosen_TE` on the batch (an evaluation forward)."""
    chosen: list[Tensor] = []

    def record(module: nn.Module, inputs: Any, routing: Routing) -> None:
        chosen.append(routing.chosen_TE)

    hooks = [router.register_forward_hook(record) for router in balanced_routers(model)]
    model.eval()
    with torch.no_grad():
        model(BATCH["tokens"], BATCH["positions"], CausalAttention(BATCH["document_ids"]))
    for hook in hooks:
        hook.remove()
    return chosen


def test_checkpoint_carries_the_bias_and_a_resumed_model_routes_alike() -> None:
    """The state dict holds every MoE layer's `expert_bias` and no load; a fresh model (other
    seed) loading it routes exactly as the trained one. The biases (a few updates) change the
    routing (ablation: the fresh model without them routes differently). A bf16 cast keeps the
    bias float32 with its values, which bf16 could not hold."""
    model = build_model(SPEC, ARGS, SEED, torch.float64)
    for _ in range(6):  # training forwards and updates, no optimizer: only the biases move
        with torch.no_grad():
            model(BATCH["tokens"], BATCH["positions"], CausalAttention(BATCH["document_ids"]))
        update_expert_biases(model)
    state = model.state_dict()
    moe_layers = [name for name, module in model.named_modules() if isinstance(module, MoE)]
    assert len(moe_layers) == 2
    assert all(f"{name}.router.expert_bias" in state for name in moe_layers)
    assert not [key for key in state if "expert_load" in key]

    fresh = build_model(SPEC, ARGS, SEED + 8, torch.float64)
    assert not all(torch.equal(a, b) for a, b in zip(_choices(fresh), _choices(model), strict=True))
    fresh.load_state_dict(state)
    want = _choices(model)
    assert all(torch.equal(a, b) for a, b in zip(_choices(fresh), want, strict=True))
    for router in balanced_routers(fresh):  # ablation: the weights without the biases
        router.expert_bias.zero_()
    assert not all(torch.equal(a, b) for a, b in zip(_choices(fresh), want, strict=True))

    biases = [router.expert_bias.clone() for router in balanced_routers(model)]
    model.to(torch.bfloat16)
    for router, bias_E in zip(balanced_routers(model), biases, strict=True):
        assert router.gate.weight.dtype == torch.bfloat16
        assert (
            router.expert_bias.dtype == torch.float32 and router.expert_load.dtype == torch.float64
        )
        assert torch.equal(router.expert_bias, bias_E)
    assert any(not torch.equal(bias_E.bfloat16().float(), bias_E) for bias_E in biases)
    assert len(_choices(model)) == 2  # the bf16 model routes with them
