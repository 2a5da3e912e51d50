"""The router's gating GEMM in fp32 without upcasting its operands: bf16 products, fp32 accumulation and output.

With ``moe_router_dtype=fp32`` (our default) and no Transformer Engine, Megatron's
`router_gating_linear` casts the hidden states and the router weight to fp32 and runs an fp32 GEMM
(`RouterGatingLinearFunction`): a [tokens, hidden] fp32 copy and a GEMM on the CUDA cores, 7.7 ms
of a 232 ms scoring pass over Qwen3-30B-A3B's widths at 8 layers on an H200 (profiled 2026-12-03). With TE it asks cuBLAS for bf16 inputs and an fp32 output instead, and so does this
module through torch's `mm(..., out_dtype=torch.float32)`. The two agree up to summation order: a
product of two bf16 values is exact in fp32, so upcasting first changes nothing but the kernel.

The backward is Megatron's (fp32 GEMMs on the upcast operands, the gradients cast back to the
operands' dtypes): the incoming gradient is fp32 and rounding it to bf16 would change the router's
update. On a CPU (no fp32-output kernel there) the forward is the upcast GEMM, Megatron's exactly. Everything
outside that case (fp64 or model-dtype routing, fp32 activations, a bias, TE installed) is Megatron's own
function.
"""

from __future__ import annotations

import torch
from torch import Tensor

_originals: dict[str, object] = {}
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def takes_fast_path(inp: Tensor, weight: Tensor, bias: Tensor | None, router_dtype: torch.dtype) -> bool:
    """Whether `router_gating_linear` runs `_GatingFp32Out`: fp32 routing of bf16/fp16 operands, no bias."""
    return router_dtype == torch.float32 and bias is None and inp.dtype in _LOW_PRECISION and weight.dtype == inp.dtype


def _fp32_product(a: Tensor, b: Tensor) -> Tensor:
    """a @ b in fp32 from low-precision operands: cuBLAS's fp32-output GEMM on CUDA; elsewhere (torch has no
    such CPU kernel) the upcast GEMM, which is Megatron's computation exactly."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


class _GatingFp32Out(torch.autograd.Function):
    """logits = inp @ weight.T with fp32 accumulation and output; Megatron's fp32 backward."""

    @staticmethod
    def forward(ctx, inp: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(inp, weight)
        flat = inp.reshape(-1, inp.shape[-1])
        logits = _fp32_product(flat, weight.t())
        return logits.view(*inp.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_logits: Tensor):
        inp, weight = ctx.saved_tensors
        flat_grad = grad_logits.reshape(-1, grad_logits.shape[-1]).float()
        flat_inp = inp.reshape(-1, inp.shape[-1])
        grad_inp = torch.mm(flat_grad, weight.float()).to(inp.dtype).view(inp.shape)
        grad_weight = torch.mm(flat_grad.t(), flat_inp.float()).to(weight.dtype)
        return grad_inp, grad_weight


def router_gating_linear(inp: Tensor, weight: Tensor, bias: Tensor | None, router_dtype: torch.dtype) -> Tensor:
    """Megatron's `router_gating_linear`, with the fp32-output GEMM where it applies (module docstring)."""
    if _originals.get("te_missing") and takes_fast_path(inp, weight, bias, router_dtype):
        return _GatingFp32Out.apply(inp, weight)
    return _originals["router_gating_linear"](inp, weight, bias, router_dtype)


def install() -> None:
    """Use this gating in Megatron's routers (idempotent); without TE only, since TE's own GEMM does the same."""
    from megatron.core.transformer.moe import moe_utils, router

    if _originals:
        return
    _originals["router_gating_linear"] = router.router_gating_linear
    _originals["te_missing"] = getattr(moe_utils, "te_general_gemm", None) is None
    router.router_gating_linear = router_gating_linear


def uninstall() -> None:
    """Megatron's gating again (for comparisons and benchmarks)."""
    from megatron.core.transformer.moe import router

    if _originals:
        router.router_gating_linear = _originals.pop("router_gating_linear")
        _originals.clear()
