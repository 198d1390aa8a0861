"""The `[fault_tolerance]` section: data-parallel replica groups that train on when one fails.

Kept apart from `job_config` because its keys are torchft's concepts (a lighthouse that holds
the quorum, a manager per replica group), and the section is read only where they are.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FaultToleranceConfig"]


@dataclass(kw_only=True)
class FaultToleranceConfig:
    """Replica groups under torchft: each group is a torchrun of its own (FSDP, TP, CP and the
    pipeline inside it as usual), the groups take the place of dp_replicate, and gradients are
    summed over the groups in each step's quorum; a group that dies is left out until it
    restarts and copies the training state from a live one (docs/training.md)."""

    enabled: bool = False
    """Train as one of `groups` replica groups under torchft (pip install 'pipekit[ft]');
    false: torchft is not imported."""
    replica_group: int = 0
    """This torchrun's group, 0 .. groups - 1 (each group reads its share of the batch)."""
    groups: int = 2
    """Replica groups the global batch is split over (dp_replicate must be 1)."""
    min_replicas: int = 1
    """Fewest groups a step trains with; with fewer alive the others wait for a quorum."""
    lighthouse: str = ""
    """The lighthouse's address (http://host:port); empty: the TORCHFT_LIGHTHOUSE variable."""
    timeout_s: float = 60.0
    """Seconds a gradient sum, a commit or a recovery may take: a group that hangs longer is
    dropped from the step and the rest go on."""
    quorum_timeout_s: float = 120.0
    """Seconds to wait for a quorum of min_replicas groups at the start of a step."""
    sync_every: int = 1
    """1: gradients summed over the groups every step. H > 1: LocalSGD (torchft's): each
    group steps on its own gradients, and the groups' weights are averaged every H steps
    (less traffic between groups, for groups on slow links)."""
