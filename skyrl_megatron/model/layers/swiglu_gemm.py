"""The dense MLP's first GEMM with the SwiGLU in its epilogue: in forward-only passes (`fused_kernels: [swiglu_gemm]`),
and in training passes too (`swiglu_gemm_training`, `SwiGLUMLPFunction`).

A dense MLP computes y = x @ W1^T into a [tokens, 2 * ffn] bf16 buffer, then the SwiGLU kernel reads that buffer
back and writes silu(gate) * up, [tokens, ffn]. In a scoring pass nothing keeps y for a backward, so the buffer's
round trip through memory is all it does: quack-kernels' gated GEMM (`gemm_gated`, activation `swiglu`) applies the
activation to its fp32 accumulator and writes only the [tokens, ffn] result. Megatron's fc1 weight is [gate; up]
along its rows on every tensor-parallel rank; quack reads that layout through `concat_layout=("B",)` (a view in the
kernel, no copy of the weight).

Precision: the activation is taken from the fp32 accumulator and rounded once, where the two-kernel path rounds y to
bf16 first; the results differ by bf16 rounding. Without `swiglu_gemm_training` training keeps the two-kernel path
(its backward reads y), so the first step's importance ratio differs from 1 by that rounding, as it does wherever
scoring and training micro-batches take different GEMM kernels.

Training (`SwiGLUMLPFunction`, the whole MLP's GEMMs on this rank's shards): the gated GEMM also stores fc1's output
(in quack's layout, gate and up columns interleaved) for the backward, and fc2's input-gradient GEMM applies the
SwiGLU's backward in its epilogue (`gemm_dgated`), writing fc1's output gradient and fc2's input again (for fc2's
weight gradient): the activation's [tokens, ffn] output is never saved, the SwiGLU's kernels and the round trip of
its gradient are gone. fc1's input and weight gradients read the interleaved gradient through `concat_layout`, the
latter added into DDP's `main_grad` by the GEMM under gradient-accumulation fusion. fc2's own GEMMs stay cuBLAS's.
Every pass of a model built with it takes the same gated GEMM, so its scoring and training logprobs agree. The
kernels are one set of five (`QuackKernels`); `ReferenceKernels` defines them in PyTorch, the tests' stand-in.

Hopper and later only (`quack_support.missing_reason`), half-precision operands, 16-byte aligned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from skyrl_megatron.model.quack_support import gate_up_halves, rows_and_weight


def plain_swiglu(config) -> bool:
    """Whether a TransformerConfig's MLP activation is what the gated GEMM's epilogue computes: silu(gate) * up with no
    bias, clamp, offset, TE activation module or low-precision GEMM."""
    return (
        config.gated_linear_unit
        and config.activation_func is F.silu
        and not config.add_bias_linear
        and config.activation_func_clamp_value is None
        and not config.glu_linear_offset
        and not config.use_te_activation_func
        and config.fp8 is None
        and getattr(config, "fp4", None) is None
    )


def takes(x: Tensor, weight: Tensor) -> bool:
    """Whether `fc1_swiglu` runs these operands: CUDA half-precision rows [n >= 1, h] and an fc1 weight [2 * f, h] of
    the same dtype, both contiguous and 16-byte aligned."""
    return rows_and_weight(x, weight) and gate_up_halves(weight.shape[0], weight)


def fc1_swiglu(x: Tensor, weight: Tensor) -> Tensor:
    """silu(x @ gate^T) * (x @ up^T) for the fc1 weight [gate; up] (rows), [n, f] in x's dtype, from one GEMM."""
    from quack.gemm_interface import gemm_gated

    _, out = gemm_gated(x, weight.mT, activation="swiglu", concat_layout=("B",), store_preact=False, tuned=False)
    return out


def reference_fc1_swiglu(x: Tensor, weight: Tensor) -> Tensor:
    """What `fc1_swiglu` computes, in PyTorch: the fp32 product (the GEMM's accumulator, up to its summation order),
    the activation in fp32, one rounding. The stand-in for quack's kernel where it cannot run (the CPU tests) and the
    reference of `bench/gpu_swiglu_gemm.py`."""
    gate, up = (x.float() @ weight.float().t()).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def two_kernel_fc1_swiglu(x: Tensor, weight: Tensor) -> Tensor:
    """The path it replaces, on one device: fc1's GEMM into bf16, then the SwiGLU (our Triton kernel on GPU)."""
    y = x @ weight.t()
    if y.is_cuda:
        from skyrl_megatron.model.layers import swiglu_kernels

        return swiglu_kernels.swiglu_forward(y)
    gate, up = y.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(y.dtype)


def _interleaved(gate: Tensor, up: Tensor) -> Tensor:
    """[n, 2f] with gate and up columns alternating (quack's layout of a gated GEMM's output)."""
    return torch.stack([gate, up], dim=-1).flatten(-2)


def _concatenated(interleaved: Tensor) -> Tensor:
    """[n, 2f] as Megatron lays fc1's output out: gate columns, then up columns."""
    return torch.cat([interleaved[..., 0::2], interleaved[..., 1::2]], dim=-1)


class QuackKernels:
    """The five GEMMs of `SwiGLUMLPFunction` that see fc1's output, on quack-kernels (its default configuration; a
    subclass with `tuned = True` takes quack's autotuner, which tunes again for every new shape: `bench/gpu_swiglu_gemm.py
    --tuned`)."""

    tuned = False

    @classmethod
    def fc1_gated(cls, x: Tensor, w1: Tensor) -> tuple[Tensor, Tensor]:
        """(fc1's output, interleaved, and silu(gate) * up) from one GEMM over x [n, h] and w1 [gate; up] ([2f, h])."""
        from quack.gemm_interface import gemm_gated

        return gemm_gated(x, w1.mT, activation="swiglu", concat_layout=("B",), store_preact=True, tuned=cls.tuned)

    @classmethod
    def fc2_dgated(cls, grad_out: Tensor, w2: Tensor, preact: Tensor) -> tuple[Tensor, Tensor]:
        """(the gradient of fc1's output, interleaved, and fc2's input again): grad_out [n, h] @ w2 [h, f] with the
        SwiGLU's backward at `preact` in the epilogue."""
        from quack.gemm_interface import gemm_dgated

        return gemm_dgated(grad_out, w2, preact, activation="swiglu", dynamic_scheduler=True, tuned=cls.tuned)

    @classmethod
    def fc1_input_grad(cls, grad_preact: Tensor, w1: Tensor) -> Tensor:
        from quack.gemm_interface import gemm

        return gemm(grad_preact, w1, concat_layout=("B",), dynamic_scheduler=True, tuned=cls.tuned)

    @classmethod
    def fc1_weight_grad(cls, grad_preact: Tensor, x: Tensor) -> Tensor:
        """[2f, h] in Megatron's [gate; up] rows."""
        from quack.gemm_interface import gemm

        return gemm(grad_preact.mT, x, concat_layout=("out",), dynamic_scheduler=True, tuned=cls.tuned)

    @classmethod
    def fc1_weight_grad_add_(cls, grad_preact: Tensor, x: Tensor, main_grad: Tensor) -> None:
        """main_grad [2f, h] ([gate; up] rows, fp32 or the weights' dtype) += the weight gradient, in the GEMM."""
        from quack.gemm_interface import gemm_add_inplace

        gemm_add_inplace(grad_preact.mT, x, main_grad, concat_layout=("C", "out"), dynamic_scheduler=True,
                         tuned=cls.tuned)


class ReferenceKernels:
    """What `QuackKernels` compute, in PyTorch with fp32 products and one rounding each, in the same layouts: the
    stand-in for quack's kernels where they cannot run (the CPU tests)."""

    @staticmethod
    def fc1_gated(x: Tensor, w1: Tensor) -> tuple[Tensor, Tensor]:
        gate, up = (x.float() @ w1.float().t()).chunk(2, dim=-1)
        return _interleaved(gate, up).to(x.dtype), (F.silu(gate) * up).to(x.dtype)

    @staticmethod
    def fc2_dgated(grad_out: Tensor, w2: Tensor, preact: Tensor) -> tuple[Tensor, Tensor]:
        grad_act = grad_out.float() @ w2.float()
        gate, up = preact[..., 0::2].float(), preact[..., 1::2].float()
        sig = torch.sigmoid(gate)
        grad_gate = grad_act * up * sig * (1 + gate * (1 - sig))
        grad_up = grad_act * gate * sig
        return _interleaved(grad_gate, grad_up).to(grad_out.dtype), (gate * sig * up).to(preact.dtype)

    @staticmethod
    def fc1_input_grad(grad_preact: Tensor, w1: Tensor) -> Tensor:
        return (_concatenated(grad_preact).float() @ w1.float()).to(grad_preact.dtype)

    @staticmethod
    def fc1_weight_grad(grad_preact: Tensor, x: Tensor) -> Tensor:
        return (_concatenated(grad_preact).float().t() @ x.float()).to(x.dtype)

    @staticmethod
    def fc1_weight_grad_add_(grad_preact: Tensor, x: Tensor, main_grad: Tensor) -> None:
        main_grad.add_((_concatenated(grad_preact).float().t() @ x.float()).to(main_grad.dtype))


# the kernels `SwiGLUMLPFunction` runs (the CPU tests put `ReferenceKernels` here)
TRAINING_KERNELS: type = QuackKernels


def _weight_gradient(weight: Tensor, fuse: bool, compute, add_into) -> Tensor | None:
    """The gradient autograd gets for `weight`: `compute()`; or, under gradient-accumulation fusion, `add_into(main_grad)`
    and, where Megatron's DDP reads the mark, a placeholder its hook skips (as Megatron's fused linears return)."""
    if not fuse:
        return compute()
    add_into(weight.main_grad)
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros(weight.main_grad.shape, dtype=weight.dtype, device=weight.device)
    return torch.empty(weight.main_grad.shape, dtype=weight.dtype, device=weight.device)


def _fc2_weight_grad_add_(grad_out: Tensor, postact: Tensor, main_grad: Tensor) -> None:
    from skyrl_megatron.model.layers import wgrad

    accumulate = wgrad.wgrad_gemm_accum_fp32 if main_grad.dtype == torch.float32 else wgrad.wgrad_gemm_accum_fp16
    accumulate(postact, grad_out, main_grad)


class SwiGLUMLPFunction(torch.autograd.Function):
    """fc2(silu(x @ gate^T) * (x @ up^T)) on this rank's shards, its backward through `TRAINING_KERNELS`.

    `x` is this rank's rows [n, h]; under sequence parallelism its shard of them, gathered over `tp_group` in the
    forward and again in the backward (the shard is what is saved, as Megatron's fc1 saves it), the input's gradient
    reduce-scattered back; with tensor parallelism and no sequence parallelism the input's gradient is summed over the
    group. The output is this rank's partial fc2 product: the caller reduces it (fc2's row-parallel reduction).
    Saved for the backward: x, fc1's output (bf16, interleaved) and the weights, not the activation.
    """

    @staticmethod
    def forward(ctx, x: Tensor, w1: Tensor, w2: Tensor, fuse_wgrad: bool, tp_group, sequence_parallel: bool) -> Tensor:
        from megatron.core.tensor_parallel.mappings import _gather_along_first_dim

        kernels = TRAINING_KERNELS
        rows = _gather_along_first_dim(x, tp_group) if sequence_parallel else x
        preact, postact = kernels.fc1_gated(rows, w1)
        out = postact @ w2.t()
        ctx.save_for_backward(x, preact, w1, w2)
        ctx.kernels, ctx.fuse_wgrad, ctx.tp_group, ctx.sequence_parallel = kernels, fuse_wgrad, tp_group, sequence_parallel
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        from megatron.core.tensor_parallel.mappings import _gather_along_first_dim, _reduce, _reduce_scatter_along_first_dim

        x, preact, w1, w2 = ctx.saved_tensors
        kernels, fuse = ctx.kernels, ctx.fuse_wgrad
        grad_out = grad_out.contiguous()
        rows = _gather_along_first_dim(x, ctx.tp_group) if ctx.sequence_parallel else x
        grad_preact, postact = kernels.fc2_dgated(grad_out, w2, preact)
        grad_w2 = grad_w1 = grad_x = None
        if ctx.needs_input_grad[2]:
            grad_w2 = _weight_gradient(w2, fuse, lambda: grad_out.t() @ postact,
                                       lambda main_grad: _fc2_weight_grad_add_(grad_out, postact, main_grad))
        if ctx.needs_input_grad[0]:
            grad_x = kernels.fc1_input_grad(grad_preact, w1)
            if ctx.sequence_parallel:
                grad_x = _reduce_scatter_along_first_dim(grad_x, ctx.tp_group)
            elif ctx.tp_group is not None and ctx.tp_group.size() > 1:
                grad_x = _reduce(grad_x, ctx.tp_group)
        if ctx.needs_input_grad[1]:
            grad_w1 = _weight_gradient(w1, fuse, lambda: kernels.fc1_weight_grad(grad_preact, rows),
                                       lambda main_grad: kernels.fc1_weight_grad_add_(grad_preact, rows, main_grad))
        return grad_x, grad_w1, grad_w2, None, None, None


__all__ = ["QuackKernels", "ReferenceKernels", "SwiGLUMLPFunction", "TRAINING_KERNELS", "fc1_swiglu",
           "reference_fc1_swiglu", "takes", "two_kernel_fc1_swiglu"]
