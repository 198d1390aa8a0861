"""MPipeMoE's memory model of one expert-parallel MoE layer (its Eq. 1-6), in elements.

Symbols as in the paper's Table I: B tokens on this rank, M model dim, H expert hidden dim,
E experts, n partitions. Tensors: T_I input, T_DI dispatched input, T_M middle activation,
T_DO dispatched output, T_O combined output, each `[B, M]` except T_M `[B, H]`.

The paper's expert is a two-matrix FFN with one middle tensor. A SwiGLU expert has three
matrices and two middle tensors (gate and up, each `[B, H]`); `middle_tensors` and
`matrices_per_expert` carry that difference, and their defaults give the paper's formulas.
`biases` adds gpt-oss's bias vectors (one per expert matrix, and the gate's) to the model
states; activations are unchanged (a bias is added in place).
Multiply by the element size for bytes.
"""

from __future__ import annotations

__all__ = [
    "activation_elements",
    "model_state_elements",
    "pipelined_buffer_elements",
    "reuse_saving_elements",
    "reuse_saving_ratio",
    "temporary_buffer_elements",
]


def model_state_elements(
    num_experts: int,
    dim: int,
    hidden: int,
    *,
    local_experts: int = 1,
    matrices_per_expert: int = 2,
    biases: bool = False,
) -> float:
    """Eq. 1: parameters, gradients and Adam's two moments of the gate and the local experts
    (with `biases`: an expert's H-wide gate/up biases and M-wide output bias, the gate's E)."""
    per_expert = matrices_per_expert * hidden * dim
    gate = num_experts * dim
    if biases:
        per_expert += (matrices_per_expert - 1) * hidden + dim
        gate += num_experts
    return 4 * (gate + per_expert * local_experts)


def activation_elements(tokens: int, dim: int, hidden: int, *, middle_tensors: int = 1) -> float:
    """Eq. 2: T_I, T_DI, T_DO, T_O (`[B, M]` each) and T_M (`[B, H]` per middle tensor)."""
    return 4 * tokens * dim + middle_tensors * tokens * hidden


def temporary_buffer_elements(
    tokens: int, dim: int, hidden: int, *, middle_tensors: int = 1
) -> float:
    """Eq. 3: peak gradient buffers of a sequential backward (two adjacent tensors)."""
    return tokens * dim + middle_tensors * tokens * hidden


def pipelined_buffer_elements(
    tokens: int, dim: int, hidden: int, *, middle_tensors: int = 1
) -> float:
    """Eq. 4: with pipelining the gradient buffers peak at the activations' size."""
    return activation_elements(tokens, dim, hidden, middle_tensors=middle_tensors)


def reuse_saving_elements(
    tokens: int, dim: int, hidden: int, partitions: int, *, middle_tensors: int = 1
) -> float:
    """Eq. 5: what shared partition buffers save, in activations (and again in buffers).

    T_DI and T_DO keep two `B/n` buffers each (one communicating, one computing), T_M one.
    """
    n = partitions
    return tokens * (2 * dim * (n - 2) / n + middle_tensors * hidden * (n - 1) / n)


def reuse_saving_ratio(
    tokens: int,
    dim: int,
    hidden: int,
    partitions: int,
    num_experts: int,
    *,
    local_experts: int = 1,
    matrices_per_expert: int = 2,
    middle_tensors: int = 1,
    biases: bool = False,
) -> float:
    """Eq. 6: saving of activations plus buffers over model states + activations + buffers."""
    saving = reuse_saving_elements(tokens, dim, hidden, partitions, middle_tensors=middle_tensors)
    total = (
        model_state_elements(
            num_experts,
            dim,
            hidden,
            local_experts=local_experts,
            matrices_per_expert=matrices_per_expert,
            biases=biases,
        )
        + activation_elements(tokens, dim, hidden, middle_tensors=middle_tensors)
        + pipelined_buffer_elements(tokens, dim, hidden, middle_tensors=middle_tensors)
    )
    return 2 * saving / total
