"""The dense MLP's fused SwiGLU (`fused_kernels: [swiglu]`) as Triton kernels on GPU.

With `bias_activation_fusion`, Megatron-Core's MLP calls `bias_swiglu_impl`, which keeps only the SwiGLU
input for backward and runs torch.compile'd functions. `install` routes the bias-free call on GPU to
`swiglu_kernels.py` (its backward is one read of each input and one write of each half's gradient);
anything else (a bias, an fp8-stored input, offloaded activations, CPU tensors) goes to Megatron's own.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MEGATRON_IMPL = None  # Megatron's bias_swiglu_impl, kept by `install`


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: Tensor) -> Tensor:
        from skyrl_megatron.model.layers import swiglu_kernels

        ctx.save_for_backward(y)
        return swiglu_kernels.swiglu_forward(y)

    @staticmethod
    def backward(ctx, grad: Tensor):
        from skyrl_megatron.model.layers import swiglu_kernels

        (y,) = ctx.saved_tensors
        return swiglu_kernels.swiglu_backward(grad, y)


def _on_gpu(t: Tensor) -> bool:
    return t.is_cuda


def bias_swiglu_impl(input: Tensor, bias, fp8_input_store: bool = False, cpu_offload_input: bool = False) -> Tensor:
    """Megatron's `bias_swiglu_impl` contract ([tokens, 2 * ffn] or [s, b, 2 * ffn] in, the last dimension halved)."""
    if bias is not None or fp8_input_store or cpu_offload_input or not _on_gpu(input) or not input.is_contiguous():
        return _MEGATRON_IMPL(input, bias, fp8_input_store, cpu_offload_input)
    shape = input.shape
    out = _SwiGLU.apply(input.view(-1, shape[-1]))
    return out.view(*shape[:-1], out.shape[-1])


def install() -> None:
    """Route Megatron-Core's dense MLP SwiGLU to `bias_swiglu_impl` (idempotent; used only where the model
    has `bias_activation_fusion`, i.e. `swiglu` in `fused_kernels`)."""
    global _MEGATRON_IMPL
    from megatron.core.transformer import mlp

    if mlp.bias_swiglu_impl is not bias_swiglu_impl:
        _MEGATRON_IMPL = mlp.bias_swiglu_impl
        mlp.bias_swiglu_impl = bias_swiglu_impl
