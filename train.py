"""`torchrun --nproc-per-node N train.py --config configs/X.toml [--section.key value ...]`.

Bad input (config, data paths, checkpoints) ends with one error line and exit status 2, before any
process group or model exists where that is possible; a diverging run ends with status 1.
`--print-config` prints the resolved config, checked by every rule training applies: for the
world size torchrun gives, or without torchrun for the fewest ranks the parallel degrees allow.
With `[parallelism] layout = "auto"` the config holds the layout the search chose (which
the first line of the run, or of stderr under `--print-config`, names with its prediction).
"""

from __future__ import annotations

import os
import socket
import sys
import time

from pipekit.checkpoint.safetensors_io import CheckpointError
from pipekit.config import ConfigError, help_text, load_job_config, to_dict
from pipekit.config.dump import dump_toml
from pipekit.layout_search.auto import resolve_layout
from pipekit.train.job import validate_job
from pipekit.train.log import setup_logging
from pipekit.train.output_lock import OutputFolderInUse, lock_output_dir

_REPORTER_GRACE_S = 30.0
"""How long a rank that will not print a config error waits for the one that does to exit."""


def main(argv: list[str]) -> int:
    if not argv or "--help" in argv or "-h" in argv:
        print(help_text())
        return 0 if argv else 2
    print_config = "--print-config" in argv
    argv = [arg for arg in argv if arg != "--print-config"]
    rank = int(os.environ.get("RANK", "0"))
    launched = "WORLD_SIZE" in os.environ  # torchrun; plain `python train.py` is one process
    world_size = int(os.environ["WORLD_SIZE"]) if launched else 1
    try:
        config = load_job_config(argv)
        if print_config and not launched:  # every rule, for the fewest ranks the degrees allow
            from pipekit.distributed.parallel_dims import ParallelDims

            world_size = ParallelDims.smallest_world_size(config.parallelism)
        config, chosen = resolve_layout(config, world_size, rank)
        job = validate_job(config, world_size)
    except ConfigError as error:
        # Every rank checks the same config, so one line per machine says it; a file missing
        # on one machine only is reported by that machine.
        if rank == 0 or os.environ.get("LOCAL_RANK") == "0":
            where = f" (rank {rank} on {socket.gethostname()})" if rank else ""
            print(f"config error{where}: {error}", file=sys.stderr)
        elif "TORCHELASTIC_RUN_ID" in os.environ:
            # torchrun stops the other ranks when one exits: leave the exit to the rank that
            # says why (it fails on the same config), or its line may never be printed
            time.sleep(_REPORTER_GRACE_S)
        return 2
    if rank == 0 and not print_config:
        try:
            lock_output_dir(config.job.output_dir)
        except (OutputFolderInUse, OSError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    if chosen and rank == 0:
        print(f"[rank 0] {chosen}", file=sys.stderr if print_config else sys.stdout, flush=True)
    if print_config:
        if rank == 0:
            print(dump_toml(to_dict(config)), end="")
            print(f"# checked for {world_size} rank(s)", file=sys.stderr)
        return 0

    from pipekit.distributed.process_group import destroy_distributed, init_distributed
    from pipekit.train.trainer import NonFiniteLossError, Trainer

    setup_logging(rank)
    init_distributed(timeout_s=config.parallelism.collective_timeout_s)
    try:
        Trainer(job).train()
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
    code = main(sys.argv[1:])
    if "WORLD_SIZE" in os.environ:  # torchrun: a gloo group ran here (see exit_process)
        from pipekit.distributed.process_group import exit_process

        exit_process(code)
    sys.exit(code)
