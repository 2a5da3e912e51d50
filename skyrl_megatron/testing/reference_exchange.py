"""Megatron's way of moving MoE rows between EP ranks, as the reference for parity checks of the
device-side exchange (`model/moe/device_all_to_all.py`): host split sizes, `all_to_all_single`, and the
non-fused split-and-concatenate regrouping. Used by tests/test_device_all_to_all.py and
bench/gpu_device_all_to_all_check.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


class _HostSplitsAllToAll(torch.autograd.Function):
    """Megatron's `tensor_parallel.all_to_all` (host split sizes; the backward swaps them), written
    here because Megatron's allocates on a CUDA device and so cannot run on CPU."""

    @staticmethod
    def forward(ctx, rows: Tensor, receive: list[int], send: list[int]) -> Tensor:
        ctx.receive, ctx.send = receive, send
        out = rows.new_empty(sum(receive), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), receive, send)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _HostSplitsAllToAll.apply(grad, ctx.send, ctx.receive), None, None


def host_splits_all_to_all(rows: Tensor, receive: list[int], send: list[int]) -> Tensor:
    """`send[r]` rows to rank r, `receive[r]` rows from it, differentiable."""
    return _HostSplitsAllToAll.apply(rows, receive, send)


def split_and_concatenate(rows: Tensor, sizes: Tensor, order: Tensor) -> Tensor:
    """Megatron's non-fused `sort_chunks_by_idxs`: split by host sizes, concatenate in `order`."""
    chunks = torch.split(rows, sizes.tolist(), dim=0)
    return torch.cat([chunks[i] for i in order.tolist()], dim=0)
