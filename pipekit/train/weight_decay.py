"""Which parameters weight decay leaves alone: `[optimizer] no_decay`.

Pretraining recipes (torchtitan's default) decay every parameter; fine-tuning recipes (Hugging
Face's Trainer, nanoGPT) leave normalisation weights, biases and embeddings undecayed, since
shrinking them towards zero changes what the layer computes rather than regularising it. Each
entry of `no_decay` is a kind or a name pattern:

- `"norm"`: the parameters of normalisation layers (torch's LayerNorm, RMSNorm, GroupNorm and
  any module whose class name ends in "Norm", so a custom model's own norm counts);
- `"bias"`: parameters named `bias` or ending in `_bias`, and those a module lists in its
  `bias_parameter_names` (the experts' `b1_EF`, named by shape; a custom module may list its own);
- `"embedding"`: the parameters of `nn.Embedding` modules (token and learned position tables;
  an output head tied to the token table is the same parameter, so it is undecayed too);
- anything else: an `fnmatch` pattern on the parameter's name in the whole model
  (`"layers.*.attention.sinks"`, `"output.weight"`), which must name at least one parameter.

Names are the model's own, whatever wraps a block (activation checkpointing, compile) or which
rank holds it, so one setting means the same parameters under every layout.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from torch import nn

from pipekit.config.loader import ConfigError

__all__ = ["NO_DECAY_KINDS", "check_no_decay", "undecayed_names"]

NO_DECAY_KINDS = ("norm", "bias", "embedding")
"""`no_decay` entries that name a kind of parameter rather than a name pattern."""

_TORCH_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)
_WRAPPER_PARTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"})
"""Name parts that activation checkpointing, torch.compile and FSDP1-style wrappers insert."""


def _model_name(name: str) -> str:
    """`name` without the parts wrappers insert: the parameter's name in the bare model."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def _is_bias(own_name: str, listed: Sequence[str]) -> bool:
    return own_name == "bias" or own_name.endswith("_bias") or own_name in listed


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, _TORCH_NORMS) or type(module).__name__.endswith("Norm")


def _kind_names(model: nn.Module) -> dict[str, set[str]]:
    """The model's parameter names (as `model_name` gives them) of each kind."""
    kinds: dict[str, set[str]] = {kind: set() for kind in NO_DECAY_KINDS}
    for module_name, module in model.named_modules(remove_duplicate=False):
        own = {
            _model_name(f"{module_name}.{name}" if module_name else name)
            for name, _ in module.named_parameters(recurse=False)
        }
        if _is_norm(module):
            kinds["norm"] |= own
        if isinstance(module, nn.Embedding):
            kinds["embedding"] |= own
        listed = getattr(module, "bias_parameter_names", ())
        kinds["bias"] |= {name for name in own if _is_bias(name.rsplit(".", 1)[-1], listed)}
    return kinds


def undecayed_names(model: nn.Module, no_decay: Sequence[str]) -> set[str]:
    """Names (as `model.named_parameters()` gives them, wrappers included) of the parameters
    `no_decay` exempts from weight decay; a tied parameter is exempt under every name."""
    if not no_decay:
        return set()
    kinds = _kind_names(model)
    wanted: set[str] = set()
    patterns = [entry for entry in no_decay if entry not in NO_DECAY_KINDS]
    for entry in no_decay:
        wanted |= kinds.get(entry, set())
    exempt_ids = set()
    named = list(model.named_parameters(remove_duplicate=False))
    for name, param in named:
        bare = _model_name(name)
        if bare in wanted or any(fnmatch.fnmatchcase(bare, pattern) for pattern in patterns):
            exempt_ids.add(id(param))
    return {name for name, param in named if id(param) in exempt_ids}


def check_no_decay(no_decay: Sequence[str], model: nn.Module) -> None:
    """ConfigError naming the entry and the fix when a pattern names no parameter of `model`
    (the whole model, on the meta device): a typo would otherwise decay what it meant to
    spare. A kind the model lacks (biases in Llama) is fine."""
    names = [_model_name(name) for name, _ in model.named_parameters(remove_duplicate=False)]
    for entry in no_decay:
        if not entry.strip():
            raise ConfigError("[optimizer] no_decay has an empty entry; remove it")
        if entry in NO_DECAY_KINDS:
            continue
        if not any(fnmatch.fnmatchcase(name, entry) for name in names):
            examples = ", ".join(names[:3])
            raise ConfigError(
                f"[optimizer] no_decay entry {entry!r} is neither a kind "
                f"({', '.join(NO_DECAY_KINDS)}) nor a pattern that names a parameter of this "
                f"model (its names read like {examples}); fix the pattern or remove it"
            )
