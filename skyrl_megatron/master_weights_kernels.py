"""The Triton kernels behind compact master weights on GPUs (imported only where they run).

The split, one pass per master (or run of masters): each element's int16 remainder, and per block of elements its
worst status and its count of ties rounded down, reduced over the blocks by torch on a few thousand values. The
generated elementwise split it replaces wrote an int8 status per element that torch's reductions then read:
`sum(dtype=int64)` over int8 first widens its input into an int64 copy (8 bytes written and read again per
element). At the Qwen3-30B-A3B widths with 8 layers (5.5B parameters on one H200) the split, that cast and the
two reductions took 45 ms of kernels per optimizer step (profiled 2026-12-04); this pass moves 8 bytes per
element, about 10 ms. The ties' indices then come from the blocks that hold one, where a generated tie mask and
`nonzero_static` read every element again (13 ms profiled for `nonzero_static` at that shape, about 9 more
for the mask by its traffic).

The join, one pass per run: the master's bits from its model weight and remainder, then the listed ties raised by
2**16 (distinct indices, one program each block of them). It replaces a torch.compile-generated join and an
indexed add (three more kernels): a generated call goes through dynamo's guards at every call, and the optimizer
step around these calls idled about 67 ms in 63 gaps with no host operation recorded at that shape (profiled
2026-12-04); with the split and join both here the step makes no generated call.

Where the split follows the optimizer's step, the model weights are the masters rounded: the round-and-split pass
writes them itself (the master read once, where the optimizer's copy back and the split read it twice; 6 of 14
bytes an element less).

Statuses as in `master_weights._split_chunk`: 0 in range, 1 a tie rounded down (stored as -2**15), 2 a
difference int16 cannot hold.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 4096  # elements per program: 8 warps, 16 elements per thread
_TIE_BLOCK = 1024  # tie indices per program of the join's correction (about one element in 2**17 is a tie)


@triton.jit
def _differences(bits_ptr, upper_ptr, offsets, numel):
    """(master bits - model bits * 2**16 in int64, where offsets < numel): int64 so that an unrelated pair cannot
    wrap into range; past `numel` both load as 0, a difference of 0 (in range, no tie)."""
    inside = offsets < numel
    bits = tl.load(bits_ptr + offsets, mask=inside, other=0).to(tl.int64)
    upper = tl.load(upper_ptr + offsets, mask=inside, other=0).to(tl.int64)
    return bits - upper * 65536, inside


@triton.jit
def store_split(diff, inside, offsets, block, remainder_ptr, partial_ptr):
    """The remainders of one block's differences, and the block's [worst status, ties]."""
    tie = diff == 32768
    tl.store(remainder_ptr + offsets, tl.where(tie, -32768, diff).to(tl.int16), mask=inside)
    outside = (diff < -32768) | (diff > 32768)
    status = tl.where(outside, 2, tie.to(tl.int32))
    tl.store(partial_ptr + block * 2, tl.max(status, axis=0))
    tl.store(partial_ptr + block * 2 + 1, tl.sum(tie.to(tl.int32), axis=0))


@triton.jit
def _split_kernel(bits_ptr, upper_ptr, remainder_ptr, partial_ptr, numel, BLOCK: tl.constexpr):
    block = tl.program_id(0).to(tl.int64)
    offsets = block * BLOCK + tl.arange(0, BLOCK)
    diff, inside = _differences(bits_ptr, upper_ptr, offsets, numel)
    store_split(diff, inside, offsets, block, remainder_ptr, partial_ptr)


@triton.jit
def _round_split_kernel(bits_ptr, upper_ptr, remainder_ptr, partial_ptr, numel, BLOCK: tl.constexpr):
    """The split of masters whose model weights it writes: each master rounded to bf16 to nearest even, as
    PyTorch's copy rounds it (`rounded_upper`), stored as the weight, and split against it (a NaN's split against
    0x7FFF is exact as against any weight, or keeps the run in fp32 where the difference does not fit)."""
    block = tl.program_id(0).to(tl.int64)
    offsets = block * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    bits = tl.load(bits_ptr + offsets, mask=inside, other=0).to(tl.int64)
    upper = rounded_upper(bits)
    tl.store(upper_ptr + offsets, upper, mask=inside)
    store_split(bits - upper.to(tl.int64) * 65536, inside, offsets, block, remainder_ptr, partial_ptr)


@triton.jit
def rounded_upper(bits):
    """The bf16 bits (int16) of fp32 values given as their int32 bits widened to int64, rounded to nearest even as
    PyTorch's copy rounds them (a NaN becomes the NaN 0x7FFF). Integer arithmetic on the bit pattern: exact under
    Triton's interpreter too, whose float conversion truncates."""
    pattern = bits & 0xFFFFFFFF  # the unsigned bit pattern: sign and magnitude round alike
    rounded = (pattern + 0x7FFF + ((pattern >> 16) & 1)) >> 16  # the largest finite magnitudes carry into inf
    return tl.where((pattern & 0x7FFFFFFF) > 0x7F800000, 0x7FFF, rounded).to(tl.int16)


@triton.jit
def _tie_index_kernel(bits_ptr, upper_ptr, partial_ptr, first_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    block = tl.program_id(0).to(tl.int64)
    if tl.load(partial_ptr + block * 2 + 1) > 0:  # most blocks hold no tie: nothing read
        offsets = block * BLOCK + tl.arange(0, BLOCK)
        diff, _ = _differences(bits_ptr, upper_ptr, offsets, numel)
        tie = diff == 32768
        # this block's ties in order, after every earlier block's
        slot = tl.load(first_ptr + block) + tl.cumsum(tie.to(tl.int64), axis=0) - 1
        tl.store(out_ptr + slot, offsets, mask=tie)


@triton.jit
def _join_kernel(upper_ptr, remainder_ptr, bits_ptr, numel, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < numel
    upper = tl.load(upper_ptr + offsets, mask=inside).to(tl.int64)
    remainder = tl.load(remainder_ptr + offsets, mask=inside).to(tl.int64)
    # int64, then narrowed as `master_weights._join_chunk` narrows: a tie of the lowest weight is stored
    # 2**16 short and wraps below int32's range until its correction wraps it back
    tl.store(bits_ptr + offsets, (upper * 65536 + remainder).to(tl.int32), mask=inside)


@triton.jit
def _raise_ties_kernel(bits_ptr, index_ptr, count, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < count
    index = tl.load(index_ptr + offsets, mask=inside, other=0)
    bits = tl.load(bits_ptr + index, mask=inside).to(tl.int64)
    tl.store(bits_ptr + index, (bits + 65536).to(tl.int32), mask=inside)


def split_with_stats(bits: Tensor, upper: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(remainder int16, stats int64 [worst status, ties], the per-block checks for `tie_indices`) of a master's
    int32 bits and its model weight's int16 bits, both contiguous and one-dimensional, of the same length (at
    least one element)."""
    return _split_pass(_split_kernel, bits, upper)


def round_and_split_with_stats(bits: Tensor, upper: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`split_with_stats` of a master whose model weight `upper` (int16 bits of bf16, written here) is the master
    rounded: one pass reading the master once, where a copy into the model and a split read it twice."""
    return _split_pass(_round_split_kernel, bits, upper)


def _split_pass(kernel, bits: Tensor, upper: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    numel = bits.numel()
    remainder = torch.empty(numel, dtype=torch.int16, device=bits.device)
    blocks = triton.cdiv(numel, _BLOCK)
    partials = torch.empty(blocks, 2, dtype=torch.int32, device=bits.device)
    kernel[(blocks,)](bits, upper, remainder, partials, numel, BLOCK=_BLOCK, num_warps=8)
    return remainder, block_stats(partials), partials


def block_stats(partials: Tensor) -> Tensor:
    """int64 [worst status, ties] over the per-block [worst status, ties] that `store_split` wrote (at least one
    block)."""
    return torch.stack([partials[:, 0].amax().to(torch.int64), partials[:, 1].sum(dtype=torch.int64)])


def first_tie_slots(partials: Tensor) -> Tensor:
    """Where each block's ties start in the list of all ties (int64, one per block): the blocks' tie counts summed
    before it."""
    ties = partials[:, 1].to(torch.int64)
    return torch.cumsum(ties, 0) - ties


def tie_indices(bits: Tensor, upper: Tensor, partials: Tensor, count: int) -> Tensor:
    """The int64 indices, ascending, of the `count` ties rounded down that `split_with_stats` counted in
    `partials`: only the blocks holding one are read again (about one element in 2**17 is such a tie)."""
    out = torch.empty(count, dtype=torch.int64, device=bits.device)
    if count:
        _tie_index_kernel[(partials.shape[0],)](bits, upper, partials, first_tie_slots(partials), out, bits.numel(),
                                                BLOCK=_BLOCK, num_warps=8)
    return out


def join(upper: Tensor, remainder: Tensor, tie_indices: Tensor, out: Tensor | None = None) -> Tensor:
    """The master's int32 bits from its model weight's int16 bits and the int16 remainder (contiguous,
    one-dimensional, of the same length), the ties at `tie_indices` (int64, distinct) raised to +2**15; written
    into `out` (contiguous int32 of that length) where given."""
    numel = upper.numel()
    if out is not None and not (out.dtype == torch.int32 and out.numel() == numel and out.is_contiguous()
                                and out.device == upper.device):
        raise ValueError(f"join: out must be a contiguous int32 tensor of {numel} elements on {upper.device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    bits = torch.empty(numel, dtype=torch.int32, device=upper.device) if out is None else out
    if numel:
        _join_kernel[(triton.cdiv(numel, _BLOCK),)](upper, remainder, bits, numel, BLOCK=_BLOCK, num_warps=8)
    count = tie_indices.numel()
    if count:
        _raise_ties_kernel[(triton.cdiv(count, _TIE_BLOCK),)](bits, tie_indices, count, BLOCK=_TIE_BLOCK)
    return bits
