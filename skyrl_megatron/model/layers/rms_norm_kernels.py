"""Triton kernels of the block's RMSNorm (`norm.FusedRMSNorm`, `fused_kernels: [rms_norm]`), forward and backward.

y = x * r * w with r = 1 / sqrt(mean(x^2) + eps) per row, in fp32, rounded once (as PyTorch's fused RMSNorm
computes it). The forward keeps r per row (4 bytes a row) for the backward:

    dx = r * (dy * w - x * r * mean(dy * w * x * r)),    dw = sum over rows of dy * x * r

Why hand-written: PyTorch's fused RMSNorm took 79 us per backward call of a 7.7k x 2,560 bf16 block on an
H200, about three times what its traffic needs (87 ms of a Qwen3-4B training call, profiled 2026-12-03), and
the torch.compile-generated norm lost its device savings to host time (four compiled calls per layer,
docs/performance.md). Here the forward is one program per row; the backward takes `_ROWS` rows per program,
keeps the weight gradient's partial sum of those rows in registers and writes it once ([programs, hidden] fp32,
which torch sums: a fixed grouping, so the sum does not depend on the device).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_ROWS = 32  # rows per backward program


def _launch(hidden: int) -> tuple[int, int]:
    """(columns per program: a row, rounded up to a power of two; warps: about 16 elements a thread)."""
    block = triton.next_power_of_2(hidden)
    return block, max(1, min(16, block // 512))


@triton.jit
def _forward_kernel(x_ptr, weight_ptr, out_ptr, inverse_rms_ptr, hidden, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    inverse_rms = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    tl.store(out_ptr + row * hidden + cols, (x * inverse_rms * w).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(inverse_rms_ptr + row, inverse_rms)


@triton.jit
def _backward_kernel(grad_ptr, x_ptr, weight_ptr, inverse_rms_ptr, grad_x_ptr, grad_weight_partial_ptr,
                     num_rows, hidden, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    grad_weight = tl.zeros((BLOCK,), dtype=tl.float32)
    first = program * ROWS
    for i in range(ROWS):
        row = (first + i).to(tl.int64)
        present = row < num_rows
        inside = mask & present
        dy = tl.load(grad_ptr + row * hidden + cols, mask=inside, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * hidden + cols, mask=inside, other=0.0).to(tl.float32)
        inverse_rms = tl.load(inverse_rms_ptr + row, mask=present, other=0.0)
        normed = x * inverse_rms
        grad_normed = dy * w
        mean = tl.sum(grad_normed * normed, axis=0) / hidden
        dx = inverse_rms * (grad_normed - normed * mean)
        tl.store(grad_x_ptr + row * hidden + cols, dx.to(grad_x_ptr.dtype.element_ty), mask=inside)
        grad_weight += dy * normed
    tl.store(grad_weight_partial_ptr + program * hidden + cols, grad_weight, mask=mask)


def rms_norm_forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(y [rows, hidden] in x's dtype, r [rows] fp32) of contiguous rows x [rows, hidden] (at least one row)."""
    rows, hidden = x.shape
    out = torch.empty_like(x)
    inverse_rms = torch.empty(rows, dtype=torch.float32, device=x.device)
    block, warps = _launch(hidden)
    _forward_kernel[(rows,)](x, weight, out, inverse_rms, hidden, eps, BLOCK=block, num_warps=warps)
    return out, inverse_rms


def rms_norm_backward(grad: Tensor, x: Tensor, weight: Tensor, inverse_rms: Tensor) -> tuple[Tensor, Tensor]:
    """(dx in x's dtype, dw in the weight's dtype) from the output's gradient and the forward's x and r; `grad`
    and `x` contiguous [rows, hidden]."""
    rows, hidden = x.shape
    grad_x = torch.empty_like(x)
    programs = triton.cdiv(rows, _ROWS)
    partial = torch.empty(programs, hidden, dtype=torch.float32, device=x.device)
    block, warps = _launch(hidden)
    _backward_kernel[(programs,)](grad, x, weight, inverse_rms, grad_x, partial, rows, hidden, ROWS=_ROWS,
                                  BLOCK=block, num_warps=warps)
    return grad_x, partial.sum(0).to(weight.dtype)
