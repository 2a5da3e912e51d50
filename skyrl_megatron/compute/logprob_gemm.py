"""The logprob head's GEMM with its softmax statistics in the epilogue (`fused_kernels: [lse_gemm]`, opt-in).

The chunked head (`logprobs.py`) runs hidden @ W^T into a bf16 logits buffer and a second kernel reads that buffer
back for the log-sum-exp and the label's logit: at Qwen3's 151,936-token vocabulary a scoring pass writes and reads
about 0.6 MB of logits per token. quack-kernels' `lse_target_epi` GEMM folds both statistics into the GEMM's
epilogue, from its fp32 accumulator: an online (max, sum) log-sum-exp per row and output tile, finished on the host
side of the call by a logsumexp over the tiles, and the label column's value. A scoring pass then writes no logits
at all (`store_d=False`); a training forward still stores them (the backward and the entropy read them) and gets
the same two statistics with them.

Precision: the log-sum-exp and the label's logit come from the fp32 accumulator, not from logits rounded to bf16,
so they are closer to the exact values than the two-kernel path (whose logprobs they do not equal bitwise). A run
must therefore take them in every pass whose logprobs meet: scoring (old and reference logprobs) and the training
forward alike, which `logprobs._forward_chunk` does for every chunk of a model built with the kernel, or the first
step's importance ratio would move off 1 by the logits' rounding.

Hopper and later only (`quack_support.missing_reason`), temperature 1 (the accumulator is not scaled), operands
16-byte aligned; elsewhere the two-kernel path runs. quack runs its default configuration for the GPU (the token
count changes with every micro-batch).
"""

from __future__ import annotations

import torch
from torch import Tensor

from skyrl_megatron.model.quack_support import ALIGNMENT_BYTES, rows_and_weight


def takes(hidden: Tensor, weight: Tensor, temperature: float) -> bool:
    """Whether `statistics` runs these operands: CUDA half-precision hidden rows [n >= 1, h] (contiguous) and a
    contiguous weight shard [V, h] of the same dtype, 16-byte aligned, at temperature 1."""
    return (
        temperature == 1.0
        and rows_and_weight(hidden, weight)
        and weight.shape[0] * weight.element_size() % ALIGNMENT_BYTES == 0
    )


def statistics(hidden: Tensor, weight: Tensor, target: Tensor, owned: Tensor,
               logits_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """This shard's log-sum-exp over its vocabulary columns and each row's label logit (0 where another shard owns
    the label), both fp32 [n] from the GEMM's accumulator; the logits hidden @ weight^T go to `logits_out` where
    given, and nowhere otherwise."""
    from quack.epilogue.library import lse_target_epi

    columns = torch.where(owned, target, -1)  # a column outside [0, V) is never selected: that row is not written
    out = {"D": logits_out} if logits_out is not None else {}
    result = lse_target_epi(hidden, weight.mT, out=out, store_d=logits_out is not None, target=columns, tuned=False)
    return result["lse"], torch.where(owned, result["target_logit"], 0.0)


def reference_statistics(hidden: Tensor, weight: Tensor, target: Tensor, owned: Tensor,
                         logits_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """What `statistics` computes, in PyTorch: the fp32 product (the GEMM's accumulator, up to its summation order),
    its log-sum-exp and label column; the logits rounded to `logits_out`'s dtype. The stand-in for quack's kernel on
    machines it cannot run on (the CPU tests), and the reference of `bench/gpu_lse_gemm.py`."""
    product = hidden.float() @ weight.float().t()
    if logits_out is not None:
        logits_out.copy_(product)
    label_logit = torch.where(owned, product.gather(1, target.unsqueeze(1)).squeeze(1), 0.0)
    return torch.logsumexp(product, dim=1), label_logit
