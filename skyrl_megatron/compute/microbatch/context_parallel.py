"""Step 4, context-parallel shard: this CP rank's tokens of a micro-batch's model inputs.

Megatron's load-balanced split (model/layers/context_parallel_layout.py, the layout the core attention
reads): a padded batch [b, s] is one sequence of length s per row; a packed row [1, T] is split
sequence by sequence at its padded boundaries.
"""

from __future__ import annotations

import torch

from skyrl_megatron.compute.microbatch.model_inputs import ModelInputs
from skyrl_megatron.model.layers.context_parallel_layout import ContextParallelSplit


def context_split(inputs: ModelInputs, cp_rank: int, cp_size: int) -> ContextParallelSplit | None:
    """The split of `inputs` for CP rank `cp_rank`; None without context parallelism."""
    if cp_size == 1:
        return None
    if inputs.packed_seq_params is None:
        return ContextParallelSplit.for_padded(inputs.input_ids.shape[1], cp_rank, cp_size)
    return ContextParallelSplit.for_packed(inputs.packed_seq_params, cp_rank, cp_size)


def shard(split: ContextParallelSplit | None, per_token: torch.Tensor) -> torch.Tensor:
    """This rank's share of `per_token` [b, s, ...] in the model layout (all of it without CP)."""
    return per_token if split is None else split.local(per_token, dim=1)
