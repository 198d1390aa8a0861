"""The tiny Llama that the distributed tests share, and its float64 parity batch and reference;
also a variant whose output projection has a bias (a GPT-J / Falcon-style head)."""

from __future__ import annotations

import dataclasses

import torch
from tensordict import TensorDict
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pipekit._torch_private import checkpoint_module_activations
from pipekit.config.job_config import ParallelismConfig
from pipekit.families.llama import Llama, LlamaArgs
from pipekit.layers.init import seeded
from pipekit.models import ModelSpec, get_model_spec
from pipekit.models.materialize import seeded_materializer
from pipekit.pipelining import PipelineRunner, StageSetup, build_pipeline, plan_pipeline
from pipekit.testing import Result, parity_batch, reference_step

TINY_LLAMA = LlamaArgs(
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=64,
    ffn_dim=48,
    rope_scaling=None,
    rope_theta=10000.0,
    max_seq_len=64,
)
PARITY_ROWS, PARITY_SEQ_LEN, PARITY_TOLERANCE = 6, 32, 1e-10


class BiasedHeadLlama(Llama):
    """Llama whose output projection has a bias (its own also when the weight is tied), drawn
    from its own seed (std 1, so it moves the loss well beyond rounding)."""

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__(args)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=True)
        self.tie_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        seed = int(torch.randint(0, 2**62, ())) if seed is None else seed
        super().init_weights(seed)
        if self.output is not None:
            with seeded(seed, "output.bias", self.output.bias.device):
                nn.init.normal_(self.output.bias)


BIASED_HEAD = dataclasses.replace(
    get_model_spec("llama"), name="llama_biased_head", build=BiasedHeadLlama, hf=None
)
"""The Llama family with BiasedHeadLlama as its model (not registered: tests pass it along)."""


def tiny_spec(head_bias: bool = False) -> ModelSpec:
    """The family of the tiny models: Llama, or Llama with a biased head."""
    return BIASED_HEAD if head_bias else get_model_spec("llama")


def tiny_llama(seed: int = 0, tied: bool = False) -> nn.Module:
    """TINY_LLAMA built on meta, materialised on CPU and initialised from `seed`."""
    with torch.device("meta"):
        model = Llama(TINY_LLAMA.with_updates(tie_embeddings=tied))
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def pp_mesh(world: int) -> DeviceMesh:
    """A 1-D "pp" mesh over the whole world (every rank a pipeline rank)."""
    return init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))


def tiny_pipeline(
    mesh: DeviceMesh,
    *,
    schedule: str = "sliced",
    stages_per_rank: int = 1,
    microbatches: int,
    num_slices: int,
    rows: int,
    seq_len: int,
    dtype: torch.dtype = torch.float64,
    seed: int = 3,
    num_layers: int | None = None,
    vocab_size: int = TINY_LLAMA.vocab_size,
    vocab_parallel: bool = False,
    context_exchange: bool = False,
    user_actions: dict | None = None,
    checkpoint_activations: bool = False,
    activation_offload: float | str = 0.0,
    parallelize=None,
    slicing: str = "equal_length",
    attention_to_linear: float = 0.0,
    head_bias: bool = False,
    tied: bool = False,
) -> PipelineRunner:
    """This rank's pipeline runner of TINY_LLAMA with one layer per stage (`num_layers` split
    evenly otherwise), initialised from `seed` in `dtype`, cpu attention, built by pipekit's one
    builder from a plan (`rows` is the local batch, `mesh` the world mesh with a "pp" dim);
    optionally with every block's activations checkpointed, vocabulary parallelism, context
    exchange, activation offload, a user schedule (`user_actions`), `parallelize` applied to
    each stage, or `slicing` (equal-cost slices placed for `attention_to_linear`); `head_bias`:
    the biased-head variant; `tied`: tied embeddings."""
    num_ranks = mesh["pp"].size()
    num_layers = num_layers or num_ranks * stages_per_rank
    args = TINY_LLAMA.with_updates(
        n_layers=num_layers, max_seq_len=64, vocab_size=vocab_size, tie_embeddings=tied
    )
    parallelism = ParallelismConfig(
        dp_shard=1,
        pipeline_parallel_degree=num_ranks,
        pipeline_schedule=schedule,
        num_slices=num_slices,
        stages_per_rank=stages_per_rank,
        microbatches=microbatches,
        vocab_parallel=vocab_parallel,
        context_exchange=context_exchange,
        activation_offload=activation_offload,
        slicing=slicing,
    )
    spec = tiny_spec(head_bias)
    plan = plan_pipeline(
        parallelism,
        spec.structure,
        spec.shape(args),
        rows,
        seq_len,
        user_actions=user_actions,
        attention_to_linear=attention_to_linear,
    )

    def parallelize_stage(module: nn.Module) -> None:
        if checkpoint_activations:
            for block in spec.structure.blocks_of(module):
                checkpoint_module_activations(block)
        if parallelize is not None:
            parallelize(module)

    setup = StageSetup(
        device=torch.device("cpu"),
        materialize=seeded_materializer("cpu", seed),
        parallelize=parallelize_stage,
        attention_backend="cpu",
        message_dtype=dtype,
    )
    with torch.device("meta"):
        model = spec.build(args).to(dtype)
    return build_pipeline(plan, model, mesh, setup)


def tiny_batch(vocab_size: int = TINY_LLAMA.vocab_size) -> TensorDict:
    """The parity batch the tiny pipelines run: PARITY_ROWS packed rows of PARITY_SEQ_LEN."""
    return parity_batch(vocab_size, PARITY_ROWS, PARITY_SEQ_LEN)


def tiny_reference(
    num_layers: int,
    vocab_size: int = TINY_LLAMA.vocab_size,
    head_bias: bool = False,
    tied: bool = False,
) -> Result:
    """One process, float64, the whole `tiny_batch` at once: what every tiny pipeline (seed 3)
    must reproduce."""
    args = TINY_LLAMA.with_updates(n_layers=num_layers, vocab_size=vocab_size, tie_embeddings=tied)
    return reference_step(tiny_spec(head_bias), args, tiny_batch(vocab_size))
