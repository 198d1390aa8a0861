"""`python scripts/gpu_check.py`: every GPU-only path of pipekit checked once, and a short timed
training step (see `pipekit.tools.gpu_check`; `--help` lists the options)."""

import sys

from pipekit.tools.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
