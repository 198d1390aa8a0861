"""The model contract (`spec`), the registry of model families (`registry`), and giving a
model parallelized on the meta device its values shard by shard (`materialize`)."""

from pipekit.models.materialize import materialize_sharded, seeded_materializer
from pipekit.models.registry import (
    get_model_spec,
    import_model_module,
    known_models,
    register_model,
    resolve_model,
    spec_for_checkpoint,
    spec_for_hf_model_type,
)
from pipekit.models.spec import (
    CausalLM,
    HuggingFaceAdapter,
    ModelShape,
    ModelSpec,
    ModelStructure,
)

__all__ = [
    "CausalLM",
    "HuggingFaceAdapter",
    "ModelShape",
    "ModelSpec",
    "ModelStructure",
    "get_model_spec",
    "import_model_module",
    "known_models",
    "materialize_sharded",
    "register_model",
    "resolve_model",
    "seeded_materializer",
    "spec_for_checkpoint",
    "spec_for_hf_model_type",
]
