"""The Triton kernel behind `grad_accumulate.accumulate_` (imported only where it runs: triton at import)."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

# 8,192 elements per program over 8 warps: 32 per thread, so each thread's bf16 loads are 16-byte vectors
_BLOCK = 8192


@triton.jit
def _accumulate_kernel(target_ptr, addend_ptr, numel, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offsets = start + tl.arange(0, BLOCK)
    mask = offsets < numel
    total = tl.load(target_ptr + offsets, mask=mask) + tl.load(addend_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(target_ptr + offsets, total, mask=mask)


def accumulate_flat(target: Tensor, addend: Tensor) -> None:
    """target [n] fp32 += addend [n] (bf16/fp16), both contiguous on one device."""
    numel = target.numel()
    _accumulate_kernel[(triton.cdiv(numel, _BLOCK),)](target, addend, numel, BLOCK=_BLOCK, num_warps=8)
