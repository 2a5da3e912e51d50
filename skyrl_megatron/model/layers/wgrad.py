"""Weight-gradient GEMMs that accumulate straight into Megatron's fp32 gradient buffers.

Megatron's DDP keeps one fp32 `main_grad` per parameter. Without gradient-accumulation fusion every
linear layer's backward first writes its weight gradient as a separate bf16 tensor, and a hook then
adds it into `main_grad`: per micro-batch, one extra mixed-dtype elementwise pass over every weight
plus a weight-sized allocation. With fusion the GEMM adds its product into `main_grad` itself
(C = C + dY^T X, accumulated in fp32). On one H200 that cut the device time of the matmuls and
gradient adds of a Qwen3-1.7B scoring-plus-training step from 1.85 s to 1.76 s (docs/performance.md).

Megatron-Core delegates that GEMM to APEX's `fused_weight_gradient_mlp_cuda` extension (Transformer
Engine has its own), which our dependency set does not ship. PyTorch's matmul can write an fp32
result from bf16 inputs (`torch.addmm(..., out_dtype=torch.float32)`, CUDA), so this module
provides the extension's two functions in PyTorch and `install()` offers them to Megatron-Core
under the extension's name, unless the real extension is present. Megatron-Bridge's providers
then enable `gradient_accumulation_fusion` by default, as they do where APEX is installed, for
models wrapped in Megatron's DDP (`build.make_provider` turns it off for the others, which have no
`main_grad`); `transformer_config_kwargs.gradient_accumulation_fusion: false` turns it off.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

EXTENSION = "fused_weight_gradient_mlp_cuda"


def wgrad_gemm_accum_fp32(total_input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    """main_grad [out, in] (fp32) += grad_output[tokens, out]^T @ total_input[tokens, in], in place."""
    if grad_output.dtype == main_grad.dtype:
        main_grad.addmm_(grad_output.t(), total_input)
    elif main_grad.is_cuda:
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=main_grad.dtype, out=main_grad)
    else:  # mixed dtypes on CPU: PyTorch has no mixed-dtype matmul there
        main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))


def wgrad_gemm_accum_fp16(total_input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    """The same for a bf16/fp16 `main_grad` (`grad_reduce_in_fp32: false`)."""
    main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))


def _extension_module() -> types.ModuleType:
    module = types.ModuleType(EXTENSION, "PyTorch implementation of APEX's weight-gradient accumulation GEMMs")
    module.wgrad_gemm_accum_fp32 = wgrad_gemm_accum_fp32
    module.wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp16
    module.__skyrl_megatron__ = True
    return module


def cuda_accumulation_works() -> bool:
    """Whether this PyTorch build's bf16 x bf16 -> fp32 accumulating GEMM gives the right result."""
    if not torch.cuda.is_available():
        return True  # the CPU path casts, nothing to probe
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(64, 32, device="cuda", generator=g).bfloat16()
        dy = torch.randn(64, 16, device="cuda", generator=g).bfloat16()
        acc = torch.randn(16, 32, device="cuda", generator=g)
        expected = acc + dy.float().t() @ x.float()
        wgrad_gemm_accum_fp32(x, dy, acc)
        return bool(torch.allclose(acc, expected, rtol=1e-3, atol=1e-3))
    except (RuntimeError, TypeError) as error:  # an older PyTorch without out_dtype
        logger.warning("gradient accumulation fusion unavailable: %s", error)
        return False


def install() -> bool:
    """Offer the functions to Megatron-Core as its `fused_weight_gradient_mlp_cuda` extension.

    Returns whether fusion is available (the real extension, or ours). Idempotent.
    """
    existing = sys.modules.get(EXTENSION)
    if existing is None and importlib.util.find_spec(EXTENSION) is not None:
        return True  # APEX's own extension is installed: Megatron-Core imports it itself
    if existing is None:
        if not cuda_accumulation_works():
            return False
        existing = sys.modules[EXTENSION] = _extension_module()
    from megatron.core.tensor_parallel import layers

    # megatron.core.tensor_parallel.layers probed for the extension at its import
    layers.fused_weight_gradient_mlp_cuda = existing
    layers._grad_accum_fusion_available = True
    return True
