"""Megatron's load-balanced context-parallel (CP) layout: which tokens each CP rank holds.

A sequence (length a multiple of 2*CP) is cut into 2*CP equal chunks, and CP rank r holds chunks r and
2*CP-1-r, in that order, so that every rank has the same causal-attention work. For CP = 2 and one
sequence of 8 tokens::

    global:  0 1 2 3 4 5 6 7
    rank 0:  0 1 6 7            rank 1:  2 3 4 5

A packed (THD) row is split sequence by sequence at its padded boundaries (each rank's pieces in
sequence order; `PackedSeqParams` stay global on every rank); a padded batch [B, S] is split along S,
each row being one sequence of length S. The core attention (`model/layers/attention.py`) reads this layout;
the micro-batch steps (`compute/microbatch/`) slice inputs with :class:`ContextParallelSplit` and
gather per-token outputs back into global order with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams


def context_parallel_chunks(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunk indices (of 2*CP per sequence) that CP rank `cp_rank` holds, in local order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def context_parallel_index(seq_lengths: Sequence[int], cp_rank: int, cp_size: int) -> Tensor:
    """Global indices (into sequences of `seq_lengths` laid end to end) of the tokens that CP rank
    `cp_rank` holds, in its local order. Each length must be a multiple of 2*CP (when CP > 1)."""
    if cp_size == 1:
        return torch.arange(sum(seq_lengths))
    pieces = []
    start = 0
    for length in seq_lengths:
        if length % (2 * cp_size):
            raise ValueError(
                f"sequence length {length} is not a multiple of 2*CP = {2 * cp_size}; "
                "pad sequences first (pack_padded_batch does this for packed batches)"
            )
        chunk = length // (2 * cp_size)
        for index in context_parallel_chunks(cp_rank, cp_size):
            pieces.append(torch.arange(start + index * chunk, start + (index + 1) * chunk))
        start += length
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)


def gathered_to_global_index(seq_lengths: Sequence[int], cp_size: int) -> Tensor:
    """For the rank-major concatenation of every CP rank's local tokens: where each global token is.
    `gathered.index_select(dim, this)` puts a gathered tensor into global order."""
    gathered_positions = torch.cat(
        [context_parallel_index(seq_lengths, rank, cp_size) for rank in range(cp_size)]
    )
    index = torch.empty_like(gathered_positions)
    index[gathered_positions] = torch.arange(gathered_positions.numel())
    return index


@dataclass(frozen=True)
class ContextParallelSplit:
    """One CP rank's share of sequences laid end to end along a tensor dimension.

    For a padded batch [B, S] that is the single sequence length S along dim 1
    (:meth:`for_padded`); for a packed row [1, T] the packed sequences' padded lengths
    (:meth:`for_packed`).
    """

    seq_lengths: tuple[int, ...]
    cp_rank: int
    cp_size: int

    @classmethod
    def for_padded(cls, seq_len: int, cp_rank: int, cp_size: int) -> ContextParallelSplit:
        return cls((seq_len,), cp_rank, cp_size)

    @classmethod
    def for_packed(cls, packed_seq_params: PackedSeqParams, cp_rank: int, cp_size: int) -> ContextParallelSplit:
        """The split of a packed row at the padded sequence boundaries its `PackedSeqParams` carry."""
        cu = packed_seq_params.cu_seqlens_q_padded.tolist()
        return cls(tuple(b - a for a, b in zip(cu[:-1], cu[1:])), cp_rank, cp_size)

    def local(self, tensor: Tensor, dim: int = 1) -> Tensor:
        """This rank's tokens of `tensor` (global order along `dim`), in local order."""
        index = context_parallel_index(self.seq_lengths, self.cp_rank, self.cp_size)
        return tensor.index_select(dim, index.to(tensor.device))

    def restore_global_order(self, gathered: Tensor, dim: int = 1) -> Tensor:
        """Rank-major concatenation of every rank's local tokens along `dim` -> global order."""
        index = gathered_to_global_index(self.seq_lengths, self.cp_size)
        return gathered.index_select(dim, index.to(gathered.device))

    def gather(self, local: Tensor, group: dist.ProcessGroup | None, dim: int = 1) -> Tensor:
        """All-gather per-token outputs over the CP group and return them in global order.

        Forward only (no autograd): it is for outputs such as logprobs going back to the host; the
        training loss is computed on each rank's local tokens.
        """
        if self.cp_size == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(self.cp_size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return self.restore_global_order(torch.cat(parts, dim=dim), dim=dim)
