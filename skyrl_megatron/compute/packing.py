"""Packed (THD) and context-parallel layouts of a padded batch: the input side of packed training.

A batch arrives padded, as skyrl-train's TrainingInputBatch holds it: `sequences` [B, S] and an
`attention_mask` [B, S] with a left-padded prompt and a right-padded response::

    row 0:  _ _ p p p r r _        (_ padding, p prompt, r response)
    row 1:  p p p p r r r r

**Packing** drops the padding and lays the rows end to end in one row [1, T] (THD: "total tokens" x
heads x head dim inside attention)::

    tokens:       p p p r r · · · p p p p r r r r        (· alignment padding, here for CP = 2)
    position_ids: 0 1 2 3 4 5 6 7 0 1 2 3 4 5 6 7        (restart at 0 for every sequence)
    cu_seqlens:   [0, 8, 16]                             (sequence i is tokens[cu[i]:cu[i+1]])

Each sequence is padded at its end: to a multiple of 2*CP under context parallelism, and the last one
further so that every CP rank's share of T divides evenly among the TP ranks under sequence
parallelism. Padding sits after a sequence's real tokens, so under causal attention it never changes
them; it belongs to that sequence (its positions continue the sequence's). `PackedSeqParams` carries
the padded boundaries (as `cu_seqlens_*` and `cu_seqlens_*_padded` alike): Megatron's RoPE and our
core attention read the layout from them.

**Context parallelism** uses Megatron's load-balanced split: a sequence (length a multiple of 2*CP) is
cut into 2*CP equal chunks, and CP rank r holds chunks r and 2*CP-1-r, in that order, so that every
rank has the same causal-attention work. For CP = 2 and one sequence of 8 tokens::

    global:  0 1 2 3 4 5 6 7
    rank 0:  0 1 6 7            rank 1:  2 3 4 5

A packed row is split sequence by sequence (each rank's pieces in sequence order; `PackedSeqParams`
stay global on every rank); a padded batch [B, S] is split along S, each row being one sequence of
length S. :class:`ContextParallelSplit` slices inputs for a rank and gathers per-token outputs back
into global order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from skyrl_megatron.parallel import ParallelConfig

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


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
    def for_packed(cls, packed: PackedBatch, cp_rank: int, cp_size: int) -> ContextParallelSplit:
        return cls(packed.seq_lengths_padded, cp_rank, cp_size)

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


@dataclass(frozen=True)
class PackedBatch:
    """A padded batch packed into one THD row, and what is needed to map outputs back."""

    tokens: Tensor  # [1, T]
    position_ids: Tensor  # [1, T]
    packed_seq_params: PackedSeqParams  # global padded boundaries, the same on every CP rank
    seq_lengths: tuple[int, ...]  # real tokens per sequence
    seq_lengths_padded: tuple[int, ...]  # tokens per sequence in the packed row (they sum to T)
    batch_shape: tuple[int, int]  # (B, S) of the padded batch
    padded_index: Tensor  # [N] flat positions in the [B*S] padded batch of the real tokens,
    packed_index: Tensor  # [N] and their positions in the packed row

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[1]


def packing_alignment(parallel: ParallelConfig) -> tuple[int, int]:
    """(multiple for each sequence's length, multiple for the packed row's length T)."""
    per_sequence = 2 * parallel.context if parallel.context > 1 else 1
    # under SP each CP rank's T / CP tokens are split again over the TP ranks
    total = per_sequence * (parallel.tensor if parallel.sequence_parallel else 1)
    return per_sequence, total


@dataclass(frozen=True)
class PackingSettings:
    """How rows become model inputs: padded or packed, for the TP/SP/CP sizes that constrain lengths.

    Under context parallelism every sequence is cut into 2 x CP equal chunks, and under sequence
    parallelism each CP rank's share must divide among the TP ranks (see the module docstring).
    """

    packed: bool = False
    tensor: int = 1
    sequence_parallel: bool = False
    context: int = 1

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(tensor=self.tensor, context=self.context, sequence_parallel=self.sequence_parallel)

    @property
    def row_align(self) -> int:
        """Multiple for a padded row's length (and a packed row's total length)."""
        return packing_alignment(self.parallel)[1]


def packed_lengths(seq_lengths: Sequence[int], parallel: ParallelConfig, min_tokens: int = 0) -> list[int]:
    """Each sequence's length in the packed row (alignment padding included; they sum to T)."""
    per_sequence, total = packing_alignment(parallel)
    padded = [round_up(n, per_sequence) for n in seq_lengths]
    padded[-1] += round_up(sum(padded), total) - sum(padded)
    if min_tokens % total:
        raise ValueError(f"min_tokens={min_tokens} is not a multiple of the row alignment {total}")
    padded[-1] += max(0, min_tokens - sum(padded))
    return padded


def pack_padded_batch(
    tokens: Tensor,
    attention_mask: Tensor,
    parallel: ParallelConfig = ParallelConfig(),
    pad_token_id: int = 0,
    min_tokens: int = 0,
) -> PackedBatch:
    """Pack the real tokens (`attention_mask` == 1) of a padded batch [B, S] into one row [1, T].

    Tokens keep their order within a row. Alignment padding for `parallel` (see the module
    docstring) is filled with `pad_token_id`. `min_tokens` (a multiple of the row alignment) pads
    the last sequence further: pipeline stages exchange fixed-shape activations, so every
    micro-batch of one schedule call is given the same T.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    if tokens.dim() != 2 or tokens.shape != attention_mask.shape:
        raise ValueError(
            f"tokens {tuple(tokens.shape)} and attention_mask {tuple(attention_mask.shape)} must both be [B, S]"
        )
    batch, seq = tokens.shape
    device = tokens.device
    mask = attention_mask.bool()
    seq_lengths = tuple(int(n) for n in mask.sum(dim=1).tolist())
    if not any(seq_lengths):
        raise ValueError("the batch has no tokens (attention_mask is all zero)")
    padded = packed_lengths(seq_lengths, parallel, min_tokens)
    starts = [0]
    for length in padded:
        starts.append(starts[-1] + length)

    padded_index = mask.reshape(-1).nonzero().squeeze(1)  # row-major: sequence by sequence, in order
    packed_index = torch.cat([torch.arange(start, start + n) for start, n in zip(starts, seq_lengths)]).to(device)
    packed_tokens = torch.full((starts[-1],), pad_token_id, dtype=tokens.dtype, device=device)
    packed_tokens[packed_index] = tokens.reshape(-1)[padded_index]
    position_ids = torch.cat([torch.arange(length) for length in padded]).to(device)

    cu_seqlens = torch.tensor(starts, dtype=torch.int32, device=device)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens,
        cu_seqlens_kv_padded=cu_seqlens,
        max_seqlen_q=max(padded),
        max_seqlen_kv=max(padded),
    )
    return PackedBatch(
        tokens=packed_tokens.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        packed_seq_params=params,
        seq_lengths=seq_lengths,
        seq_lengths_padded=tuple(padded),
        batch_shape=(batch, seq),
        padded_index=padded_index,
        packed_index=packed_index,
    )


def unpack_to_padded(packed_output: Tensor, packed: PackedBatch, fill_value: float = 0.0) -> Tensor:
    """Per-token outputs of the packed row [1, T, ...] -> [B, S, ...] at the tokens' padded positions;
    padding positions get `fill_value`."""
    if tuple(packed_output.shape[:2]) != (1, packed.num_tokens):
        raise ValueError(f"expected packed output [1, {packed.num_tokens}, ...], got {tuple(packed_output.shape)}")
    batch, seq = packed.batch_shape
    features = packed_output.shape[2:]
    out = packed_output.new_full((batch * seq, *features), fill_value)
    out[packed.padded_index] = packed_output[0, packed.packed_index]
    return out.reshape(batch, seq, *features)
