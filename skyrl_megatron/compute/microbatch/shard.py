"""Step 4, shard: this rank's share of a micro-batch's tokens, under context and sequence parallelism.

Context parallelism (CP): Megatron's load-balanced split (`model/layers/context_parallel_layout.py`, the
layout the core attention reads). A padded batch [b, s] is one sequence of length s per row; a packed
row [1, T] is split sequence by sequence at its padded boundaries. The model inputs and the logprob
labels keep the model layout [b, s / CP].

Sequence parallelism (SP): the model itself splits the tokens over the TP ranks, but the routers of an
MoE layer see them in Megatron's [s, b] order, flattened, and under SP only this TP rank's slice of s
(`SequenceParallelSlice`). The per-token data for the routers (the real-token mask that router metrics
count, the padding and routes of routing replay) is laid out in that order here; `results.py` maps
what the routers recorded back with the same slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from skyrl_megatron.compute.microbatch.pack import ModelInputs, PackedMicroBatch
from skyrl_megatron.model.layers.context_parallel_layout import ContextParallelSplit
from skyrl_megatron.parallel import ParallelConfig


@dataclass(frozen=True)
class SequenceParallelSlice:
    """Which tokens of this CP rank's share the routers of this TP rank see, and in what order."""

    tp_rank: int = 0
    tp_size: int = 1  # 1 without sequence parallelism: every TP rank's routers see all tokens

    @classmethod
    def of(cls, parallel: ParallelConfig) -> SequenceParallelSlice:
        if not parallel.sequence_parallel or parallel.tensor == 1:
            return cls()
        from megatron.core import parallel_state as ps

        return cls(ps.get_tensor_model_parallel_rank(), parallel.tensor)

    def router_order(self, per_token: torch.Tensor) -> torch.Tensor:
        """[b, s, ...] in the model layout -> [tokens, ...] as the routers see them: [s, b] flattened,
        only this TP rank's slice of s under sequence parallelism."""
        order = per_token.transpose(0, 1)
        if self.tp_size > 1:
            order = order.chunk(self.tp_size, dim=0)[self.tp_rank]
        return order.reshape(-1, *per_token.shape[2:])

    def model_order(self, per_router_token: torch.Tensor, shape: tuple[int, int], group) -> torch.Tensor:
        """The inverse of `router_order`: [tokens, ...] -> [b, s, ...] for `shape` = (b, s), gathered over
        the TP `group` under sequence parallelism (collective there)."""
        if self.tp_size > 1:
            parts = [torch.empty_like(per_router_token) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, per_router_token.contiguous(), group=group)
            per_router_token = torch.cat(parts, dim=0)
        b, s = shape
        return per_router_token.reshape(s, b, *per_router_token.shape[1:]).transpose(0, 1)


@dataclass(frozen=True)
class RankShare:
    """This rank's share of one micro-batch: the model inputs and labels in the model layout (this CP
    rank's tokens), the routers' data in their order (each None where not asked for)."""

    cp_split: ContextParallelSplit | None  # None without context parallelism
    sp_slice: SequenceParallelSlice
    input_ids: torch.Tensor  # [b, s / CP]
    position_ids: torch.Tensor
    labels: torch.Tensor
    real_tokens: torch.Tensor | None  # [tokens] bool
    padding: torch.Tensor | None  # [tokens] bool
    routes: torch.Tensor | None  # [tokens, L, k]


def shard(packed: PackedMicroBatch, parallel: ParallelConfig) -> RankShare:
    """This rank's share of `packed` under `parallel`'s context and sequence parallelism."""
    inputs = packed.inputs
    split = context_split(inputs, _context_parallel_rank(parallel), parallel.context)
    sp_slice = SequenceParallelSlice.of(parallel)

    def local(per_token: torch.Tensor) -> torch.Tensor:
        return per_token if split is None else split.local(per_token, dim=1)

    def for_routers(per_token: torch.Tensor | None) -> torch.Tensor | None:
        return None if per_token is None else sp_slice.router_order(local(per_token))

    return RankShare(
        cp_split=split,
        sp_slice=sp_slice,
        input_ids=local(inputs.input_ids),
        position_ids=local(inputs.position_ids),
        labels=local(inputs.labels),
        real_tokens=for_routers(packed.real_tokens),
        padding=for_routers(packed.padding),
        routes=for_routers(packed.routes),
    )


def context_split(inputs: ModelInputs, cp_rank: int, cp_size: int) -> ContextParallelSplit | None:
    """The split of `inputs` for CP rank `cp_rank`; None without context parallelism."""
    if cp_size == 1:
        return None
    if inputs.packed_seq_params is None:
        return ContextParallelSplit.for_padded(inputs.input_ids.shape[1], cp_rank, cp_size)
    return ContextParallelSplit.for_packed(inputs.packed_seq_params, cp_rank, cp_size)


def _context_parallel_rank(parallel: ParallelConfig) -> int:
    if parallel.context == 1:
        return 0
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_rank()
