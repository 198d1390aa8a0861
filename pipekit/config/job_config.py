"""The job config: nested dataclass sections, one per concern.

Every field has a one-line docstring under it: that text is `train.py --help` and the config
reference in docs/. Required fields have no default. The rules live elsewhere:
`pipekit.train.config_values` checks choices, ranges and the rules between keys that need no
subsystem (each key's choices read from the component that uses the key); the rules that need
a subsystem (model, data files, parallel degrees, pipeline plan) are that subsystem's.
`pipekit.train.job.validate_job` runs them all before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipekit.config.fault_tolerance import FaultToleranceConfig

__all__ = [
    "CheckpointConfig",
    "CompileConfig",
    "DataConfig",
    "FaultToleranceConfig",
    "JobConfig",
    "JobSection",
    "LRSchedulerConfig",
    "MetricsConfig",
    "MoEConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "ProfilingConfig",
    "TrainingConfig",
    "UpcycleConfig",
    "ValidationConfig",
]


@dataclass(kw_only=True)
class JobSection:
    """What the run is called, where it writes, and its seed."""

    name: str = "pipekit"
    """Run name, shown in logs."""
    output_dir: str = "outputs/pipekit"
    """Folder for metrics, checkpoints and exports (created if missing)."""
    seed: int = 0
    """Seed of model init, data order and every random op; identical on all ranks."""


@dataclass(kw_only=True)
class UpcycleConfig:
    """Turn the dense checkpoint of [checkpoint] initial_load_path into a mixture of experts as
    each rank loads its shard (Llama 3 meets MoE; see docs/upcycling.md)."""

    num_experts: int = 0
    """Copies of each dense FFN (N); the MoE has N x granularity experts. 0 turns upcycling off."""
    top_k: int = 2
    """Copies each token is routed to (k); the router picks k x granularity experts."""
    capacity_factor: float = 0.0
    """Expert capacity factor (the paper trains with 4); 0 is dropless."""
    granularity: int = 1
    """Pieces each FFN copy is cut into along its hidden dim (granular upcycling)."""
    layers: int | str = "all"
    """Which FFNs become MoE: "all", or k for every k-th layer (layers k-1, 2k-1, ...)."""
    router: str = "topk_softmax"
    """topk_softmax (Mixtral: the first forward equals the dense model's) or softmax_topk."""
    router_init_std: float = 0.02
    """Std of the router's init, drawn from the job seed and the layer's name."""

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0


@dataclass(kw_only=True)
class ModelConfig:
    """Which model to build."""

    name: str = "llama"
    """Registered model family: llama, llama_moe, qwen3, qwen3_moe, deepseek_v3, gpt_oss, or one
    of your own."""
    flavor: str = "debug"
    """Named size of the model family (e.g. debug, 1B, 8B, 70B)."""
    module: str = ""
    """Python module imported first, which registers a model of your own
    (pipekit.models.register_model), e.g. examples.custom_model.model; see
    docs/custom_models.md."""
    attention_backend: str = "auto"
    """Attention kernel: auto, cpu or flex (see docs/attention.md)."""
    vocab_size: int = 0
    """Vocabulary rows of the embedding and output layer; 0 = the flavor's, except that the debug
    flavors take the size of a [data] tokenizer.json, so a real tokenizer trains a small model."""
    mtp_depth: int = -1
    """Multi-token prediction modules after the last block (DeepSeek-V3's D; decoder families);
    -1 = the flavor's (none), 0 = none. Not with cp or tp."""
    mtp_loss_weight: float = -1.0
    """lambda of the extra loss, lambda / D x the depths' cross-entropies; -1 = 0.3."""
    upcycle: UpcycleConfig = field(default_factory=UpcycleConfig)
    """[model.upcycle]: build a mixture of experts from the dense checkpoint."""


@dataclass(kw_only=True)
class TrainingConfig:
    """The optimisation loop."""

    steps: int = 100
    """Number of optimizer steps."""
    global_batch_size: int = 8
    """Sequences per optimizer step, summed over data-parallel ranks and accumulation steps."""
    seq_len: int = 256
    """Tokens per sequence."""
    gradient_accumulation_steps: int = 1
    """Micro-steps per optimizer step; each rank sees global_batch_size / (dp * this) sequences."""
    max_norm: float = 1.0
    """Gradient clipping threshold on the global L2 norm (0 disables clipping)."""
    loss_chunk_tokens: int = 0
    """Compute the output layer and loss this many tokens at a time, forward and backward, so
    no more than one chunk's logits exist (0 = all at once); jobs without a pipeline."""
    on_nonfinite: str = "stop"
    """A non-finite loss or gradient norm (the same on every rank): "stop" before the update,
    nothing saved (exit 1), or "skip_step": no update, the step counted and logged."""
    mixed_precision_param: str = "float32"
    """Compute dtype of parameters: float32 or bfloat16 (master weights stay float32)."""
    mixed_precision_reduce: str = "float32"
    """Dtype of gradient reduction across data-parallel ranks: float32 or bfloat16."""
    float8: str = "none"
    """FP8 training of the linear layers through torchao: none, tensorwise or rowwise (the
    output layer and routers stay high precision; emulated off CUDA; docs/training.md)."""
    activation_checkpoint: str = "none"
    """Activation checkpointing: none; full (every block keeps only its input); every_k (every
    k-th block does); selective (op-level, every block: keeps what activation_checkpoint_keep
    names, recomputes the rest; docs/activation_memory.md)."""
    activation_checkpoint_every: int = 2
    """With every_k, checkpoint every k-th transformer block."""
    activation_checkpoint_keep: str = "matmuls_and_attention"
    """With selective: the op outputs kept for backward: matmuls_and_attention (matmuls,
    attention kernels and collectives; element-wise ops and norms are recomputed) or attention
    (the matmuls are recomputed too)."""


@dataclass(kw_only=True)
class OptimizerConfig:
    """AdamW and its low-bit variants."""

    name: str = "AdamW"
    """AdamW, torchao's AdamW8bit / AdamW4bit (low-bit optimizer states), or Muon (the
    matrices; AdamW for embeddings, the output layer and 1-D parameters)."""
    lr: float = 1e-3
    """Peak learning rate."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    muon_momentum: float = 0.95
    """Muon's momentum (Nesterov)."""
    muon_adjust_lr: str = "match_rms_adamw"
    """Muon's learning rate per matrix: match_rms_adamw (0.2 sqrt(max dim), so AdamW's rate
    serves both) or original (sqrt(max(1, rows / cols)))."""
    no_decay: list[str] = field(default_factory=list)
    """Parameters weight decay leaves alone: kinds ("norm", "bias", "embedding") or fnmatch
    patterns on parameter names ("layers.*.attention.sinks"); empty = decay every parameter."""


@dataclass(kw_only=True)
class LRSchedulerConfig:
    """Linear warm-up, then decay to a floor."""

    warmup_steps: int = 10
    """Steps of linear warm-up from 0 to the peak learning rate."""
    decay_type: str = "cosine"
    """Decay after warm-up: cosine, linear or constant."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    decay_ratio: float = 0.0
    """Warmup-stable-decay: decay over the last decay_ratio of the steps only, the peak
    before (0 = decay over every step after the warm-up)."""


@dataclass(kw_only=True)
class DataConfig:
    """Training text and its tokenizer."""

    source: str = "stdlib"
    """stdlib (the running Python's standard-library sources), a path or glob of .txt/.jsonl,
    or hf (Hugging Face datasets, set by the hf_ keys)."""
    jsonl_field: str = "text"
    """Field holding the text in each JSONL record (the text column of a dataset)."""
    hf_path: str = ""
    """source = hf: a Hub dataset name, a dataset folder, or a builder (parquet, json, csv, text)
    that reads hf_data_files."""
    hf_data_files: str = ""
    """source = hf: the builder's files, paths or globs, comma-separated."""
    hf_name: str = ""
    """source = hf: the dataset's configuration name, if it has several."""
    hf_split: str = "train"
    """source = hf: the split to train on."""
    streaming: bool = False
    """source = hf: read the dataset as a stream, packing rows as documents arrive, instead of
    tokenizing it all first (for corpora larger than memory; see docs/training.md)."""
    shuffle_buffer: int = 10000
    """streaming: rows in the shuffle buffer (with shuffle = true)."""
    num_workers: int = 0
    """Loader worker processes that assemble batches ahead of the step (0 = in the trainer)."""
    prefetch_factor: int = 2
    """Batches each worker keeps ready (with num_workers > 0)."""
    format: str = "text"
    """text (documents), or chat: .jsonl lines of {"messages": [{role, content}, ...]}
    rendered by chat_template, the loss on the assistant's tokens only."""
    chat_template: str = "plain"
    """format = chat: plain (pipekit's documented template, any tokenizer), tokenizer (the
    Hugging Face Jinja template beside the tokenizer.json: chat_template.jinja or
    tokenizer_config.json's chat_template), or the path of a .jinja file."""
    mix_sources: list[str] = field(default_factory=list)
    """Corpora mixed by weight instead of `source` (each a file, folder, glob or "stdlib",
    packed on its own; with mix_weights; not with streaming)."""
    mix_weights: list[float] = field(default_factory=list)
    """One weight per mix_sources entry: its share of every epoch's rows (normalised)."""
    tokenizer: str = "bytes"
    """bytes (256 byte ids + BOS + EOS), or the path of a Hugging Face tokenizer.json."""
    shuffle: bool = True
    """Shuffle packed sequences each epoch (seeded by job.seed)."""
    balance_attention: bool = False
    """Deal each step's rows over the data-parallel ranks and pipeline microbatches so each
    carries about the same causal attention work within its packed documents (costliest rows
    first); the step's rows are unchanged, only where each runs. Not with streaming."""
    document_lengths: str = ""
    """What the planners (the memory plan, the layout search, layout = "auto") assume about
    the documents packed into rows: "" (one document per row), "lognormal:median=1024,sigma=1.6",
    or a .json histogram of a corpus (python -m pipekit.train.data.corpus_lengths). Training
    reads its real rows; only planning uses this."""


@dataclass(kw_only=True)
class ParallelismConfig:
    """Degrees of parallelism; their product is the world size (-1 = whatever is left)."""

    dp_replicate: int = 1
    """Data-parallel replicas (DDP-like; with dp_shard > 1, HSDP)."""
    dp_shard: int = -1
    """FSDP2 shard degree (-1 = the rest of the world size)."""
    cp: int = 1
    """Context-parallel degree: each sequence (each slice, in a pipeline) split over this many
    ranks, load-balanced (seq_len a multiple of 2 x cp x num_slices; docs/context_parallel.md)."""
    cp_balance: str = "documents"
    """How a sequence's tokens are dealt to the cp ranks: documents (each batch's pieces dealt
    by their causal attention work within packed documents: equal work per rank whatever the
    document lengths; on a row of one document the same head-and-tail shards as sequence), or
    sequence (pieces r and 2 x cp - 1 - r to rank r, balanced for one causal sequence per
    row). docs/context_parallel.md."""
    cp_balance_pieces: int = 2
    """With cp_balance = documents: pieces per cp rank each sequence (or slice) is cut into
    (seq_len a multiple of cp x cp_balance_pieces x num_slices); more pieces balance short
    documents more finely, each piece is one chunk of the attention kernels' work."""
    cp_variant: str = "auto"
    """How cp ranks exchange attention: a name in the context-parallel variant table (each
    variant's bytes, where it runs and its rules: docs/context_parallel.md, "The variant
    table"). The default picks, per slice, the variant that moves the fewest bytes."""
    cp_ulysses: int = 0
    """Ranks per Ulysses group of hierarchical context parallelism: adjacent cp ranks (a
    node's GPUs), dividing cp into two groups or more (0 = not hierarchical)."""
    cp_across: str = "auto"
    """What hierarchical context parallelism runs across its Ulysses groups: a variant of the
    table that attends over token shards (and, inside a pipeline, runs per slice); the
    default picks per slice by bytes."""
    tp: int = 1
    """Tensor-parallel degree: the blocks' projections split over this many ranks by the model
    family's plan (composes with FSDP2, pipelines, cp and, under sequence parallelism, MoE
    with ep folded over the tp ranks; docs/tensor_parallel.md)."""
    sequence_parallel: bool = True
    """With tp > 1: keep the residual stream, norms and the messages between pipeline stages
    split over the tp ranks by sequence (Megatron's sequence parallelism); false keeps them
    whole on every tp rank (dense models only)."""
    loss_parallel: bool = True
    """With tp > 1: split the output layer over the tp ranks by vocabulary and compute the
    cross-entropy on the shards (torch's loss_parallel), so no rank holds whole logits; a tied
    embedding is split alike (false keeps both whole)."""
    pipeline_parallel_degree: int = 1
    """Pipeline-parallel degree p (the `pp` mesh dim)."""
    pipeline_schedule: str = "sliced"
    """sliced (SlimPipe) or a torch schedule: any name in the schedule registry
    (`pipekit.pipelining.schedules.registry`; docs/pipelining.md lists the built-in ones)."""
    pipeline_schedule_file: str = ""
    """A user-defined schedule, .csv or .toml (configs/schedules/); overrides pipeline_schedule."""
    num_slices: int | str = 0
    """Slices per sequence, a multiple of p for sliced (0 = 2p for sliced, else 1). "auto"
    (sliced, without pipeline features): 2p, 4p and 8p slices (those of 32 tokens or more) are
    each timed over the first steps and the fastest is kept (see docs/pipelining.md)."""
    slicing: str = "equal_length"
    """Where slices are cut: equal_length (SlimPipe), or equal_cost (early slices longer, so
    every slice's linear plus causal-attention FLOPs are equal; see docs/pipelining.md), or
    documents (each microbatch cut by its own packed documents' attention work, step by step);
    unequal cuts round to multiples of the cp ranks' pieces. "auto": equal_length and
    equal_cost are timed over the first steps and the faster kept (with num_slices = "auto",
    every pair; not with pipeline features)."""
    stages_per_rank: int = 1
    """Pipeline stages per rank v (interleaved/V schedules need 2 or more)."""
    microbatches: int = 0
    """Microbatches per local batch (0 = one per sequence); divides the local batch."""
    pipeline_embedding_cost: float = 1.0
    """When splitting stages by layer, the embedding counts as this many layers."""
    pipeline_output_cost: float = 1.0
    """When splitting stages by layer, the final norm and output head count as this many layers."""
    pipeline_stage_modules: list[str] = field(default_factory=list)
    """Explicit split instead: one entry per stage, comma-separated module names
    ("tok_embeddings,layers.0", ..., "layers.7,norm,output"); on the command line separate the
    stages with `;`."""
    vocab_parallel: bool = False
    """Split the embedding, output layer and loss by vocabulary rows across the pipeline ranks
    (output passes on every rank; see docs/vocab_parallel.md); stages then hold neither."""
    context_exchange: bool | str = False
    """Balance causal attention between pipeline ranks: a heavy pass lends part of its attention
    to a light one running at the same time (SlimPipe §4.2; sliced or user schedules; see
    docs/context_exchange.md). "auto": where the job can run it, the first steps are timed
    with and without it and it stays on only if it was faster (the losses are the same)."""
    activation_offload: float | list[float] | str = 0.0
    """Pipeline-aware activation offload: the share of each far-from-backward unit's saved
    activations moved off the device after its forward and back one action ahead of its
    backward (a file on CPU, pinned host memory on CUDA); one number for every pipeline
    rank, a list of one per rank, or "auto" (each rank down to the least loaded rank's peak;
    docs/activation_memory.md). Pipelines only; 0 turns it off."""
    activation_offload_dir: str = ""
    """On CPU, the folder of the offload file (empty: the system's temporary folder)."""
    pipeline_features: list[str] = field(default_factory=list)
    """Pipeline features of your own to turn on, by the name they were registered under
    (`register_pipeline_feature`, in the module `[model] module` names; see
    docs/pipelining.md). pipekit's own features have settings of their own."""
    ep: int = 1
    """Expert-parallel degree (MoE models; borrows from the data-parallel ranks)."""
    etp: int = 1
    """Expert tensor parallelism (Megatron's ETP): each expert's hidden dim split over this
    many ranks, which hold the same experts; ep x etp ranks hold every expert once (borrowed
    from the ranks that hold tokens, like ep; not with expert biases)."""
    collective_timeout_s: int = 300
    """Timeout of every collective, in seconds."""
    layout: str = "manual"
    """"manual": the degrees, schedule and activation policy as written; "auto": the layout
    search's fastest layout that fits the world size the job is launched on, which sets the
    degrees, the schedule with its stages per rank, slices and slicing, activation_offload and
    [training] activation_checkpoint (docs/layout_search.md)."""
    layout_device: str = "auto"
    """The device `layout = "auto"` prices layouts on: a built-in profile (h100, h200, a100,
    b200), "cpu" (this machine, measured at start) or "auto" (cpu without CUDA, else the
    profile whose name the GPU's name contains)."""
    layout_memory_gib: float = 0.0
    """GiB of one device a layout chosen by `layout = "auto"` may fill (0: the device
    profile's memory; less leaves headroom for what the memory plan does not count)."""

    @property
    def cp_pieces_per_rank(self) -> int:
        """Pieces per cp rank each sequence (or slice) is dealt in: two (head and tail) unless
        dealt by documents."""
        return self.cp_balance_pieces if self.cp_balance == "documents" else 2


@dataclass(kw_only=True)
class MoEConfig:
    """How MoE layers run their experts (the model flavor sets experts and routing)."""

    partitions: int | str = 1
    """Token partitions whose all-to-all overlaps expert compute (MPipeMoE), or "auto" to search
    the best per batch size (Algorithm 1); see docs/moe.md."""
    memory_reuse: str = "none"
    """Share partition buffers and restore activations for backward: none, S1, S2, S3, S4, or
    auto (Eq. 10 cost model from measured speeds); see docs/moe.md."""


@dataclass(kw_only=True)
class CheckpointConfig:
    """Training-state checkpoints (DCP) and Hugging Face import/export."""

    enable: bool = True
    """Save training-state checkpoints."""
    folder: str = "checkpoints"
    """Subfolder of job.output_dir for checkpoints (step-N folders)."""
    interval: int = 50
    """Save every this many steps, and at the end."""
    keep_last: int = 2
    """Keep this many newest checkpoints (0 keeps all)."""
    async_save: bool = False
    """Copy the state to host memory and write it in a background thread while training goes
    on; the checkpoint is published when the next save starts or the job ends."""
    resume: bool = True
    """Resume from the newest complete checkpoint in the folder if there is one."""
    load_step: int = 0
    """Resume from this step's checkpoint rather than the newest (0 = the newest)."""
    exclude_from_loading: list[str] = field(default_factory=list)
    """Parts of the checkpoint a resume leaves as a fresh run has them: optimizer (its
    states start over), data (the loader starts at the first batch), progress (the step
    counter and random states: step 1 again, and the learning-rate schedule with it),
    router_biases (the MoE routers' balancing biases start at zero). The model's weights are
    always loaded."""
    initial_load_path: str = ""
    """Checkpoint to initialise the model from when not resuming: a Hugging Face folder, or a
    pipekit step folder (step-N of any job and layout; see initial_load_model_only)."""
    initial_load_model_only: bool = True
    """initial_load_path of a pipekit step: its model weights alone (true), or its whole
    training state less exclude_from_loading (false: optimizer, data position, step and
    schedule, to go on with that run in this job's folder and layout)."""
    last_save_model_only: bool = False
    """The save at the last step holds the model's weights alone, in export_dtype: what
    generation and a new job's initial_load_path read (a resume goes on from the newest
    training save)."""
    export_dtype: str = "float32"
    """Floating weights of a model-only save in this dtype: float32, bfloat16 or float16
    (a bf16 copy of an fp32 run is half the bytes)."""
    export_hf_at_end: bool = False
    """Write the final model to {output_dir}/hf in Hugging Face layout."""


@dataclass(kw_only=True)
class MetricsConfig:
    """What is logged, how often and where."""

    log_interval: int = 10
    """Log every this many steps (and the first and last step)."""
    jsonl_file: str = "metrics.jsonl"
    """Metrics file in job.output_dir (one JSON object per logged step; rank 0 writes)."""
    tensorboard: bool = False
    """Also write TensorBoard event files (scalars under train/) to job.output_dir/tensorboard."""
    wandb: bool = False
    """Also log to a Weights & Biases run (offline unless WANDB_MODE or WANDB_API_KEY is set)."""
    wandb_project: str = "pipekit"
    """The W&B project of the run (the run is named after job.name)."""
    peak_flops: float = 0.0
    """Peak FLOP/s per device for MFU; 0 = measure this machine's float32 matmul throughput."""
    pipeline_trace_step: int = 0
    """Record the pipeline timeline of this step and write pipeline_trace.json/svg to
    job.output_dir; 0 = off."""


@dataclass(kw_only=True)
class ValidationConfig:
    """Loss on held-out rows of the training data, every few steps."""

    enable: bool = False
    """Hold out rows and log val_loss on them."""
    fraction: float = 0.01
    """Share of the packed rows held out (the last ones of the corpus; training never sees
    them)."""
    interval: int = 50
    """Evaluate every this many steps, and at the last step."""
    steps: int = 4
    """Global batches per evaluation (the same held-out batches each time)."""


@dataclass(kw_only=True)
class ProfilingConfig:
    """torch.profiler traces and memory timelines of chosen steps (see pipekit.train.profiling)."""

    steps: list[int] = field(default_factory=list)
    """Profile these steps (1-based; on the command line `--profiling.steps "2;3"`); empty = off."""
    folder: str = "profile_traces"
    """Subfolder of job.output_dir for the traces."""
    memory: bool = False
    """Also record the step's memory: activation/KV-cache/stage-input bytes and RSS as counters
    (rank{R}_memory.json), and on CUDA the allocator history (rank{R}_cuda_memory.pickle)."""


@dataclass(kw_only=True)
class CompileConfig:
    """torch.compile of the transformer blocks and the loss (see pipekit.train.compile)."""

    enable: bool = False
    """Compile each transformer block (its attention call and MoE layers stay eager) and, where
    the loss is a plain cross-entropy, the loss. The first steps take longer while it compiles."""


@dataclass(kw_only=True)
class DebugConfig:
    """Settings that trade speed for reproducibility (see pipekit.train.determinism)."""

    deterministic: bool = False
    """torch's deterministic algorithms (an op without one raises instead of running), cuDNN's
    autotuner off, a fixed cuBLAS workspace, and uninitialised memory filled (NaN for floats,
    so a read before a write shows); costs are in docs/training.md."""


@dataclass(kw_only=True)
class JobConfig:
    """Everything a training job needs, one section per concern."""

    job: JobSection = field(default_factory=JobSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
