"""The experts' forward and input-gradient GEMMs on quack's varlen-M GEMM (`moe_config.expert_gemms`, auto by default).

Each expert's rows of A (consecutive, cumulative row ends `offsets`) times that expert's [K, N] slice of B [E, K, N]:
the product `experts._grouped_mm` gets from `torch._grouped_mm` otherwise, for the forward (x times the stacked
weight transposed, a view) and the input gradient (dY times the stacked weight). quack's `gemm` takes the experts'
row counts as the varying M (`cu_seqlens_m`) and the operands as they lie. It runs quack's default configuration
for the GPU, not its autotuner: the autotuner keys on the operands' shapes, and the experts' token total changes
with every micro-batch.

In forward-only passes fc1 can also take the SwiGLU into its epilogue (`fc1_swiglu`, quack's gated GEMM over the same
varying M; `fused_kernels: [swiglu_gemm_experts]`): silu(gate) * up from the fp32 accumulator, rounded once, and no
[rows, 2 * ffn] buffer written and read back. Opt-in: at quack's default configuration it ran 14% slower than the GEMM
and Megatron's weighted SwiGLU at Qwen3-30B-A3B's widths (H100, 2026-12-07).

`bench/gpu_expert_gemm.py` times both libraries at MoE widths and checks them against fp64 (the gated GEMM too).
Hopper and later only (`quack_support.missing_reason`); quack is imported only where it runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from skyrl_megatron.model.quack_support import ALIGNMENT_BYTES, HALF_DTYPES, aligned, cu_seqlens, gate_up_halves


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


def takes_fc1_swiglu(a: Tensor, weight: Tensor) -> bool:
    """Whether `fc1_swiglu` runs these operands: as `takes(a, weight.mT)`, with fc1's stacked weight [E, 2 * f, K] in
    [gate; up] halves of 16-byte aligned rows."""
    return weight.dim() == 3 and gate_up_halves(weight.shape[1], weight) and takes(a, weight.mT)


def fc1_swiglu(a: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    """silu(a_e @ gate_e^T) * (a_e @ up_e^T) for every expert e's rows of `a` and its fc1 weight [gate; up] (rows of
    weight[e], [E, 2 * f, K]): one [rows, f] tensor in a's dtype from one gated GEMM. `offsets` as for `matmul`."""
    from quack.gemm_interface import gemm_gated

    _, out = gemm_gated(a, weight.mT, activation="swiglu", cu_seqlens_m=cu_seqlens(offsets), concat_layout=("B",),
                        store_preact=False, tuned=False)
    return out


def reference_fc1_swiglu(a: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    """What `fc1_swiglu` computes, in PyTorch: each expert's fp32 product, the activation in fp32, one rounding. The
    stand-in for quack's kernel where it cannot run (the CPU tests) and the reference of `bench/gpu_expert_gemm.py`."""
    ends = offsets.tolist()
    outputs = []
    for expert, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
        gate, up = (a[start:end].float() @ weight[expert].float().t()).chunk(2, dim=-1)
        outputs.append((F.silu(gate) * up).to(a.dtype))
    return torch.cat(outputs) if outputs else a.new_empty(0, weight.shape[1] // 2)
