"""MoE token dispatch and combine between expert-parallel ranks with every size on the device.

Megatron's alltoall dispatcher at EP > 1 copies the all-to-all's split sizes to the host and waits,
once per MoE layer and pass. Here the rows travel by `model/moe/row_exchange.py` (torch's NVSHMEM
all-to-all on GPUs, split sizes on the device) into an output sized for the worst case (every rank
sends all its rows here), and are regrouped from [source rank, local expert] chunks to [local
expert, source rank] by one gather whose index is computed on the device
(`token_sort.chunk_gather_index`). Nothing reads a size on the host.

    dispatch(rows, plan) -> [plan.capacity, ...]: this rank's rows (permuted by expert) to the ranks
        holding their experts; the result's first `plan.received` rows (known on the device only)
        are grouped by local expert, then source rank; the rest is padding nobody may read.
    combine(rows, plan) -> [plan.rows, ...]: the way back, from that layout to the original ranks,
        in the order the rows were sent.

Each is the other's backward (the roles of the splits swapped). Bitwise the same as Megatron's
path (host splits, `all_to_all_single`, `sort_chunks_by_idxs`) on the leading rows: all are copies.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from skyrl_megatron.model.moe.token_sort import chunk_gather_index, expert_major_order, source_major_order


@dataclass
class ExchangePlan:
    """One layer's routing between ranks, on the device.

    `received_counts` [world, local experts]: rows each source rank sends to each local expert here
    (Megatron's `num_global_tokens_per_local_expert`); `send_splits` [world]: rows this rank sends
    to each rank (Megatron's `input_splits`, left on the device); `rows`: rows this rank sends in all
    (static: tokens x top-k); `capacity`: the rows the expert side is sized for (the worst case).
    """

    exchange: object  # model/moe/row_exchange.py: NvshmemExchange or EmulatedExchange
    send_splits: Tensor
    received_counts: Tensor
    rows: int
    capacity: int

    # the regrouping indices, computed once per plan (tokens and probabilities share them) on the
    # device (the chunk orders too: no host-to-device copy in the step)
    @functools.cached_property
    def _expert_major_index(self) -> Tensor:
        world, local_experts = self.received_counts.shape
        order = expert_major_order(world, local_experts, self.received_counts.device)
        return chunk_gather_index(self.received_counts.flatten(), order, self.capacity)

    @functools.cached_property
    def _source_major_index(self) -> Tensor:
        world, local_experts = self.received_counts.shape
        order = source_major_order(world, local_experts, self.received_counts.device)
        return chunk_gather_index(self.received_counts.t().flatten(), order, self.capacity)

    def to_experts(self, rows: Tensor) -> Tensor:
        """[self.rows, ...] in this rank's permuted order -> [capacity, ...] grouped by local expert, then source."""
        landed = self.exchange.exchange(rows, self.send_splits, self.capacity)  # by source rank, then expert
        return landed.index_select(0, self._expert_major_index)

    def to_sources(self, rows: Tensor) -> Tensor:
        """[capacity, ...] grouped by local expert, then source -> [self.rows, ...] back on their ranks."""
        # regrouped to source-major order by the exchange's own gather (padding rows go last, unsent)
        back = self.exchange.exchange(rows, self.received_counts.sum(1), self.rows, take=self._source_major_index)
        return back.clone()  # the exchange may hand back its own buffer, reused by the next exchange


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: Tensor, plan: ExchangePlan) -> Tensor:
        ctx.plan = plan
        return plan.to_experts(rows)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.plan.to_sources(grad.contiguous()), None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: Tensor, plan: ExchangePlan) -> Tensor:
        ctx.plan = plan
        return plan.to_sources(rows)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.plan.to_experts(grad.contiguous()), None


def dispatch(rows: Tensor, plan: ExchangePlan) -> Tensor:
    """Rows permuted by expert -> the expert side's worst-case-sized input (see the module docstring)."""
    return _Dispatch.apply(rows, plan)


def combine(rows: Tensor, plan: ExchangePlan) -> Tensor:
    """The expert side's output -> this rank's rows, in the order `dispatch` took them."""
    return _Combine.apply(rows, plan)
