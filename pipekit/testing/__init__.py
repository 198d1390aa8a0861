"""Parity testing for any model pipekit trains: one step under a parallel layout against one
process, on CPU gloo ranks, loss and every gradient (docs/custom_models.md, "Checking it").

`python -m pipekit.check --config x.toml` runs these on a job's model; a test of your own
composes them:

    def _steps(rank, world):
        return [data_parallel_step(rank, world, spec, args, batch),
                pipeline_step(rank, world, spec, args, batch, pipeline_schedule="sliced",
                              num_slices=4, microbatches=2)]

    per_rank = run_on_ranks(_steps, 2)
    reference = reference_step(spec, args, batch, microbatches=2)
    for index in range(2):
        assert compare([steps[index] for steps in per_rank], reference).within(1e-10)
"""

from pipekit.testing.data_parallel import data_parallel_model, data_parallel_step
from pipekit.testing.parity import (
    Comparison,
    Result,
    build_model,
    compare,
    full_gradient,
    max_relative_difference,
    parity_batch,
    reference_step,
)
from pipekit.testing.pipeline import (
    pipeline_layout,
    pipeline_step,
    replace_context_exchange,
    runner_step,
)
from pipekit.testing.ranks import RankFailedError, run_on_ranks

__all__ = [
    "Comparison",
    "RankFailedError",
    "Result",
    "build_model",
    "compare",
    "data_parallel_model",
    "data_parallel_step",
    "full_gradient",
    "max_relative_difference",
    "parity_batch",
    "pipeline_layout",
    "pipeline_step",
    "reference_step",
    "replace_context_exchange",
    "run_on_ranks",
    "runner_step",
]
