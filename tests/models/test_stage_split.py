"""Pipeline stage split: optimal contiguous partitions (against brute force), stage placement,
stage modules that keep the full model's names, and stages that, initialised one by one from
the meta model, compose to the full model's logits with bit-identical weights (float64)."""

import itertools

import pytest
import torch
from tiny_models import TINY_LLAMA
from torch import nn

from pipekit.families.decoder.model import DECODER_STRUCTURE
from pipekit.families.llama import Llama
from pipekit.models import ModelStructure
from pipekit.models.stage_module import (
    build_stage_module,
    check_structure,
    validate_stage_module_names,
)
from pipekit.pipelining.features.vocab_parallel import PipelineVocabParallel
from pipekit.pipelining.model_split.partition import (
    blocks_per_stage,
    partition_layers,
    stage_module_names,
    stage_to_rank,
    stages_of_rank,
)

ARGS = TINY_LLAMA.with_updates(n_layers=4)
SEED = 3


def llama_stage_module_names(num_layers: int, num_stages: int, **options) -> list[list[str]]:
    return stage_module_names(DECODER_STRUCTURE, num_layers, num_stages, **options)


def _stage_costs(counts, embedding_weight, output_weight):
    costs = [float(count) for count in counts]
    costs[0] += embedding_weight
    costs[-1] += output_weight
    return costs


def _all_splits(num_layers, num_stages):
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        bounds = (0, *cuts, num_layers)
        yield [bounds[i + 1] - bounds[i] for i in range(num_stages)]


@pytest.mark.parametrize(
    ("embedding_weight", "output_weight"), [(1, 1), (0, 0), (0.5, 2.5), (3, 0)]
)
def test_partition_is_optimal_and_earliest_stages_smallest_vs_brute_force(
    embedding_weight, output_weight
):
    for num_stages in range(1, 5):
        for num_layers in range(num_stages, 9):
            ranges = partition_layers(num_layers, num_stages, embedding_weight, output_weight)
            assert [r.start for r in ranges] == [0, *[r.stop for r in ranges[:-1]]]
            assert ranges[-1].stop == num_layers and all(len(r) >= 1 for r in ranges)
            splits = list(_all_splits(num_layers, num_stages))
            bottleneck = min(max(_stage_costs(s, embedding_weight, output_weight)) for s in splits)
            optimal = [
                s
                for s in splits
                if max(_stage_costs(s, embedding_weight, output_weight)) == bottleneck
            ]
            assert [len(r) for r in ranges] == min(optimal), (num_layers, num_stages)


def test_partition_examples():
    assert partition_layers(8, 4) == [range(0, 1), range(1, 3), range(3, 6), range(6, 8)]
    assert partition_layers(8, 4, 0, 0) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert partition_layers(3, 1) == [range(0, 3)]


def test_partition_errors_name_the_values_and_the_fix():
    with pytest.raises(ValueError, match=r"num_layers=2 .* num_stages=3.*fewer stages"):
        partition_layers(2, 3)
    with pytest.raises(ValueError, match="num_stages=0"):
        partition_layers(2, 0)
    with pytest.raises(ValueError, match="output_weight=-1"):
        partition_layers(4, 2, output_weight=-1)
    with pytest.raises(ValueError, match="embedding_weight=nan"):
        partition_layers(4, 2, embedding_weight=float("nan"))


def test_llama_stage_names_cover_the_model_in_order():
    names = llama_stage_module_names(4, 2)
    assert names == [
        ["rope", "tok_embeddings", "layers.0", "layers.1"],
        ["rope", "layers.2", "layers.3", "norm", "output"],
    ]
    validate_stage_module_names(_meta_llama(), names, shared=("rope",))


def test_stage_names_follow_any_model_structure():
    structure = ModelStructure(
        blocks="blocks",
        embedding="wte",
        output="head",
        before_blocks=("wpe",),
        after_blocks=("l",),
        logits_transforms=("cap",),
    )
    names = stage_module_names(structure, 4, 2, 0.0, 0.0)
    assert names == [
        ["wte", "wpe", "blocks.0", "blocks.1"],
        ["blocks.2", "blocks.3", "l", "head", "cap"],
    ]
    # vocabulary parallelism takes the embedding, the head and its transforms out; positions
    # stay on stage 0
    outside = PipelineVocabParallel.modules_outside_stages(structure)
    parallel = stage_module_names(structure, 4, 2, outside=outside)
    assert parallel == [["wpe", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "l"]]
    assert blocks_per_stage(structure, parallel) == {0: 2, 1: 2}


def test_stage_to_rank_loop_and_v():
    assert stage_to_rank(4, 1) == [0, 1, 2, 3]
    assert stage_to_rank(3, 2) == [0, 1, 2, 0, 1, 2]
    assert stage_to_rank(3, 2, "v") == [0, 1, 2, 2, 1, 0]
    assert stages_of_rank(0, 3, 2, "v") == [0, 5] and stages_of_rank(2, 3, 2, "v") == [2, 3]
    assert stages_of_rank(1, 2, 3) == [1, 3, 5]
    with pytest.raises(ValueError, match="stages_per_rank=3"):
        stage_to_rank(2, 3, "v")
    with pytest.raises(ValueError, match="style='zigzag'"):
        stage_to_rank(2, 2, "zigzag")
    with pytest.raises(ValueError, match="rank=2"):
        stages_of_rank(2, 2, 1)


def _meta_llama(args=ARGS):
    with torch.device("meta"):
        return Llama(args)


def _materialise(module, seed=SEED):
    module.to_empty(device="cpu")
    module.init_weights(seed=seed)
    return module.to(torch.float64)


@pytest.mark.parametrize("num_stages", [2, 4])
def test_stage_weights_partition_the_full_model_and_equal_its_init(num_stages):
    meta = _meta_llama()
    full = _materialise(_meta_llama()).state_dict()
    seen = []
    for names in llama_stage_module_names(ARGS.n_layers, num_stages):
        stage = _materialise(build_stage_module(meta, names)).state_dict()
        seen.extend(stage)
        for key, value in stage.items():
            assert torch.equal(value, full[key]), key
    assert sorted(seen) == sorted(full)
    assert all(p.is_meta for p in meta.parameters())  # the source model is left alone


@pytest.mark.parametrize("num_stages", [2, 4])
def test_composed_stages_equal_the_full_model_fp64(num_stages):
    meta = _meta_llama()
    stage_names = llama_stage_module_names(ARGS.n_layers, num_stages)
    # Initialise the stages last-first: a stage's weights must not depend on the global RNG.
    stages = [_materialise(build_stage_module(meta, n)) for n in reversed(stage_names)][::-1]
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    hidden = tokens
    for stage in stages:
        hidden = stage(hidden, torch.arange(16))
    full = _materialise(_meta_llama())(tokens)
    assert hidden.shape == full.shape
    torch.testing.assert_close(hidden, full, rtol=1e-12, atol=1e-12)
    # Ablation: one stage initialised from another seed breaks the composition.
    stages[1] = _materialise(build_stage_module(meta, stage_names[1]), seed=SEED + 1)
    hidden = tokens
    for stage in stages:
        hidden = stage(hidden)
    assert (hidden - full).abs().max() > 1e-3


def test_unseeded_init_is_determined_by_the_global_rng_state():
    meta = _meta_llama()
    stage = build_stage_module(meta, ["rope", "layers.2", "layers.3", "norm", "output"])
    stage.to_empty(device="cpu")
    full = _meta_llama().to_empty(device="cpu")
    torch.manual_seed(7)
    stage.init_weights()
    torch.manual_seed(7)
    full.init_weights()
    for key, value in stage.state_dict().items():
        assert torch.equal(value, full.state_dict()[key]), key


def test_stage_module_keeps_names_and_drops_the_rest():
    stage = build_stage_module(_meta_llama(), ["layers.1", "layers.2"])
    assert stage.tok_embeddings is None and stage.norm is None and stage.output is None
    assert list(stage.layers) == ["1", "2"]
    assert stage.rope is None  # stateless, but not named: a stage holds exactly its names
    assert build_stage_module(_meta_llama(), ["rope", "layers.1"]).rope is not None
    assert {key.split(".")[1] for key in stage.state_dict()} == {"1", "2"}
    whole = build_stage_module(_meta_llama(), ["layers", "norm"])
    assert list(whole.layers) == ["0", "1", "2", "3"]


def test_stage_without_embedding_rejects_token_ids():
    stage = _materialise(build_stage_module(_meta_llama(), ["rope", "layers.3", "norm", "output"]))
    with pytest.raises(ValueError, match="no tok_embeddings; feed it hidden states"):
        stage(torch.zeros(1, 4, dtype=torch.long))


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ValueError, match=r"\['layers.9'\].*'layers.<key>' with key in 0..3"):
        build_stage_module(_meta_llama(), ["layers.9"])
    with pytest.raises(ValueError, match=r"stage 1: unknown module names \['head'\]"):
        validate_stage_module_names(_meta_llama(), [["tok_embeddings"], ["head"]])


def test_a_module_a_feature_holds_outside_the_stages_is_in_none():
    names = llama_stage_module_names(ARGS.n_layers, 2)
    with pytest.raises(ValueError, match="'output' is in stage 1 but a pipeline feature holds"):
        validate_stage_module_names(_meta_llama(), names, outside_stages=("output",))


def test_tied_embeddings_cannot_be_split_across_stages():
    tied = _meta_llama(ARGS.with_updates(tie_embeddings=True))
    with pytest.raises(ValueError, match=r"share a weight \(tied embeddings\)"):
        build_stage_module(tied, llama_stage_module_names(ARGS.n_layers, 2)[0])
    whole = _materialise(build_stage_module(tied, llama_stage_module_names(ARGS.n_layers, 1)[0]))
    assert whole.output.weight is whole.tok_embeddings.weight


@pytest.mark.parametrize(
    ("names_per_stage", "message"),
    [
        ([["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "norm"]], "output"),
        ([["tok_embeddings", "layers.0"], ["layers.0", "layers", "norm", "output"]], "layers.0"),
        ([["tok_embeddings", "layers"], ["rope"], ["norm", "output"]], "stage 1 holds no module"),
        (
            [
                ["tok_embeddings", "layers.0", "layers.1"],
                ["layers.2", "layers.3", "norm", "output"],
            ],
            "shared module 'rope' is on stages \\[\\]",
        ),
        (
            [
                ["tok_embeddings", "layers.1"],
                ["layers.0", "layers.2", "layers.3", "norm", "output"],
            ],
            "'layers.1' is in stage 0",
        ),
        ([], "empty"),
    ],
    ids=["missing", "duplicate", "empty-stage", "no-shared", "out-of-order", "no-stages"],
)
def test_validate_rejects_bad_splits(names_per_stage, message):
    with pytest.raises(ValueError, match=message):
        validate_stage_module_names(_meta_llama(), names_per_stage, shared=("rope",))


class _Scale(nn.Module):
    """A parameterless embedding scale, the kind of module that once ran on every stage."""

    def forward(self, h_BSD: torch.Tensor) -> torch.Tensor:
        return h_BSD * 8.0


class _ScaledModel(nn.Module):
    """Embedding, a stateless scale before the blocks, two linear blocks, an output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.scale = _Scale()
        self.blocks = nn.ModuleDict({str(i): nn.Linear(4, 4) for i in range(2)})
        self.head = nn.Linear(4, 11)

    def forward(self, tokens_or_hidden: torch.Tensor) -> torch.Tensor:
        h_BSD = tokens_or_hidden
        if self.embed is not None:
            h_BSD = self.embed(h_BSD)
        if self.scale is not None:
            h_BSD = self.scale(h_BSD)
        for block in (self.blocks or {}).values():
            h_BSD = block(h_BSD)
        return h_BSD if self.head is None else self.head(h_BSD)


_SCALED = ModelStructure("blocks", "embed", "head", before_blocks=("scale",))


def test_stateless_modules_run_only_on_the_stage_that_places_them():
    torch.manual_seed(0)
    model = _ScaledModel().double()
    check_structure(model, _SCALED)
    names = stage_module_names(_SCALED, 2, 2, 0.0, 0.0)
    assert names == [["embed", "scale", "blocks.0"], ["blocks.1", "head"]]
    validate_stage_module_names(model, names)
    tokens = torch.tensor([[1, 2, 3]])
    hidden = tokens
    for stage_names in names:
        hidden = build_stage_module(model, stage_names)(hidden)
    torch.testing.assert_close(hidden, model(tokens), rtol=0, atol=0)
    # Ablation: a stage keeping the stateless scale it was not given (the old behaviour) runs
    # it twice and changes the model; validation refuses that split.
    twice = [["embed", "scale", "blocks.0"], ["scale", "blocks.1", "head"]]
    hidden = tokens
    for stage_names in twice:
        hidden = build_stage_module(model, stage_names)(hidden)
    assert (hidden - model(tokens)).abs().max() > 1e-3
    with pytest.raises(ValueError, match=r"stateless module 'scale' is on stages \[0, 1\]"):
        validate_stage_module_names(model, twice)


@pytest.mark.parametrize(
    ("structure", "message"),
    [
        (ModelStructure("blocks", "embed", "head"), r"\['scale'\] of _ScaledModel are placed by"),
        (
            ModelStructure("blocks", "embed", "head", ("scale",), ("scale",)),
            r"names \['scale'\] more than once",
        ),
        (
            ModelStructure("blocks", "embed", "head", ("scale", "wpe")),
            r"names \['wpe'\], which _ScaledModel does not have",
        ),
        (
            ModelStructure("blocks", "embed", "head", ("scale",), shared=("embed",)),
            r"more than once",
        ),
        (
            ModelStructure("blocks", "embed", "head", logits_transforms=("scale",), shared=()),
            None,
        ),
    ],
    ids=["unplaced", "twice", "absent", "embedding-shared", "ok"],
)
def test_check_structure_names_what_is_not_placed(structure, message):
    model = _ScaledModel()
    if message is None:
        check_structure(model, structure)
        return
    with pytest.raises(ValueError, match=message):
        check_structure(model, structure)


def test_check_structure_refuses_direct_and_stateful_shared_parameters():
    model = _ScaledModel()
    model.gain = nn.Parameter(torch.ones(4))
    with pytest.raises(ValueError, match=r"holds \['gain'\] directly"):
        check_structure(model, _SCALED)
    model = _ScaledModel()
    stateful = ModelStructure("blocks", "embed", "head", logits_transforms=("scale",))
    model.scale = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"logits_transforms names \['scale'\], which hold"):
        check_structure(model, stateful)
