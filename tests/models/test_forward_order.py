"""The structure's order is checked against the model's own forward before a job launches: a
module placed where forward does not run it is refused in one line (naming the module, where the
structure puts it, where forward runs it, and the fix); every built-in family and example
passes; what the structure legitimately allows (shared modules anywhere, the first stage's
modules in any order, an embedding called again as the tied output, a module forward never
calls) passes. Ablation: without the check, the job with learned positions declared after the
blocks validates (and trains another model under a pipeline)."""

from __future__ import annotations

import dataclasses
import importlib
import logging
from pathlib import Path

import pytest
import tomli
import torch
from torch import nn

import examples.custom_model.model as custom
import examples.local_global.model as local_global
import pipekit.models.forward_order as forward_order
import pipekit.models.registry as registry
from pipekit.config import ConfigError, load_job_config
from pipekit.models import ModelSpec, ModelStructure
from pipekit.models.forward_order import check_forward_order
from pipekit.models.registry import ENTRY_POINT_GROUP
from pipekit.train.job import validate_job

REPO_ROOT = Path(__file__).resolve().parents[2]


class _Stateless(nn.Module):
    """A parameter-free step (a position add, a norm, a soft-cap, RoPE) that marks its input."""

    def forward(self, h_BSD: torch.Tensor) -> torch.Tensor:
        return h_BSD + 1


class _Ordered(nn.Module):
    """Calls its top-level modules in the order `calls` gives (block names included)."""

    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        self.calls = calls
        self.embed = nn.Embedding(11, 4)
        self.pos, self.norm, self.cap, self.scale, self.rope = (_Stateless() for _ in range(5))
        self.blocks = nn.ModuleDict({str(index): nn.Linear(4, 4) for index in range(3)})
        self.head = nn.Linear(4, 11)

    def forward(self, tokens_or_hidden, positions=None, attention_context=None):
        h = tokens_or_hidden
        for name in self.calls:
            module = self.get_submodule(name)
            h = module(tokens_or_hidden) if name == "embed" else module(h)
            if name == "head":
                h = h[..., :4]
        return h


_BLOCKS = ["blocks.0", "blocks.1", "blocks.2"]
_STRUCTURE = ModelStructure(
    "blocks", "embed", "head", ("pos",), ("norm",), ("cap", "scale"), shared=("rope",)
)


def _meta(calls: list[str]) -> nn.Module:
    with torch.device("meta"):
        return _Ordered(calls)


@pytest.mark.parametrize(
    "calls",
    [
        ["embed", "pos", *_BLOCKS, "norm", "head", "cap", "scale"],
        ["pos", "embed", "rope", "blocks.0", "rope", "blocks.1", "blocks.2", "head", "rope"],
        ["embed", *_BLOCKS, "norm", "head", "embed", "cap"],  # the embedding reused as output
        ["embed", *_BLOCKS, "head"],  # pos, norm and the transforms never called
    ],
    ids=["in-order", "first-stage-any-order-shared-anywhere", "embedding-again", "uncalled"],
)
def test_orders_the_structure_allows_pass(calls: list[str]) -> None:
    check_forward_order(_meta(calls), _STRUCTURE)


@pytest.mark.parametrize(
    ("calls", "structure", "message"),
    [
        (
            ["embed", "pos", *_BLOCKS, "norm", "head"],
            dataclasses.replace(_STRUCTURE, before_blocks=(), after_blocks=("pos", "norm")),
            "places 'pos' in after_blocks (last stage, between the blocks and the output), but "
            "_Ordered.forward runs it before the blocks, so a pipeline would apply it elsewhere "
            "than one process does; name it in before_blocks instead",
        ),
        (
            ["embed", "pos", *_BLOCKS, "norm", "head"],
            dataclasses.replace(_STRUCTURE, before_blocks=("pos", "norm"), after_blocks=()),
            "places 'norm' in before_blocks (first stage, before the blocks), but _Ordered."
            "forward runs it after the blocks, before the output, so a pipeline would apply it "
            "elsewhere than one process does; name it in after_blocks instead",
        ),
        (
            ["embed", *_BLOCKS, "head", "norm"],
            _STRUCTURE,
            "places 'norm' in after_blocks (last stage, between the blocks and the output), but "
            "_Ordered.forward runs it after the output, so a pipeline would apply it elsewhere "
            "than one process does; name it in logits_transforms instead",
        ),
        (
            ["embed", "blocks.0", "cap", "blocks.1", "blocks.2", "head"],
            _STRUCTURE,
            "places 'cap' in logits_transforms (after the output), but _Ordered.forward runs it "
            "between 'blocks.0' and the next block, so a pipeline would apply it elsewhere than "
            "one process does; no stage boundary keeps that place: move it into a block, or "
            "before or after them",
        ),
        (
            ["embed", "blocks.0", "head", "blocks.1", "blocks.2"],
            _STRUCTURE,
            "places 'head' as the output (last stage, after the blocks), but _Ordered.forward "
            "runs it between 'blocks.0' and the next block",
        ),
        (
            ["embed", "blocks.1", "blocks.0", "blocks.2", "head"],
            _STRUCTURE,
            "_Ordered.forward runs 'blocks.0' after 'blocks.1', but pipeline stages hold "
            "consecutive blocks in the order of 'blocks''s keys; key the blocks in the order "
            "forward runs them",
        ),
        (
            ["embed", *_BLOCKS, "head", "scale", "cap"],
            _STRUCTURE,
            "ModelStructure lists logits_transforms ('cap', 'scale'), but _Ordered.forward "
            "applies them as ('scale', 'cap'), and vocabulary parallelism applies them in the "
            "structure's order; list them in forward's order",
        ),
    ],
    ids=[
        "positions-after",
        "norm-before",
        "norm-after-output",
        "between-blocks",
        "output-early",
        "blocks-reordered",
        "transforms-reordered",
    ],
)
def test_a_misplaced_module_is_refused_in_one_line(
    calls: list[str], structure: ModelStructure, message: str
) -> None:
    with pytest.raises(ValueError) as raised:
        check_forward_order(_meta(calls), structure)
    text = str(raised.value)
    assert message in text and "\n" not in text, text


def test_the_check_leaves_the_model_unchanged() -> None:
    """Hooks and block stubs are gone afterwards: the meta model serves the later checks."""
    model = _meta(["embed", *_BLOCKS, "head"])
    check_forward_order(model, _STRUCTURE)
    for module in model.modules():
        assert not module._forward_pre_hooks and "forward" not in vars(module)


class _StopsOnMeta(_Stateless):
    def forward(self, h_BSD: torch.Tensor) -> torch.Tensor:
        return h_BSD * float(h_BSD.sum().item())  # data-dependent: no value on meta


def test_a_forward_that_stops_on_meta_is_checked_up_to_there(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls = ["embed", "pos", "blocks.0", "blocks.1", "blocks.2", "norm", "head"]
    model = _meta(calls)
    model.norm = _StopsOnMeta()
    with caplog.at_level(logging.WARNING, logger=forward_order.__name__):
        check_forward_order(model, _STRUCTURE)
    assert "stopped on the meta device" in caplog.text and "'norm']" in caplog.text
    wrong = dataclasses.replace(_STRUCTURE, before_blocks=(), after_blocks=("pos", "norm"))
    with pytest.raises(ValueError, match="places 'pos' in after_blocks"):
        check_forward_order(model, wrong)


def _shipped_specs() -> list[ModelSpec]:
    """The families the package declares (pyproject's entry points) and the two examples."""
    declared = tomli.loads((REPO_ROOT / "pyproject.toml").read_text())
    specs = []
    for target in declared["project"]["entry-points"][ENTRY_POINT_GROUP].values():
        module, name = target.split(":")
        specs.append(getattr(importlib.import_module(module), name))
    return [*specs, custom.TINY_GPT, local_global.LOCAL_GLOBAL]


def test_every_built_in_family_and_example_passes(caplog: pytest.LogCaptureFixture) -> None:
    """Each flavor's forward runs to the end on meta (no warning) in the structure's order."""
    specs = _shipped_specs()
    assert len(specs) >= 8
    with caplog.at_level(logging.WARNING, logger=forward_order.__name__):
        for spec in specs:
            for args in spec.flavors.values():
                with torch.device("meta"):
                    model = spec.build(args)
                check_forward_order(model, spec.structure)
    assert not caplog.text


def test_a_job_with_positions_declared_after_the_blocks_is_refused_before_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The custom example (learned positions) under the sliced pipeline with `wpe` moved to
    after_blocks: validation refuses it in one line. Ablation: without the order check the same
    config validates, with a 2-stage pipeline whose last stage adds the positions."""
    monkeypatch.chdir(REPO_ROOT)
    wrong = dataclasses.replace(custom.STRUCTURE, before_blocks=(), after_blocks=("wpe", "ln_f"))
    spec = dataclasses.replace(custom.TINY_GPT, name="tiny_gpt_positions_last", structure=wrong)
    monkeypatch.setitem(registry._MODELS, spec.name, spec)  # registered for this test only
    config = load_job_config(
        ["--config", "examples/custom_model/debug_sliced_pp.toml", "--model.name", spec.name]
    )
    with pytest.raises(ConfigError) as raised:
        validate_job(config, world_size=2, check_files=False)
    assert str(raised.value) == (
        "[model] tiny_gpt_positions_last: ModelStructure places 'wpe' in after_blocks (last "
        "stage, between the blocks and the output), but TinyGPT.forward runs it before the "
        "blocks, so a pipeline would apply it elsewhere than one process does; name it in "
        "before_blocks instead"
    )
    monkeypatch.setattr(forward_order, "check_forward_order", lambda model, structure: None)
    job = validate_job(config, world_size=2, check_files=False)
    assert job.pipeline is not None and "wpe" in job.pipeline.module_names_per_stage[-1]
