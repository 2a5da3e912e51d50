"""The Triton kernel behind `token_permute`'s row gathers (imported only where it runs).

out[r] = x[index[r]] for rows of x [rows, hidden]: the permutation's forward (each token copied once per chosen
expert) and the unpermute's backward. PyTorch's `index_select` runs these as its `vectorized_gather_kernel`: at
the Qwen3-30B-A3B widths (hidden 2,048, bf16, top-8) a scoring pass spent 19.5 ms in 38 calls of it, about
0.51 ms per 16,384-token micro-batch for the 0.54 GB it writes and at most as much it reads (about 2.1 TB/s,
profiled 2026-12-03 on an H200), where the combine's one-pass row sums (`row_sum_kernels.py`), reading rows in
the same scattered order, ran at 3.4 TB/s. Here one program copies one row: 16-byte loads and stores per thread
at hidden 2,048 in bf16, the source row's number read once.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

# columns per program: a 2,048-wide bf16 row in one program of 4 warps, 16 elements (two 16-byte vectors) a thread
_BLOCK = 2048
_WARPS = 4


@triton.jit
def _gather_rows_kernel(x_ptr, index_ptr, out_ptr, hidden, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    source = tl.load(index_ptr + row).to(tl.int64)
    tl.store(out_ptr + row * hidden + cols, tl.load(x_ptr + source * hidden + cols, mask=mask), mask=mask)


def gather_rows(x: Tensor, index: Tensor, out: Tensor) -> None:
    """out [len(index), hidden] = x [rows, hidden] at the row numbers `index` (int64); all contiguous, at least
    one output row."""
    hidden = x.shape[1]
    grid = (index.numel(), triton.cdiv(hidden, _BLOCK))
    _gather_rows_kernel[grid](x, index, out, hidden, BLOCK=_BLOCK, num_warps=_WARPS)
