"""Reordering MoE tokens between expert-parallel ranks and local experts on the device.

After the all-to-all, Megatron's alltoall dispatcher holds the received tokens grouped by source
rank, then expert ([EP x TP, local experts] chunks), and regroups them by expert, then rank, for
the grouped expert GEMMs (and back after them). Without Transformer Engine's fused kernel,
`moe_utils.sort_chunks_by_idxs` does that with a host-side split into every chunk and a
concatenation: four device-to-host syncs, one copy per chunk and a full copy of the tokens per
call, twice per MoE layer and pass, even with one EP rank, where the order does not change at all.

`sort_chunks_by_idxs` below computes the same reordering as one on-device gather (no host sync)
and returns its input untouched when the chunk order is the identity. `chunk_gather_index` is the
same index for a buffer sized for the worst case, whose real total only the device knows (the
device-side all-to-all, `model/moe/device_all_to_all.py`). `install()` puts it in the
dispatcher's namespace in place of Megatron's non-fused version; TE's fused kernel, where TE is
installed, is left to Megatron.
"""

from __future__ import annotations

import torch
from torch import Tensor

_INSTALLED = False


def chunk_order_rows(split_sizes: Tensor, sorted_idxs: Tensor, total: int) -> Tensor:
    """Row indices of the input, in output order, for chunks of `split_sizes` taken in `sorted_idxs` order."""
    sizes = split_sizes.to(torch.int64)
    starts = torch.cumsum(sizes, 0) - sizes
    out_sizes = sizes[sorted_idxs]
    out_starts = torch.cumsum(out_sizes, 0) - out_sizes
    # each output row: its chunk's start in the input plus its offset inside the chunk
    chunk_start = torch.repeat_interleave(starts[sorted_idxs], out_sizes, output_size=total)
    offset = torch.arange(total, device=sizes.device) - torch.repeat_interleave(out_starts, out_sizes, output_size=total)
    return chunk_start + offset


def expert_major_order(world: int, local_experts: int, device=None) -> Tensor:
    """Chunk order taking [source rank, local expert] chunks to [local expert, source rank]
    (Megatron's `sort_input_by_local_experts`)."""
    return torch.arange(world * local_experts, device=device).view(world, local_experts).t().flatten()


def source_major_order(world: int, local_experts: int, device=None) -> Tensor:
    """The inverse: [local expert, source rank] chunks back to [source rank, local expert]."""
    return torch.arange(world * local_experts, device=device).view(local_experts, world).t().flatten()


def chunk_gather_index(split_sizes: Tensor, chunk_order: Tensor, capacity: int) -> Tensor:
    """Input row for each of `capacity` output rows when packed chunks of `split_sizes` are taken in `chunk_order`.

    `chunk_order_rows` with a static output size (no host read of the total): output row p lies in
    the first output chunk whose inclusive end exceeds p (a `searchsorted`); its input row is that
    chunk's input start plus p's offset in it. Rows past the total (padding up to a worst case) are
    clamped to a valid row and carry no data anyone reads. The first `sum(split_sizes)` entries
    equal `chunk_order_rows`.
    """
    sizes = split_sizes.to(torch.int64)
    in_starts = torch.cumsum(sizes, 0) - sizes
    out_sizes = sizes[chunk_order]
    out_ends = torch.cumsum(out_sizes, 0)
    position = torch.arange(capacity, device=sizes.device)
    chunk = torch.searchsorted(out_ends, position, right=True).clamp_(max=sizes.numel() - 1)
    offset = position - (out_ends - out_sizes)[chunk]
    return (in_starts[chunk_order][chunk] + offset).clamp_(0, capacity - 1)


def sort_chunks_by_idxs(input: Tensor, split_sizes: Tensor, sorted_idxs: Tensor, probs: Tensor | None = None, fused: bool = False):
    """Megatron's `moe_utils.sort_chunks_by_idxs` (same arguments and results) without host syncs."""
    if fused:
        from megatron.core.transformer.moe import moe_utils

        return moe_utils.sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs=probs, fused=True)
    if _is_identity(sorted_idxs):
        return input, probs
    order = _on_device(sorted_idxs, input.device)
    rows = chunk_order_rows(split_sizes.to(input.device, non_blocking=True), order, input.shape[0])
    return _RowPermutation.apply(input, rows), (_RowPermutation.apply(probs, rows) if probs is not None else None)


class _RowPermutation(torch.autograd.Function):
    """out = x[rows] for a permutation `rows`; the gradient is a gather by the inverse permutation.

    `index_select`'s own backward is an `index_add_` (a scatter with atomics, about 0.9 ms per call at
    the 30B-A3B EP2 shape on an H200, twice per MoE layer and micro-batch): for a permutation every
    row receives exactly one value, so gathering by the inverse gives the same gradient bitwise.
    """

    @staticmethod
    def forward(ctx, x: Tensor, rows: Tensor) -> Tensor:
        ctx.save_for_backward(rows)
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        (rows,) = ctx.saved_tensors
        # the inverse is built here, not in forward: a scoring pass (no backward) never pays for it
        inverse = torch.empty_like(rows).scatter_(0, rows, torch.arange(rows.numel(), device=rows.device))
        return grad_output.index_select(0, inverse), None


def _is_identity(sorted_idxs: Tensor) -> bool:
    """Whether a chunk order changes nothing (decided once per order tensor: the dispatcher builds its
    orders at construction and reuses them)."""
    cached = getattr(sorted_idxs, "_skyrl_identity", None)
    if cached is None:
        cached = bool(torch.equal(sorted_idxs.cpu(), torch.arange(sorted_idxs.numel())))
        sorted_idxs._skyrl_identity = cached
    return cached


def _on_device(sorted_idxs: Tensor, device: torch.device) -> Tensor:
    """The order on the tokens' device, copied once per order tensor (Megatron keeps it on the host)."""
    if sorted_idxs.device == device:
        return sorted_idxs
    cached = getattr(sorted_idxs, "_skyrl_on_device", None)
    if cached is None or cached.device != device:
        cached = sorted_idxs.to(device)
        sorted_idxs._skyrl_on_device = cached
    return cached


def install() -> None:
    """Use the on-device reordering in Megatron's token dispatchers (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from megatron.core.transformer.moe import token_dispatcher

    token_dispatcher.sort_chunks_by_idxs = sort_chunks_by_idxs
    _INSTALLED = True
