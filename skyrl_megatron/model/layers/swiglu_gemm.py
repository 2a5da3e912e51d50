"""The dense MLP's first GEMM with the SwiGLU in its epilogue, for forward-only passes (`fused_kernels: [swiglu_gemm]`).

A dense MLP computes y = x @ W1^T into a [tokens, 2 * ffn] bf16 buffer, then the SwiGLU kernel reads that buffer
back and writes silu(gate) * up, [tokens, ffn]. In a scoring pass nothing keeps y for a backward, so the buffer's
round trip through memory is all it does: quack-kernels' gated GEMM (`gemm_gated`, activation `swiglu`) applies the
activation to its fp32 accumulator and writes only the [tokens, ffn] result. Megatron's fc1 weight is [gate; up]
along its rows on every tensor-parallel rank; quack reads that layout through `concat_layout=("B",)` (a view in the
kernel, no copy of the weight).

Precision: the activation is taken from the fp32 accumulator and rounded once, where the two-kernel path rounds y to
bf16 first; the results differ by bf16 rounding. Training keeps the two-kernel path (its backward reads y), so the
first step's importance ratio differs from 1 by that rounding, as it does wherever scoring and training micro-batches
take different GEMM kernels.

Hopper and later only (`quack_support.missing_reason`), half-precision operands, 16-byte aligned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from skyrl_megatron.model.quack_support import ALIGNMENT_BYTES, rows_and_weight


def takes(x: Tensor, weight: Tensor) -> bool:
    """Whether `fc1_swiglu` runs these operands: CUDA half-precision rows [n >= 1, h] and an fc1 weight [2 * f, h] of
    the same dtype, both contiguous and 16-byte aligned."""
    return (
        rows_and_weight(x, weight)
        and weight.shape[0] % 2 == 0
        and (weight.shape[0] // 2) * weight.element_size() % ALIGNMENT_BYTES == 0
    )


def fc1_swiglu(x: Tensor, weight: Tensor) -> Tensor:
    """silu(x @ gate^T) * (x @ up^T) for the fc1 weight [gate; up] (rows), [n, f] in x's dtype, from one GEMM."""
    from quack.gemm_interface import gemm_gated

    _, out = gemm_gated(x, weight.mT, activation="swiglu", concat_layout=("B",), store_preact=False, tuned=False)
    return out


def reference_fc1_swiglu(x: Tensor, weight: Tensor) -> Tensor:
    """What `fc1_swiglu` computes, in PyTorch: the fp32 product (the GEMM's accumulator, up to its summation order),
    the activation in fp32, one rounding. The stand-in for quack's kernel where it cannot run (the CPU tests) and the
    reference of `bench/gpu_swiglu_gemm.py`."""
    gate, up = (x.float() @ weight.float().t()).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def two_kernel_fc1_swiglu(x: Tensor, weight: Tensor) -> Tensor:
    """The path it replaces, on one device: fc1's GEMM into bf16, then the SwiGLU (our Triton kernel on GPU)."""
    y = x @ weight.t()
    if y.is_cuda:
        from skyrl_megatron.model.layers import swiglu_kernels

        return swiglu_kernels.swiglu_forward(y)
    gate, up = y.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(y.dtype)


__all__ = ["fc1_swiglu", "reference_fc1_swiglu", "takes", "two_kernel_fc1_swiglu"]
