"""Checkpoint I/O: safetensors directories in Hugging Face layout (model-agnostic).

Model-specific name mappings live with each model (e.g. `pipekit/families/llama/hf.py`),
declared through its `HuggingFaceAdapter`; `python -m pipekit.checkpoint.inspect DIR` lists a
checkpoint and can run it.
"""

from pipekit.checkpoint.safetensors_io import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    SafetensorsCheckpoint,
    TensorInfo,
    TensorRead,
)
from pipekit.checkpoint.safetensors_write import (
    DEFAULT_MAX_SHARD_BYTES,
    PendingTensor,
    save_safetensors,
)

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "INDEX_FILE",
    "SINGLE_FILE",
    "CheckpointError",
    "PendingTensor",
    "SafetensorsCheckpoint",
    "TensorInfo",
    "TensorRead",
    "save_safetensors",
]
