"""The model contract (`spec`) and the registry of model families (`registry`)."""

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
    "register_model",
    "resolve_model",
    "spec_for_checkpoint",
    "spec_for_hf_model_type",
]
