"""Torch RMSNorm/LayerNorm that also works under Megatron sequence parallelism.

Megatron's `WrappedTorchNorm` refuses sequence parallelism. The norm itself needs nothing special:
under SP each TP rank normalises its own slice of tokens, so only the weight gradients are partial.
Tagging the parameters with `sequence_parallel` makes Megatron's `finalize_model_grads` all-reduce
them over the TP group, as it does for TE's norms.

`FusedTorchNorm` builds the same norms with RMSNorm as one generated kernel per direction
(`model/layers/fusions.py`). PyTorch's own fused RMSNorm launches one thread block per row, which leaves
most of the GPU idle on the 128-wide rows of Qwen3's per-head query/key norms. `DeferrableNorm` builds
the query/key norms whose attention applies them inside its rotation (`model/layers/qk_norm_rope.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from skyrl_megatron.model.layers.fusions import compile_kernel


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension, in fp32, rounded once to the input's dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


fused_rms_norm = compile_kernel(rms_norm)  # compiled at its first call


class FusedRMSNorm(torch.nn.RMSNorm):
    """`torch.nn.RMSNorm` (same parameters and state dict) computed by the generated kernel.

    The kernel always sees contiguous rows [N, hidden]. The block's norms get [T, 1, hidden], the
    query/key norms [T, 1, heads, head_dim] and the key a strided view of the QKV projection;
    passed as they are, each rank and stride pattern would be one more compiled variant, counted
    against Dynamo's recompile limit.
    """

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        return fused_rms_norm(rows, self.weight, self.eps).view(x.shape)


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
    """`TorchNorm` with RMSNorm as a generated kernel (LayerNorm stays PyTorch's)."""

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
