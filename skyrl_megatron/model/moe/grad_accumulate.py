"""fp32 += bf16/fp16 over contiguous memory, as one Triton kernel on GPU.

The experts' weight gradients come out of the grouped GEMM in the weights' dtype (torch._grouped_mm
has no fp32 output) and are added into Megatron DDP's fp32 `main_grad` buffer, once per micro-batch for
every expert weight of a layer. PyTorch runs a mixed-dtype `add_` through its unrolled (non-vectorized)
elementwise kernel: at Qwen3-30B-A3B widths, 8 layers, 80 such adds took 102 ms of an H200 training call
(2026-11-29 profile, about 2.7 TB/s). The kernel here reads both operands in wide vector loads and
writes fp32 once; its result equals `add_`'s bitwise (the bf16 value is widened exactly, the sum is one
fp32 addition in both).
"""

from __future__ import annotations

import torch
from torch import Tensor

_HALF_DTYPES = (torch.bfloat16, torch.float16)


def _kernel_takes(target: Tensor, addend: Tensor) -> bool:
    return (
        target.is_cuda
        and target.dtype == torch.float32
        and addend.dtype in _HALF_DTYPES
        and addend.device == target.device
        and target.shape == addend.shape
        and target.is_contiguous()
        and addend.is_contiguous()
    )


def accumulate_(target: Tensor, addend: Tensor) -> Tensor:
    """target += addend in place (fp32 target, half-precision addend of the same shape); returns target.

    The Triton kernel where both are contiguous CUDA tensors, else PyTorch's `add_`."""
    if not _kernel_takes(target, addend):
        return target.add_(addend)
    if target.numel():
        from skyrl_megatron.model.moe import grad_accumulate_kernels

        grad_accumulate_kernels.accumulate_flat(target.view(-1), addend.view(-1))
    return target
