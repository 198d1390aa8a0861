"""FP8 training through torchao (`[training] float8`), emulated on CPU: which layers convert,
that checkpoints see the same model, and the numerics against float32 (the job:
tests/integration/test_train_job.py)."""

from __future__ import annotations

import pytest
import torch
from job_runs import REPO_ROOT

from pipekit.config import ConfigError, load_job_config
from pipekit.models import get_model_spec
from pipekit.testing import parity_batch
from pipekit.train.float8 import apply_float8
from pipekit.train.job import validate_job

MOE = get_model_spec("llama_moe")
ARGS = MOE.flavor("debug_balanced").with_updates(
    dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, ffn_dim=128, max_seq_len=64
)


def _model(seed: int = 0) -> torch.nn.Module:
    model = MOE.build(ARGS)
    model.init_weights(seed=seed)
    return model


def _loss(model: torch.nn.Module, batch) -> torch.Tensor:
    logits = model(batch["tokens"], batch["positions"])
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), batch["labels"].flatten()
    )


def test_the_linear_layers_convert_but_the_output_routers_and_odd_dims() -> None:
    model = _model()
    names = apply_float8(model, "tensorwise", MOE.structure, "cpu")
    assert names and all("attention.w" in n or "feed_forward" in n for n in names), names
    assert not any(name.endswith(("output", "router.gate")) for name in names)
    assert type(model.output) is torch.nn.Linear
    assert type(model.layers["0"].attention.wq).__name__ == "Float8Linear"
    assert apply_float8(_model(), "none", MOE.structure, "cpu") == []
    odd = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 64))
    assert apply_float8(odd, "rowwise", MOE.structure, "cpu") == []  # 24, 40: not multiples of 16


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_keeps_the_state_dict_and_stays_near_float32(recipe: str) -> None:
    """Same parameter names and values (checkpoints and exports see one model); the loss within
    2% and every gradient pointing the same way (cosine > 0.98); float32 itself is exact."""
    reference, converted = _model(), _model()
    apply_float8(converted, recipe, MOE.structure, "cpu")
    assert reference.state_dict().keys() == converted.state_dict().keys()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(converted.state_dict()[name], value, rtol=0, atol=0)
    batch = parity_batch(ARGS.vocab_size, rows=2, seq_len=32)
    loss_ref, loss_fp8 = _loss(reference, batch), _loss(converted, batch)
    loss_ref.backward()
    loss_fp8.backward()
    assert abs(loss_fp8.item() - loss_ref.item()) <= 0.02 * loss_ref.item()
    assert loss_fp8.item() != loss_ref.item()  # the casts did happen
    for (name, param), other in zip(
        reference.named_parameters(), converted.parameters(), strict=True
    ):
        if param.grad is None:
            continue
        cosine = torch.nn.functional.cosine_similarity(
            param.grad.flatten(), other.grad.flatten(), dim=0
        )
        assert cosine > 0.98, (name, float(cosine))


def test_float8_is_refused_with_tensor_parallelism_and_unknown_recipes() -> None:
    config = str(REPO_ROOT / "configs/debug_tp.toml")
    with pytest.raises(ConfigError, match=r"\[training\] float8='tensorwise' with tp=2"):
        validate_job(load_job_config(["--config", config, "--training.float8", "tensorwise"]), 2)
    with pytest.raises(ConfigError, match=r"float8='e4m3' is not one of none, tensorwise"):
        validate_job(load_job_config(["--config", config, "--training.float8", "e4m3"]), 2)
