"""Torch RMSNorm/LayerNorm that also works under Megatron sequence parallelism.

Megatron's `WrappedTorchNorm` refuses sequence parallelism. The norm itself needs nothing special:
under SP each TP rank normalises its own slice of tokens, so only the weight gradients are partial.
Tagging the parameters with `sequence_parallel` makes Megatron's `finalize_model_grads` all-reduce
them over the TP group, as it does for TE's norms.
"""

from __future__ import annotations

import torch


class TorchNorm:
    """A `LayerNormBuilder` (same call signature as Megatron's norms) returning a torch norm."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.layernorm_zero_centered_gamma:
            raise ValueError("layernorm_zero_centered_gamma needs Transformer Engine's norms")
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"normalization {config.normalization!r} is not supported without Transformer Engine")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm
