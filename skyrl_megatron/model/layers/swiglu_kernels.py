"""Triton kernels of SwiGLU over the MLP's fused gate/up projection: y [rows, 2 * width] -> silu(y1) * y2.

Both directions read each input once and compute in fp32, rounding once. The backward writes the
gradients of both halves from one program: Megatron's backward (`swiglu_back`, torch.compile'd) builds
them as one concatenation, which Inductor turns into a kernel over the [rows, 2 * width] output that loads
its inputs per half under masks: 330 us per call at Qwen3-4B's 8k-token micro-batches on an H200 (about
2.4 TB/s of useful traffic; 107 ms of a training call, profiled 2026-11-28).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 1024  # columns per program: one row's stretch of both halves


@triton.jit
def _swiglu_forward_kernel(y_ptr, out_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate_ptr = y_ptr + row * (2 * width) + cols
    gate = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptr + width, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(grad_ptr, y_ptr, grad_y_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    grad = tl.load(grad_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
    gate_offsets = row * (2 * width) + cols
    gate = tl.load(y_ptr + gate_offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(y_ptr + gate_offsets + width, mask=mask, other=0.0).to(tl.float32)
    sigmoid = tl.sigmoid(gate)
    silu = gate * sigmoid
    # d silu / d gate = sigmoid * (1 + gate * (1 - sigmoid))
    grad_gate = grad * up * sigmoid * (1.0 + gate * (1.0 - sigmoid))
    tl.store(grad_y_ptr + gate_offsets, grad_gate.to(grad_y_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_y_ptr + gate_offsets + width, (grad * silu).to(grad_y_ptr.dtype.element_ty), mask=mask)


def _grid(rows: int, width: int) -> tuple[int, int]:
    return rows, triton.cdiv(width, _BLOCK)


def swiglu_forward(y: Tensor) -> Tensor:
    """silu(y1) * y2 for y [rows, 2 * width], contiguous; [rows, width] in y's dtype."""
    rows, width = y.shape[0], y.shape[1] // 2
    out = torch.empty(rows, width, dtype=y.dtype, device=y.device)
    if out.numel():
        _swiglu_forward_kernel[_grid(rows, width)](y, out, width, BLOCK=_BLOCK)
    return out


def swiglu_backward(grad: Tensor, y: Tensor) -> Tensor:
    """The gradient of y [rows, 2 * width] (contiguous, y's dtype) from the output's `grad` [rows, width]."""
    rows, width = y.shape[0], y.shape[1] // 2
    grad_y = torch.empty_like(y, memory_format=torch.contiguous_format)
    if grad_y.numel():
        _swiglu_backward_kernel[_grid(rows, width)](grad.contiguous(), y, grad_y, width, BLOCK=_BLOCK)
    return grad_y
