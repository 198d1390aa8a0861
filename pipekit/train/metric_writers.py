"""Where logged metrics go: a JSONL file, TensorBoard, Weights & Biases.

Every writer starts at the step the job starts from (0, or the checkpoint it resumed), and a
row of a later step from an earlier, interrupted run is superseded rather than kept twice: the
JSONL file drops those rows when it opens (rewritten atomically), TensorBoard purges them
(`purge_step`), and W&B resumes the same run id, whose history ignores steps it already holds.
"""

from __future__ import annotations

import abc
import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

from pipekit.checkpoint._durable import fsync_path

logger = logging.getLogger(__name__)

__all__ = ["JsonlWriter", "MetricWriter", "TensorBoardWriter", "WandbWriter", "read_jsonl_rows"]


class MetricWriter(abc.ABC):
    """One destination of the rank-0 metric records (a dict with a "step" key)."""

    @abc.abstractmethod
    def write(self, record: dict[str, Any]) -> None:
        """Add one logged step."""

    def close(self) -> None:  # noqa: B027 - writers without buffers have nothing to release
        """Flush and release what the writer holds."""


def read_jsonl_rows(path: Path, torn_tail: bool = False) -> list[dict[str, Any]]:
    """The rows of a metrics JSONL file; ValueError naming the file and line of a bad row.
    `torn_tail`: a last line that does not parse is dropped (a kill while it was written)."""
    lines = path.read_text().splitlines()
    rows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as error:
            if torn_tail and number == len(lines):
                logger.warning("%s:%d: dropped a torn last row (%s)", path, number, error.msg)
                break
            raise ValueError(f"{path}:{number}: not a JSON object ({error.msg})") from None
    return rows


class JsonlWriter(MetricWriter):
    """One JSON object per logged step, appended; rows after `start_step` are dropped first."""

    def __init__(self, path: Path, start_step: int) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            self._truncate_after(start_step)

    def _truncate_after(self, step: int) -> None:
        rows = read_jsonl_rows(self.path, torn_tail=True)
        kept = [row for row in rows if row.get("step", 0) <= step]
        temporary = self.path.with_name(f"{self.path.name}.tmp-{uuid.uuid4().hex[:8]}")
        temporary.write_text("".join(json.dumps(row) + "\n" for row in kept))
        fsync_path(temporary)
        os.replace(temporary, self.path)

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")


class TensorBoardWriter(MetricWriter):
    """Scalars under `train/<key>` in TensorBoard event files (`torch.utils.tensorboard`)."""

    def __init__(self, log_dir: Path, start_step: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError(
                "[metrics] tensorboard = true needs the tensorboard package; "
                "pip install 'pipekit[tensorboard]'"
            ) from None
        # Events of steps after start_step, from a run that was interrupted, are dropped.
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=start_step + 1)

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float):
                self._writer.add_scalar(f"train/{key}", value, global_step=step)

    def close(self) -> None:
        self._writer.close()


class WandbWriter(MetricWriter):
    """A Weights & Biases run, offline unless W&B is configured (`WANDB_MODE` or an API key);
    the run id is kept in the output folder, so a resumed job continues the same run."""

    def __init__(self, output_dir: Path, project: str, name: str) -> None:
        try:
            import wandb
        except ImportError:
            raise ImportError(
                "[metrics] wandb = true needs the wandb package; pip install 'pipekit[wandb]'"
            ) from None
        id_file = output_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        configured = "WANDB_MODE" in os.environ or "WANDB_API_KEY" in os.environ
        self._run = wandb.init(
            project=project,
            name=name,
            id=run_id,
            resume="allow",
            dir=str(output_dir),
            mode=None if configured else "offline",
        )

    def write(self, record: dict[str, Any]) -> None:
        values = {f"train/{key}": value for key, value in record.items() if key != "step"}
        self._run.log(values, step=record["step"])

    def close(self) -> None:
        self._run.finish()
