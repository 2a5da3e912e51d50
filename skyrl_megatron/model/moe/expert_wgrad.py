"""The experts' weight gradients added into DDP's fp32 `main_grad` by the GEMM itself (`moe_config.expert_gemms`).

Without it, each expert's dW_e = dY_e^T X_e leaves `torch._grouped_mm` in bf16 (it has no fp32 output) and a second
kernel (`grad_accumulate`) adds it into `main_grad`: the GEMM writes E x out x in half-precision values that the add
reads back, and every product is rounded to bf16 before it is summed. quack's varlen-K GEMM (`quack-kernels`, the
CuTe DSL kernels flash-attn-4 ships with) takes the experts' token counts as the varying inner dimension and adds
into the fp32 buffer in its epilogue: one kernel, no half-precision round trip, one rounding. The operands are used
as they lie (dY^T is M-major, X is N-major, which is the layout a varlen-K GEMM reads), and the layer's main grads
must lie back to back (one [E, out, in] run of DDP's buffer, which `experts._GroupedLinear` arranges).

The kernel does not run quack's autotuner: the autotuner keys its choice on the operands' shapes, and the experts'
token total changes with every micro-batch, so each new total would benchmark every candidate again; a timing-picked
configuration would also make the gradients' summation order depend on the run. It runs a configuration fixed by the
weight's widths instead: the autotuner's pick at that width, measured once and pinned in `PINNED_CONFIGS` (quack's
`GemmConfig` fields, by GPU architecture and one expert's (out, in)), else quack's default configuration for the GPU.
The varying token total is the GEMM's inner dimension: the output tiles a configuration sets are the weight's.

Hopper and later only (`quack_support.missing_reason`); quack is imported only where it runs.
`bench/gpu_expert_wgrad.py` times it against the two-kernel path and checks both against an fp64 reference.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from skyrl_megatron.model.quack_support import HALF_DTYPES, aligned, cu_seqlens

# quack's autotuner's picks for this GEMM, by (compute capability major, one expert's out, in), as `GemmConfig` fields.
# Hopper (sm_90): Qwen3-30B-A3B's widths (fc1 [2 x 768, 2,048], fc2 [2,048, 768]), tuned at 131,072 rows on an H200
# (2026-12-06, benchmarks.md "The experts' weight gradients through quack on an H200"): 1.919 and 0.837 ms against
# the default configuration's 2.010 and 1.052.
_HOPPER = {"pingpong": True, "is_dynamic_persistent": False, "cluster_m": 2, "cluster_n": 1, "swap_ab": True,
           "device_capacity": 9}
PINNED_CONFIGS: dict[tuple[int, int, int], dict] = {
    (9, 1536, 2048): {"tile_m": 128, "tile_n": 128, **_HOPPER},
    (9, 2048, 768): {"tile_m": 128, "tile_n": 160, **_HOPPER},
}


def takes(main_grads: Tensor, grad_output: Tensor, x: Tensor) -> bool:
    """Whether `add_` runs these operands: a contiguous fp32 [E, out, in] target and contiguous half-precision
    operands, all 16-byte aligned (out and in multiples of 8); else the caller takes the two-kernel path."""
    return (
        main_grads.is_cuda
        and main_grads.dtype == torch.float32
        and main_grads.is_contiguous()
        and grad_output.dtype in HALF_DTYPES
        and x.dtype == grad_output.dtype
        and grad_output.is_contiguous()
        and x.is_contiguous()
        and aligned(main_grads, grad_output, x)
    )


def add_(main_grads: Tensor, grad_output: Tensor, x: Tensor, offsets: Tensor) -> None:
    """main_grads[e] += grad_output[rows of e]^T @ x[rows of e] for every expert e, in one GEMM.

    `offsets`: int32 cumulative row ends per expert (as `torch._grouped_mm` takes them); an expert without
    rows keeps its gradient unchanged."""
    config = pinned_config(main_grads.device.index, *main_grads.shape[1:])
    if config is None:
        from quack.gemm_interface import gemm_add_inplace

        gemm_add_inplace(grad_output.t(), x, main_grads, cu_seqlens_k=cu_seqlens(offsets), tuned=False)
        return
    if x.shape[0] == 0:  # no rows for any expert: nothing to add (quack's entry point returns here too)
        return
    from quack.gemm_interface import gemm_tuned

    # The configured kernel itself (`gemm_add_inplace` takes only tuned=True/False): out += A @ B in the epilogue.
    gemm_tuned.fn(grad_output.t(), x, main_grads, None, cu_seqlens_k=cu_seqlens(offsets), add_to_output=True,
                  config=config)


@functools.cache
def pinned_config(device_index: int | None, out_features: int, in_features: int):
    """quack's `GemmConfig` pinned for one expert's [out, in] weight gradient on this device, or None (quack's default
    configuration)."""
    major, _ = torch.cuda.get_device_capability(device_index)
    fields = PINNED_CONFIGS.get((major, out_features, in_features))
    if fields is None:
        return None
    from quack.gemm_config import GemmConfig

    return GemmConfig(**fields)
