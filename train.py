"""`torchrun --nproc-per-node N train.py --config configs/X.toml [--section.key value ...]`.

Bad input (config, data paths, checkpoints) ends with one error line and exit status 2, before any
process group or model exists where that is possible; a diverging run ends with status 1.
"""

from __future__ import annotations

import os
import sys

from pipekit.checkpoint.safetensors_io import CheckpointError
from pipekit.config import ConfigError, help_text, load_job_config, validate_job_config


def main(argv: list[str]) -> int:
    if not argv or "--help" in argv or "-h" in argv:
        print(help_text())
        return 0 if argv else 2
    rank = int(os.environ.get("RANK", "0"))
    try:
        config = load_job_config(argv)
        validate_job_config(config, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as error:
        if rank == 0:
            print(f"config error: {error}", file=sys.stderr)
        return 2

    from pipekit.distributed.process_group import destroy_distributed, init_distributed
    from pipekit.train.trainer import NonFiniteLossError, Trainer

    init_distributed(timeout_s=config.parallelism.collective_timeout_s)
    try:
        Trainer(config).train()
    except (CheckpointError, ValueError, OSError) as error:
        print(f"error (rank {rank}): {error}", file=sys.stderr)
        destroy_distributed(wait_for_peers=False)
        return 2
    except NonFiniteLossError as error:
        print(f"training stopped (rank {rank}): {error}", file=sys.stderr)
        destroy_distributed(wait_for_peers=False)
        return 1
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
