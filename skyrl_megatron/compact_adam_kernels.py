"""AdamW over compact master weights in one Triton pass (imported only where Triton runs): the master joined from its
bf16 weight and int16 remainder, updated, rounded back into the weight and split again, never written in fp32.

Today's step over a run of compact masters is four passes: the join writes each fp32 master (reads 4 bytes a
parameter, writes 4), torch's fused AdamW reads the master, its gradient and both moments and writes the master and
the moments back (28 bytes; 32 where it writes the unclipped gradient back), and the release's round-and-split
reads the master again and writes the weight and remainder (8): 44-48 bytes a parameter. This pass reads the
weight, the remainder, the gradient and both moments and writes the weight, the remainder and both moments: 28.

The ties rounded down (a remainder of -2**15 that stands for +2**15, listed by index) are raised into the weight
before the pass (`compact_adam.queue_run_step`: the weight plus one over a remainder of -2**15 is the same master,
and the pass rewrites the weight anyway); the pass lists its own new ties as one bit per element in the blocks
that hold one, and `tie_indices` reads only those blocks.

The arithmetic is the AdamW of `compact_adam.adam_step_reference`, operation for operation in fp32 with IEEE
division and square root, compiled without contracting multiplies and adds into FMAs: bitwise equal to that eager
reference on the same device (and under Triton's interpreter on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from skyrl_megatron.master_weights_kernels import block_stats, first_tie_slots, rounded_upper, store_split

BLOCK = 4096  # elements per program (a block never straddles two tensors: `Blocks`)
_WORDS = BLOCK // 16  # one int16 word of tie bits per 16 elements: 1/8 byte an element, every run's until `settle`


@dataclass(frozen=True)
class Blocks:
    """The blocks that cover a run's tensors, in ascending order, each inside one tensor and at most `BLOCK`
    elements: where each starts (int64), how many elements (int32), its tensor's parameter group (int32)."""

    starts: Tensor
    counts: Tensor
    groups: Tensor
    # every block's start and length a multiple of 8 elements: the pass reads and writes 16 bytes at a time
    # (Megatron starts each parameter at a multiple of 64 elements; a shard cut by a data-parallel range may not)
    aligned: bool


def block_table(spans, device: torch.device) -> Blocks:
    """The `Blocks` over `spans` ([start, stop, group] of each tensor of a run). Build once per run and keep: the
    spans do not change between steps."""
    spans = torch.tensor(sorted(spans), dtype=torch.int64).view(-1, 3)
    lengths = spans[:, 1] - spans[:, 0]
    blocks = (lengths + BLOCK - 1) // BLOCK
    owner = torch.repeat_interleave(torch.arange(spans.shape[0]), blocks)
    first = torch.cumsum(blocks, 0) - blocks
    starts = spans[owner, 0] + (torch.arange(owner.numel()) - first[owner]) * BLOCK
    counts = torch.minimum(spans[owner, 1] - starts, torch.tensor(BLOCK))
    aligned = bool(((spans[:, 0] % 8 == 0) & (lengths % 8 == 0)).all())
    return Blocks(starts.to(device), counts.to(torch.int32).to(device), spans[owner, 2].to(torch.int32).to(device),
                  aligned)


@triton.jit
def _adam_round_split_kernel(upper_ptr, remainder_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, start_ptr, count_ptr,
                             group_ptr, hyper_ptr, skip_ptr, scale_ptr, partial_ptr, tie_bits_ptr,
                             HAS_SCALE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    block = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    start, count = tl.load(start_ptr + block), tl.load(count_ptr + block)
    if ALIGNED:  # every block's start and length a multiple of 8 elements (checked on the host): 16-byte accesses
        start, count = tl.multiple_of(start, 8), tl.multiple_of(count, 8)
    inside = lanes < count
    offsets = start + lanes
    row = hyper_ptr + tl.load(group_ptr + block).to(tl.int64) * 8
    upper = tl.load(upper_ptr + offsets, mask=inside, other=0).to(tl.int64)
    remainder = tl.load(remainder_ptr + offsets, mask=inside, other=0).to(tl.int64)
    master = (upper * 65536 + remainder).to(tl.int32).to(tl.float32, bitcast=True)
    grad = tl.load(grad_ptr + offsets, mask=inside, other=0.0)
    if HAS_SCALE:  # the clip: the gradient divided by the inverse of its coefficient, as torch's fused Adam does
        grad = tl.math.div_rn(grad, tl.load(scale_ptr))
    exp_avg = tl.load(exp_avg_ptr + offsets, mask=inside, other=0.0)
    exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=inside, other=0.0)
    decayed = master - tl.load(row) * master
    new_avg = tl.load(row + 1) * exp_avg + tl.load(row + 2) * grad
    new_avg_sq = tl.load(row + 3) * exp_avg_sq + tl.load(row + 4) * grad * grad
    denom = tl.math.div_rn(tl.sqrt_rn(new_avg_sq), tl.load(row + 6)) + tl.load(row + 7)
    updated = decayed - tl.math.div_rn(tl.load(row + 5) * new_avg, denom)
    skip = tl.load(skip_ptr) != 0  # a non-finite gradient norm: everything stays as it was
    updated = tl.where(skip, master, updated)
    tl.store(exp_avg_ptr + offsets, tl.where(skip, exp_avg, new_avg), mask=inside)
    tl.store(exp_avg_sq_ptr + offsets, tl.where(skip, exp_avg_sq, new_avg_sq), mask=inside)
    bits = updated.to(tl.int32, bitcast=True).to(tl.int64)
    new_upper = rounded_upper(bits)
    tl.store(upper_ptr + offsets, new_upper, mask=inside)
    diff = bits - new_upper.to(tl.int64) * 65536
    store_split(diff, inside, offsets, block, remainder_ptr, partial_ptr)
    tie = (diff == 32768).to(tl.int32)
    if tl.sum(tie, axis=0) > 0:  # about one block in thirty: the others write no bits
        shifts = tl.arange(0, 16)
        words = tl.sum(tl.reshape(tie, (BLOCK // 16, 16)) << shifts[None, :], axis=1).to(tl.int16)  # bit 15: sign
        tl.store(tie_bits_ptr + block * (BLOCK // 16) + tl.arange(0, BLOCK // 16), words)


@triton.jit
def _tie_index_kernel(start_ptr, partial_ptr, tie_bits_ptr, first_ptr, out_ptr, BLOCK: tl.constexpr):
    block = tl.program_id(0).to(tl.int64)
    if tl.load(partial_ptr + block * 2 + 1) > 0:
        words = tl.load(tie_bits_ptr + block * (BLOCK // 16) + tl.arange(0, BLOCK // 16))
        tie = tl.reshape((words[:, None] >> tl.arange(0, 16)[None, :]) & 1, (BLOCK,))
        slot = tl.load(first_ptr + block) + tl.cumsum(tie.to(tl.int64), axis=0) - 1
        tl.store(out_ptr + slot, tl.load(start_ptr + block) + tl.arange(0, BLOCK), mask=tie != 0)


def adam_round_split(upper: Tensor, remainder: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor,
                     blocks: Blocks, hyper: Tensor, skip: Tensor,
                     scale: Tensor | None) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor]]:
    """One AdamW step over the `blocks` of a run (`hyper`: fp32 [groups, 8], a `compact_adam.AdamScalars.row`
    each), in place: `upper` (the weights' int16 bits, ties raised), `remainder` (int16), `exp_avg` and
    `exp_avg_sq` (fp32) over the run's span, `grad` (fp32) read.
    `skip` (a 0-d fp32 tensor, nonzero: leave every value as it was) and `scale` (0-d fp32, the gradient's
    divisor, or None) are read on the device.

    Returns (remainder, stats int64 [worst status, ties] as the split's, what `tie_indices` needs)."""
    count = blocks.starts.numel()
    partials = torch.empty(count, 2, dtype=torch.int32, device=upper.device)
    tie_bits = torch.empty(count, _WORDS, dtype=torch.int16, device=upper.device)
    if count:
        _adam_round_split_kernel[(count,)](
            upper, remainder, grad, exp_avg, exp_avg_sq, blocks.starts, blocks.counts, blocks.groups, hyper, skip,
            skip if scale is None else scale, partials, tie_bits, HAS_SCALE=scale is not None, ALIGNED=blocks.aligned,
            BLOCK=BLOCK, num_warps=8, enable_fp_fusion=False)
    stats = block_stats(partials) if count else torch.zeros(2, dtype=torch.int64, device=upper.device)
    return remainder, stats, (blocks.starts, partials, tie_bits)


def tie_indices(found: tuple[Tensor, Tensor, Tensor], count: int) -> Tensor:
    """The int64 indices (into the run), ascending, of the `count` ties rounded down that `adam_round_split` found:
    only the blocks holding one are read."""
    starts, partials, tie_bits = found
    out = torch.empty(count, dtype=torch.int64, device=starts.device)
    if count:
        _tie_index_kernel[(starts.numel(),)](starts, partials, tie_bits, first_tie_slots(partials), out, BLOCK=BLOCK,
                                             num_warps=8)
    return out
