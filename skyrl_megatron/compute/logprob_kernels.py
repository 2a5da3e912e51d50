"""Triton kernels for one chunk of the logprob head (`compute/logprobs.py`, `fused_kernels: [logprobs]`).

A chunk's logits [n, V/TP] come out of the GEMM in the weight's dtype. The statistics kernel walks each
row once with a running max (one exponential per logit), the gradient kernel reads each logit once and
writes its gradient over it. Both compute in fp32. The torch.compile-generated versions they replace
compiled for symbolic sizes and ran at about a fifth of the H200's bandwidth at vocabulary 151,936
(0.7 ms and 1.2 ms per 1,766-token chunk, 76 ms of a 30B-A3B-widths training call; profiled 2026-12-02).

Imported only where the kernels run (triton at import).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# logits per step of a row's walk (statistics) and per program (gradient): with 8 and 4 warps, 16 and 32 per
# thread, so each thread's bf16 loads are 16-byte vectors
_STATISTICS_BLOCK = 4096
_GRAD_BLOCK = 4096
# below any finite logit, and still finite: exp(_FLOOR - m) is 0 and (_FLOOR - m) * 0 is 0, where -inf gives NaN
_FLOOR = tl.constexpr(-3.0e38)


@triton.jit
def _statistics_kernel(logits_ptr, row_stride, vocab, target_ptr, owned_ptr, temperature,
                       max_ptr, sum_ptr, target_logit_ptr, weighted_ptr,
                       TEMPERED: tl.constexpr, WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride
    columns = tl.arange(0, BLOCK)
    # per-lane sums against one running max m: sum exp(z - m) and sum exp(z - m)(z - m)
    lane_sum = tl.zeros((BLOCK,), tl.float32)
    lane_weighted = tl.zeros((BLOCK,), tl.float32)
    running_max = tl.max(tl.full((BLOCK,), _FLOOR, tl.float32), axis=0)
    for start in range(0, vocab, BLOCK):
        in_row = start + columns < vocab
        z = tl.load(row_ptr + start + columns, mask=in_row, other=float("-inf")).to(tl.float32)
        if TEMPERED:
            z = z / temperature
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        rescale = tl.exp(running_max - new_max)
        shifted = z - new_max
        exp_shifted = tl.exp(shifted)  # 0 off the row
        if WITH_ENTROPY:
            # re-centred on the new max: exp(z - m')(z - m') = rescale * exp(z - m)((z - m) + (m - m'))
            lane_weighted = (rescale * (lane_weighted + (running_max - new_max) * lane_sum)
                             + tl.where(in_row, exp_shifted * shifted, 0.0))
        lane_sum = lane_sum * rescale + exp_shifted
        running_max = new_max

    tl.store(max_ptr + row, running_max)
    tl.store(sum_ptr + row, tl.sum(lane_sum, axis=0))
    if WITH_ENTROPY:
        tl.store(weighted_ptr + row, tl.sum(lane_weighted, axis=0))
    owned = tl.load(owned_ptr + row) != 0
    target_logit = tl.load(row_ptr + tl.load(target_ptr + row), mask=owned, other=0.0).to(tl.float32)
    if TEMPERED:
        target_logit = target_logit / temperature
    tl.store(target_logit_ptr + row, tl.where(owned, target_logit, 0.0))


@triton.jit
def _logit_grad_kernel(logits_ptr, row_stride, vocab, log_partition_ptr, g_logprob_ptr, target_ptr, owned_ptr,
                       entropy_ptr, g_entropy_ptr, temperature,
                       TEMPERED: tl.constexpr, WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = columns < vocab
    offsets = row.to(tl.int64) * row_stride + columns
    z = tl.load(logits_ptr + offsets, mask=in_row, other=0.0).to(tl.float32)
    if TEMPERED:
        z = z / temperature
    log_p = z - tl.load(log_partition_ptr + row)
    g_logprob = tl.load(g_logprob_ptr + row)
    coefficient = g_logprob
    if WITH_ENTROPY:
        coefficient = coefficient + (log_p + tl.load(entropy_ptr + row)) * tl.load(g_entropy_ptr + row)
    is_label = (columns == tl.load(target_ptr + row)) & (tl.load(owned_ptr + row) != 0)
    grad = tl.where(is_label, g_logprob, 0.0) - tl.exp(log_p) * coefficient
    if TEMPERED:
        grad = grad / temperature
    # over the logits: each program reads its stretch before writing it, and nothing reads them after
    tl.store(logits_ptr + offsets, grad.to(logits_ptr.dtype.element_ty), mask=in_row)


def _row_major(logits: Tensor) -> Tensor:
    if logits.stride(1) != 1:
        raise ValueError(f"the logits' columns must be contiguous, got strides {logits.stride()}")
    return logits


def shard_statistics(logits: Tensor, target: Tensor, owned: Tensor, temperature: float, with_entropy: bool):
    """Per row of the tempered logits z [n, V]: max m, sum exp(z - m), z[target] (0 where not `owned`) and,
    with the entropy, sum exp(z - m)(z - m); fp32 [n] each (the last None without the entropy)."""
    logits = _row_major(logits)
    rows, vocab = logits.shape
    shard_max, shard_sum, target_logit = (torch.empty(rows, dtype=torch.float32, device=logits.device)
                                          for _ in range(3))
    weighted = torch.empty_like(shard_sum) if with_entropy else None
    if rows:
        _statistics_kernel[(rows,)](
            logits, logits.stride(0), vocab, target, owned, float(temperature),
            shard_max, shard_sum, target_logit, weighted if with_entropy else shard_sum,
            TEMPERED=temperature != 1.0, WITH_ENTROPY=with_entropy, BLOCK=_STATISTICS_BLOCK, num_warps=8,
        )
    return shard_max, shard_sum, target_logit, weighted


def logit_grads_(logits: Tensor, log_partition: Tensor, g_logprob: Tensor, target: Tensor, owned: Tensor,
                 temperature: float, entropy: Tensor | None, g_entropy: Tensor | None) -> Tensor:
    """d loss / d z written over `logits` [n, V] (in their dtype) and returned:
    g_logprob (1[v = label] - p_v) - g_entropy p_v (log p_v + H), divided by the temperature."""
    logits = _row_major(logits)
    rows, vocab = logits.shape
    with_entropy = entropy is not None
    # autograd may hand the incoming gradients over expanded (stride 0): the kernel reads one value per row
    g_logprob = g_logprob.contiguous()
    if with_entropy:
        entropy, g_entropy = entropy.contiguous(), g_entropy.contiguous()
    if rows:
        _logit_grad_kernel[(rows, triton.cdiv(vocab, _GRAD_BLOCK))](
            logits, logits.stride(0), vocab, log_partition, g_logprob, target, owned,
            entropy if with_entropy else log_partition, g_entropy if with_entropy else g_logprob, float(temperature),
            TEMPERED=temperature != 1.0, WITH_ENTROPY=with_entropy, BLOCK=_GRAD_BLOCK, num_warps=4,
        )
    return logits
