"""The experts' forward and input-gradient GEMMs on quack's varlen-M GEMM (`moe_config.expert_gemms`, auto by default).

Each expert's rows of A (consecutive, cumulative row ends `offsets`) times that expert's [K, N] slice of B [E, K, N]:
the product `experts._grouped_mm` gets from `torch._grouped_mm` otherwise, for the forward (x times the stacked
weight transposed, a view) and the input gradient (dY times the stacked weight). quack's `gemm` takes the experts'
row counts as the varying M (`cu_seqlens_m`) and the operands as they lie. It runs quack's default configuration
for the GPU, not its autotuner: the autotuner keys on the operands' shapes, and the experts' token total changes
with every micro-batch.

`bench/gpu_expert_gemm.py` times both libraries at MoE widths and checks them against fp64. Hopper and later only
(`quack_support.missing_reason`); quack is imported only where it runs.
"""

from __future__ import annotations

from torch import Tensor

from skyrl_megatron.model.quack_support import ALIGNMENT_BYTES, HALF_DTYPES, aligned, cu_seqlens


def takes(a: Tensor, b: Tensor) -> bool:
    """Whether `matmul` runs these operands: half-precision rows a [rows >= 1, K] (contiguous) and b [E, K, N] of the
    same dtype with a unit stride in one of its last two dimensions, all 16-byte aligned, the output's rows too (N a
    multiple of 8); else the caller takes `torch._grouped_mm`."""
    return (
        a.is_cuda
        and a.dim() == 2
        and b.dim() == 3
        and a.shape[0] > 0
        and a.shape[1] == b.shape[1]
        and a.dtype in HALF_DTYPES
        and b.dtype == a.dtype
        and b.device == a.device
        and a.is_contiguous()
        and 1 in (b.stride(1), b.stride(2))
        and aligned(a, b)
        and b.shape[2] * a.element_size() % ALIGNMENT_BYTES == 0
    )


def matmul(a: Tensor, b: Tensor, offsets: Tensor) -> Tensor:
    """out[rows of e] = a[rows of e] @ b[e] for every expert e, one [rows, N] tensor; an expert without rows
    contributes none. `offsets`: int32 cumulative row ends per expert (as `torch._grouped_mm` takes them)."""
    from quack.gemm_interface import gemm

    return gemm(a, b, cu_seqlens_m=cu_seqlens(offsets), tuned=False)
