"""The open table of pipeline features: how each is switched on, its rules, its part of the
plan, how it builds, and its place among the others.

Planning (`pipelining.plan`), building (`pipelining.build`) and the memory plan read this
table; nothing else lists feature names. A feature is a `PipelineExtension` subclass (its
runtime hooks and its static needs: `sliced_only`, `equal_length_slices`,
`modules_outside_stages`) plus one `PipelineFeature` entry:

    register_pipeline_feature(PipelineFeature("my_feature", MyExtension, build=build_mine))

A job turns a registered feature on with `[parallelism] pipeline_features = ["my_feature"]`;
the module that registers it is the one `[model] module` names (imported before planning), or
any module imported first. pipekit's own features (`features.builtin`) each have a setting of
their own (`vocab_parallel = true`, `cp = 2`, ...) and are registered on the first lookup.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pipekit.config.job_config import ParallelismConfig
from pipekit.distributed.parallel_dims import ParallelDims
from pipekit.models.spec import ModelShape, ModelSpec, ModelStructure
from pipekit.pipelining.actions import Action
from pipekit.pipelining.pipeline_plan import PipelinePlan
from pipekit.pipelining.runtime.extension import PipelineExtension
from pipekit.pipelining.runtime.measured_choice import AUTO
from pipekit.pipelining.runtime.stage import StageShapes
from pipekit.pipelining.stage_setup import StageSetup

__all__ = [
    "FEATURE_OFF",
    "FeatureBuilding",
    "FeatureLayout",
    "FeaturePlanning",
    "PipelineFeature",
    "enabled_pipeline_features",
    "features_off_without",
    "get_pipeline_feature",
    "measured_pipeline_features",
    "measured_settings",
    "pipeline_feature_names",
    "register_pipeline_feature",
    "simulated_attention",
]

_BUILTIN_MODULE = "pipekit.pipelining.features.builtin"

FEATURE_OFF = object()
"""What a feature's `plan` returns when the job's settings leave it nothing to do (activation
offload whose ratios are all 0): planning then turns it off."""


@dataclass(frozen=True)
class FeatureLayout:
    """What a feature's layout rules see, pipeline or not, before any plan: the settings, the
    degrees and the model."""

    parallelism: ParallelismConfig
    dims: ParallelDims
    spec: ModelSpec
    meta_model: nn.Module
    """The whole model, on the meta device."""
    shape: ModelShape
    seq_len: int | None = None
    """The sequence length, None before any batch (rules of length left out)."""
    upcycling: bool = False
    """Whether the model is upcycled from a dense checkpoint at the start."""


@dataclass(frozen=True)
class FeaturePlanning:
    """What a feature's rules and its part of the plan are decided from."""

    parallelism: ParallelismConfig
    structure: ModelStructure
    model: ModelShape
    seq_len: int
    num_slices: int
    module_names_per_stage: list[list[str]]
    actions_by_rank: dict[int, list[Action]]
    """Every rank's compute-only lists (before any feature's own actions)."""
    features: tuple[str, ...]
    """Every feature the job turns on, in build order (rules may depend on each other)."""
    activation_checkpoint: str = "none"
    """The job's `[training] activation_checkpoint` policy."""


@dataclass(frozen=True)
class FeatureBuilding:
    """What a feature's extension is built from, on one rank (every rank builds together:
    a feature that communicates creates its process groups here)."""

    plan: PipelinePlan
    model: nn.Module
    """The whole model, on the meta device."""
    rank_model: nn.Module
    """This rank's modules under the whole model's names (what the optimizer sees)."""
    mesh: DeviceMesh
    """The world's mesh; its "pp" dim is the pipeline."""
    setup: StageSetup
    shapes: StageShapes
    extensions: tuple[PipelineExtension, ...]
    """The extensions of the features built before this one."""
    feature_plan: Any
    """What this feature's `plan` returned at planning (None without one)."""

    @property
    def pipeline_rank(self) -> int:
        return self.mesh["pp"].get_local_rank()


def _no_rules(_: FeaturePlanning) -> None:
    """The default `check`: no rules beyond the extension's static needs."""


def _no_layout_rules(_: FeatureLayout) -> None:
    """The default `check_layout`: no rules of the layout or the model."""


def _no_plan(_: FeaturePlanning) -> None:
    """The default `plan`: nothing to fix before building."""


@dataclass(frozen=True)
class PipelineFeature:
    """One pipeline feature's entry in the table."""

    name: str
    extension: type[PipelineExtension]
    """The runtime class: its static needs are read from it (one place for each fact)."""
    build: Callable[[FeatureBuilding], PipelineExtension]
    """This rank's extension (every rank calls it together)."""
    setting: Callable[[ParallelismConfig], bool] | None = None
    """Whether `[parallelism]` turns the feature on by a setting of its own (pipekit's
    features); None: by naming it in `pipeline_features`."""
    setting_name: str = ""
    """That setting as a user writes it (for messages), e.g. "vocab_parallel = true"."""
    measured_setting: str = ""
    """The `[parallelism]` field that, set to "auto", asks for the feature where the job can
    run it, chosen by timing the first steps with and without (the plan tries it on, falls back
    to off, and marks its feature plan "auto"); "" for none."""
    off_setting: Mapping[str, Any] = field(default_factory=dict)
    """The `[parallelism]` fields that turn the feature off, for a layout search that drops it
    where a candidate cannot run it (no pipeline; a `sliced_only` feature without slices);
    empty: the search leaves the setting alone (a degree the layout sets, or a setting the
    search chooses itself)."""
    simulated_attention: Callable[[PipelinePlan, float], Mapping[Action, float]] | None = None
    """Per action, the slices of attention its rank computes once the feature has moved
    attention work between ranks (`simulate(attended_slices=...)`), from the plan and the
    backward-to-forward cost ratio; None: the feature moves no attention."""
    order: int = 100
    """Features build, and their hooks run, in increasing order, then by name (pipekit's use
    10..40)."""
    check_layout: Callable[[FeatureLayout], None] = _no_layout_rules
    """ValueError naming the fix when the job's degrees or model break the feature's rules,
    checked with the job's layout (`check_parallel_layout`), with or without a pipeline: a
    feature that needs pipeline ranks says so here."""
    check: Callable[[FeaturePlanning], None] = _no_rules
    """ValueError naming the fix when the job's plan breaks the feature's rules."""
    plan: Callable[[FeaturePlanning], Any] = _no_plan
    """What the feature fixes at planning (kept in `PipelinePlan.feature_plans[name]`), or
    `FEATURE_OFF`."""

    @property
    def how_to_enable(self) -> str:
        return self.setting_name or f"pipeline_features = [{self.name!r}]"


_FEATURES: dict[str, PipelineFeature] = {}
_builtins_loaded = False


def register_pipeline_feature(feature: PipelineFeature, *, replace: bool = False) -> None:
    """Add `feature` to the table (replacing one of the same name needs `replace=True`)."""
    _load_builtins()
    if not issubclass(feature.extension, PipelineExtension):
        raise TypeError(
            f"pipeline feature {feature.name!r}: extension must be a PipelineExtension subclass"
        )
    if feature.name in _FEATURES and not replace:
        raise ValueError(
            f"a pipeline feature named {feature.name!r} is already registered; pick another name "
            "or pass replace=True"
        )
    _FEATURES[feature.name] = feature


def _load_builtins() -> None:
    """Register pipekit's own features (once, at the first use of the table)."""
    global _builtins_loaded
    if not _builtins_loaded:  # (the builtins' own registrations find their module importing)
        importlib.import_module(_BUILTIN_MODULE)
        _builtins_loaded = True


def pipeline_feature_names() -> list[str]:
    """Every registered feature, in build order."""
    _load_builtins()
    return [feature.name for feature in sorted(_FEATURES.values(), key=_build_order)]


def measured_settings() -> tuple[str, ...]:
    """The `[parallelism]` fields a feature's plan may resolve by timing: each takes false,
    true or "auto"."""
    _load_builtins()
    return tuple(sorted({f.measured_setting for f in _FEATURES.values() if f.measured_setting}))


def measured_pipeline_features(parallelism: ParallelismConfig) -> list[PipelineFeature]:
    """The features whose `measured_setting` `parallelism` sets to "auto", in build order."""
    _load_builtins()
    return sorted(
        (
            feature
            for feature in _FEATURES.values()
            if feature.measured_setting and getattr(parallelism, feature.measured_setting) == AUTO
        ),
        key=_build_order,
    )


def features_off_without(
    parallelism: ParallelismConfig, pipelined: bool, sliced: bool
) -> dict[str, Any]:
    """The `[parallelism]` fields that turn off each feature `parallelism` enables but a layout
    without a pipeline (`pipelined` False) or without slices (`sliced` False) cannot run."""
    fields: dict[str, Any] = {}
    for name in enabled_pipeline_features(parallelism):
        feature = _FEATURES[name]
        if not pipelined or (feature.extension.sliced_only and not sliced):
            fields.update(feature.off_setting)
    return fields


def simulated_attention(plan: PipelinePlan, backward_ratio: float) -> dict[Action, float] | None:
    """Per action, the slices of attention its rank computes after the plan's features have
    moved work between ranks, for the simulator; None when no feature moves any."""
    _load_builtins()
    moved: dict[Action, float] | None = None
    for name in plan.features:
        feature = _FEATURES.get(name)
        if feature is None or feature.simulated_attention is None:
            continue
        if moved is not None:
            raise ValueError(
                f"two pipeline features of this plan ({', '.join(plan.features)}) move attention "
                "between ranks; the simulator prices one such move: turn one off"
            )
        moved = dict(feature.simulated_attention(plan, backward_ratio))
    return moved


def get_pipeline_feature(name: str) -> PipelineFeature:
    """The entry of `name`, with an error listing the known ones."""
    _load_builtins()
    if name not in _FEATURES:
        raise ValueError(
            f"pipeline_features: no pipeline feature named {name!r} is registered (known: "
            f"{', '.join(pipeline_feature_names())}); register it with "
            "register_pipeline_feature in the module [model] module names"
        )
    return _FEATURES[name]


def enabled_pipeline_features(parallelism: ParallelismConfig) -> tuple[str, ...]:
    """The features `parallelism` turns on, in build order: pipekit's by their own settings,
    registered ones by `pipeline_features`."""
    _load_builtins()
    listed = list(parallelism.pipeline_features)
    for name in listed:
        feature = get_pipeline_feature(name)
        if feature.setting is not None:
            raise ValueError(
                f"pipeline_features lists {name!r}, which has a setting of its own: set "
                f"{feature.setting_name} instead"
            )
    if len(set(listed)) != len(listed):
        raise ValueError(f"pipeline_features={listed} names a feature twice; list each once")
    on = [
        feature
        for feature in _FEATURES.values()
        if (feature.setting(parallelism) if feature.setting is not None else feature.name in listed)
    ]
    return tuple(feature.name for feature in sorted(on, key=_build_order))


def _build_order(feature: PipelineFeature) -> tuple[int, str]:
    """By `order`, then by name: the same on every rank whatever the import order (features
    create process groups as they build)."""
    return feature.order, feature.name
