"""What quack-kernels' GEMMs need from the machine and from their operands (`expert_gemm`, `expert_wgrad`), and
which GEMMs `moe_config.expert_gemms` picks.

quack (`quack-kernels`, the CuTe DSL kernels flash-attn-4 ships with) builds its GEMMs for Hopper and later GPUs, and
compiles them for operands whose addresses and strides (but the unit one) are multiples of 16 bytes.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

HALF_DTYPES = (torch.bfloat16, torch.float16)

ALIGNMENT_BYTES = 16


@functools.cache
def missing_reason(device_index: int) -> str | None:
    """Why quack's GEMMs cannot run on this CUDA device (None when they can)."""
    major, _ = torch.cuda.get_device_capability(device_index)
    if major < 9:
        return f"it needs a Hopper or later GPU (this one is sm_{major}x)"
    try:
        import quack.gemm_interface  # noqa: F401
    except ImportError as error:
        return f"it needs quack-kernels (pip install quack-kernels; import failed: {error})"
    except Exception as error:  # noqa: BLE001 - installed but unusable here (its CuTe DSL or CUDA libraries)
        return f"quack-kernels is installed but does not import here ({type(error).__name__}: {error})"
    return None


def current_device_missing_reason() -> str | None:
    """`missing_reason` for this process's current CUDA device, or why there is none (a provider can be made where no
    GPU is visible)."""
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    return missing_reason(torch.cuda.current_device())


def experts_on_quack(choice: str, on_gpu: bool) -> tuple[bool, str]:
    """Whether the grouped experts' GEMMs run on quack for `moe_config.expert_gemms` = `choice` (auto | quack | torch),
    and why. `quack` where quack cannot run is refused at the build's start (`build._check_kernels_can_run`); on the CPU
    runtime every choice runs `torch._grouped_mm`."""
    if choice == "torch":
        return False, "moe_config.expert_gemms=torch"
    if not on_gpu:
        return False, "the CPU runtime"
    reason = missing_reason(torch.cuda.current_device())
    if reason is not None:
        return False, f"quack cannot run here: {reason}"
    return True, f"moe_config.expert_gemms={choice}"


def cu_seqlens(offsets: Tensor) -> Tensor:
    """quack's `cu_seqlens_m` / `cu_seqlens_k` from the grouped GEMM's `offs` (each expert's cumulative row end): the
    same ends after a leading zero, int32."""
    return torch.cat([offsets.new_zeros(1), offsets]).to(torch.int32)


def aligned(*tensors: Tensor) -> bool:
    """Whether every tensor's address and every stride but the unit one are multiples of 16 bytes."""
    return all(
        t.data_ptr() % ALIGNMENT_BYTES == 0
        and all(stride * t.element_size() % ALIGNMENT_BYTES == 0 for stride in t.stride() if stride != 1)
        for t in tensors
    )


def gate_up_halves(rows: int, weight: Tensor) -> bool:
    """Whether `rows` rows of a SwiGLU fc1 weight split into [gate; up] halves whose output columns quack's gated GEMM
    writes 16-byte aligned."""
    return rows % 2 == 0 and (rows // 2) * weight.element_size() % ALIGNMENT_BYTES == 0


def rows_and_weight(rows: Tensor, weight: Tensor) -> bool:
    """Whether a dense quack GEMM of `rows` by a weight's transpose takes them: CUDA half-precision rows [n >= 1, k]
    and a weight [m, k] of the same dtype and device, both contiguous and 16-byte aligned."""
    return (
        rows.is_cuda
        and rows.dim() == 2
        and weight.dim() == 2
        and rows.shape[0] > 0
        and rows.dtype in HALF_DTYPES
        and weight.dtype == rows.dtype
        and weight.device == rows.device
        and weight.shape[1] == rows.shape[1]
        and rows.is_contiguous()
        and weight.is_contiguous()
        and aligned(rows, weight)
    )
