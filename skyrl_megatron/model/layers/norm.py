"""Torch RMSNorm/LayerNorm that also works under Megatron sequence parallelism.

Megatron's `WrappedTorchNorm` refuses sequence parallelism. The norm itself needs nothing special:
under SP each TP rank normalises its own slice of tokens, so only the weight gradients are partial.
Tagging the parameters with `sequence_parallel` makes Megatron's `finalize_model_grads` all-reduce
them over the TP group, as it does for TE's norms.

`FusedTorchNorm` builds the same norms with RMSNorm as fused kernels on GPU (`fused_kernels: [rms_norm]`):
quack-kernels' RMSNorm where it is installed (it comes with flash-attn-4) and the GPU is Hopper or later, our
Triton kernels (`rms_norm_kernels.py`) elsewhere. `DeferrableNorm` builds the query/key norms whose attention
applies them inside its rotation (`model/layers/qk_norm_rope.py`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

logger = logging.getLogger(__name__)


class _TritonRMSNorm(torch.autograd.Function):
    """RMSNorm of contiguous rows [N, hidden] through `rms_norm_kernels` (the forward keeps 1/rms per row)."""

    @staticmethod
    def forward(ctx, rows: Tensor, weight: Tensor, eps: float) -> Tensor:
        from skyrl_megatron.model.layers import rms_norm_kernels

        out, inverse_rms = rms_norm_kernels.rms_norm_forward(rows, weight, eps)
        ctx.save_for_backward(rows, weight, inverse_rms)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        from skyrl_megatron.model.layers import rms_norm_kernels

        rows, weight, inverse_rms = ctx.saved_tensors
        grad_rows, grad_weight = rms_norm_kernels.rms_norm_backward(grad.contiguous(), rows, weight, inverse_rms)
        return grad_rows, grad_weight, None


def _kernel_takes(rows: Tensor) -> bool:
    """Whether a fused kernel takes these rows: on a GPU, at least one row."""
    return rows.is_cuda and rows.shape[0] > 0


@functools.cache
def library_rms_norm(device_index: int) -> Callable[..., Tensor] | None:
    """quack-kernels' `rmsnorm(rows, weight, eps=)` (autograd included) where it is installed and this GPU is Hopper
    or later (its CuTe DSL kernels' targets); None where our Triton kernels run instead."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(device_index)[0] < 9:
        return None
    try:
        from quack.rmsnorm import rmsnorm
    except ImportError:
        return None
    except Exception as error:  # noqa: BLE001 - installed but unusable here (its CuTe DSL or CUDA libraries)
        logger.warning("quack-kernels is installed but cannot be imported (%s: %s); rms_norm runs our Triton kernels",
                       type(error).__name__, error)
        return None
    return rmsnorm


def rms_norm_implementation(device_index: int) -> str:
    """Which kernels `FusedRMSNorm` runs on this GPU, for the build's log."""
    return "quack-kernels" if library_rms_norm(device_index) is not None else "Triton (rms_norm_kernels)"


class FusedRMSNorm(torch.nn.RMSNorm):
    """`torch.nn.RMSNorm` (same parameters and state dict) computed by fused kernels on GPU (quack-kernels'
    where installed, else ours in Triton); PyTorch's elsewhere. The kernels see contiguous rows [N, hidden]
    (the block's norms get [T, 1, hidden])."""

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if not _kernel_takes(rows):
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps  # torch's default for None
        library = library_rms_norm(rows.device.index)
        if library is not None:
            return library(rows.contiguous(), self.weight, eps=eps).view(x.shape)
        return _TritonRMSNorm.apply(rows.contiguous(), self.weight, eps).view(x.shape)


def _build_norm(config, hidden_size: int, eps: float, rms_norm_class: type) -> torch.nn.Module:
    if config.layernorm_zero_centered_gamma:
        raise ValueError("layernorm_zero_centered_gamma needs Transformer Engine's norms")
    if config.normalization == "RMSNorm":
        norm = rms_norm_class(hidden_size, eps=eps, dtype=config.params_dtype)
    elif config.normalization == "LayerNorm":
        norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
    else:
        raise ValueError(f"normalization {config.normalization!r} is not supported without Transformer Engine")
    for param in norm.parameters():
        param.sequence_parallel = config.sequence_parallel
    return norm


class TorchNorm:
    """A `LayerNormBuilder` (same call signature as Megatron's norms) returning a torch norm."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        return _build_norm(config, hidden_size, eps, torch.nn.RMSNorm)


class FusedTorchNorm:
    """`TorchNorm` with RMSNorm on fused kernels (`FusedRMSNorm`: quack-kernels' or ours; LayerNorm stays PyTorch's)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        return _build_norm(config, hidden_size, eps, FusedRMSNorm)


class DeferrableRMSNorm(torch.nn.RMSNorm):
    """`torch.nn.RMSNorm` (same parameters and state dict) that its attention can tell to pass its
    input through, when it applies the norm itself inside the rotation (`deferred`)."""

    deferring = False

    def forward(self, x: Tensor) -> Tensor:
        return x if self.deferring else super().forward(x)


class DeferrableNorm:
    """A `LayerNormBuilder` (Megatron's norm call signature) for the query/key norms."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        return _build_norm(config, hidden_size, eps, DeferrableRMSNorm)


@contextlib.contextmanager
def deferred(*norms: DeferrableRMSNorm) -> Iterator[None]:
    """Inside, the norms pass their input through (their owner applies them)."""
    for norm in norms:
        norm.deferring = True
    try:
        yield
    finally:
        for norm in norms:
            norm.deferring = False
