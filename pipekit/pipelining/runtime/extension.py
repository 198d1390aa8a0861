"""Pipeline features plug into the runtime through the named hooks of `PipelineExtension`.

A feature (vocabulary parallelism, context exchange, and the coming ones) is one subclass that
overrides the hooks it needs; every hook does nothing by default. The runtime calls them at
fixed points, so no schedule, stage or runner signature grows a keyword per feature:

| hook | when | e.g. |
| --- | --- | --- |
| `prepare` | once, with every rank's compute-only lists | context exchange plans its loans |
| `extra_actions` | once: actions of the feature's own types, and where | vocabulary output passes |
| `run_action` | when the runtime reaches one of those actions | an output pass on a rank |
| `stage_context` / `after_forward` | around each forward of a stage | wrap attention for a loan |
| `forward_scope` | a context the forward runs in | saved-tensor hooks of an offload |
| `loss_fn` | once: the last stage's loss | the vocabulary-parallel loss |
| `begin_step` / `end_step` | around each step | embed tokens / their backward |
| `row_sharded_parameters` | checkpointing | vocabulary rows per rank |
| `duplicate_parameters` | gradient clipping | the second copy of a tied weight |
| `measured_choice` | benches, logs | context exchange on or off by timing |
| `helper_cpu_s` / `step_figures` | benches, after a step | serving threads' CPU, sends ahead |

A feature also declares what it needs of the plan, read at planning through the feature table
(`pipelining.features.registry`): `sliced_only`, `equal_length_slices` and
`modules_outside_stages`.

Extensions that communicate must use a process group of their own (`group`): their messages
must not queue behind the stages' sends (an NCCL send blocks until it is received).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch.distributed as dist
from tensordict import TensorDict
from torch import Tensor
from torch.nn import Parameter

from pipekit.attention.context import AttentionContext
from pipekit.checkpoint.local_shards import RowShard
from pipekit.models.spec import ModelStructure
from pipekit.pipelining.actions import Action
from pipekit.pipelining.runtime.measured_choice import MeasuredChoice

__all__ = ["LossFn", "PipelineExtension"]

LossFn = Callable[..., Tensor]
"""`loss_fn(output, target, normaliser=...)`: the unit's token-sum loss over `normaliser`."""


class PipelineExtension:
    """A pipeline feature; override the hooks it needs (see the module docstring)."""

    name = "extension"
    group: dist.ProcessGroup | None = None
    """The feature's own process group, if it communicates."""
    action_types: tuple[Any, ...] = ()
    """Computation types of the actions `extra_actions` adds (run by `run_action`)."""
    sliced_only: bool = False
    """The feature works between slices' passes: only schedules whose units may be slices
    (sliced, user) carry it."""
    equal_length_slices: bool = False
    """The feature pairs slices across ranks or cuts them evenly: equal-cost slicing, whose
    slices differ in length, is refused with it."""

    @staticmethod
    def modules_outside_stages(structure: ModelStructure) -> tuple[str, ...]:
        """The model's modules the feature holds itself, outside every stage (none)."""
        return ()

    def prepare(self, actions_by_rank: Mapping[int, Sequence[Action]], num_slices: int) -> None:
        """See every rank's compute-only lists before anything runs."""

    def extra_actions(
        self, actions_by_rank: Mapping[int, Sequence[Action]], num_slices: int
    ) -> dict[int, list[tuple[int, Action]]]:
        """Per rank, `(k, action)`: run `action` after the rank's k-th compute action and the
        sends that follow it. In list order."""
        return {}

    def run_action(self, action: Action, context: object) -> None:
        """Run one of the actions `extra_actions` added."""
        raise NotImplementedError(f"{self.name} added {action} but does not run it")

    def stage_context(
        self, stage_index: int, unit: int, training: bool, context: AttentionContext
    ) -> AttentionContext:
        """The attention context of `unit`'s forward on stage `stage_index` (default:
        unchanged); `training` says whether a backward will follow."""
        return context

    def forward_scope(
        self, stage_index: int, unit: int, training: bool
    ) -> AbstractContextManager[None]:
        """A context `unit`'s forward on stage `stage_index` runs inside (default: none)."""
        return contextlib.nullcontext()

    def after_forward(self, stage_index: int, unit: int, context: AttentionContext) -> None:
        """After `unit`'s forward on stage `stage_index`, with the context `stage_context`
        gave."""

    def loss_fn(self, loss_fn: LossFn) -> LossFn:
        """The last stage's loss function (default: unchanged)."""
        return loss_fn

    def begin_step(
        self, units: Sequence[TensorDict], normaliser: Tensor | float
    ) -> list[tuple[Tensor, ...]] | None:
        """At the start of a step: the first stage's inputs per unit, or None to feed the
        units' token ids."""
        return None

    def end_step(self) -> None:
        """After the step's last action."""

    def row_sharded_parameters(self) -> dict[str, RowShard]:
        """Parameters this rank holds only some rows of: name -> which rows of how many."""
        return {}

    def row_shard_dims(self) -> tuple[str, ...]:
        """The world mesh's dims whose ranks split `row_sharded_parameters`' rows, in mesh
        order (where checkpoints place the rows)."""
        return ("pp",)

    def tied_copies(self) -> list[Parameter] | None:
        """This rank's copies of a tied weight when the feature holds both ends of the tie;
        None: the stages hold them (first and last)."""
        return None

    def duplicate_parameters(self) -> list[Parameter]:
        """Parameters this rank holds as a copy of one counted elsewhere (a tied weight's
        second copy): a global gradient norm must not count them again."""
        return []

    def tensor_split_parameters(self) -> tuple[list[Parameter], dist.ProcessGroup] | None:
        """Plain parameters of which this rank's tensor-parallel ranks (the group) hold
        disjoint parts (vocabulary rows over tp): a global gradient norm adds them over it."""
        return None

    def measured_choice(self) -> MeasuredChoice[Any] | None:
        """The choice this feature settles by timing the first steps (its setting is "auto"),
        or None: benches settle it before they time and report what it chose."""
        return None

    def helper_cpu_s(self) -> float:
        """CPU seconds the feature's own threads spent in the last step (serving threads): a
        bench separates them from the rank's own work."""
        return 0.0

    def step_figures(self) -> dict[str, float]:
        """The feature's own figures of the last step, by name (none): what a bench reports
        beside the step's time."""
        return {}
