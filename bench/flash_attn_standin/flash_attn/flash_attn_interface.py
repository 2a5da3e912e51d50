"""flash-attn 2.8.3's attention entry points on PyTorch's FlashAttention-2 kernels.

`torch.nn.attention.varlen.varlen_attn` runs the FlashAttention-2 kernels PyTorch ships (the ones
SDPA's flash backend calls) over packed sequences, with grouped-query attention (fewer K/V heads)
and sliding windows, forward and backward. Both entry points go through it:

- `flash_attn_varlen_func` (packed sequences: the host's sample packing) maps one to one;
- `flash_attn_func` (a [batch, seqlen, heads, dim] call) runs as `batch` packed segments of equal
  length. This keeps flash-attn's own semantics where SDPA's differ: the causal mask is aligned to
  the bottom right when query and key lengths differ (SDPA's `is_causal` is top-left), windows are
  honoured, and the log-sum-exp comes back in flash-attn's layout.

With `FLASH_ATTN_STANDIN_KERNEL=flash4` in the environment (bench/policy_bench.py sets it for the host's
workers where flash-attn-4 runs ours, so that every side has the same attention kernel) the calls go to
flash-attn-4's `flash_attn.cute.flash_attn_varlen_func` instead (the assembled stand-in carries
`flash_attn/cute` where flash-attn-4 is installed beside flash-attn 2's files), for causal full-context
attention without the log-sum-exp; anything else on that route is refused.

Covered: softmax_scale, causal, window_size, GQA/MQA, return_attn_probs (returns the log-sum-exp;
no attention probabilities). Refused with a clear error: dropout, softcap, ALiBi, deterministic
backward, paged KV (block_table) and `flash_attn_with_kvcache`: the PyTorch entry has none of them,
and training and scoring (what the stand-in is for) use none.
"""

from __future__ import annotations

import os

import torch

KERNEL_VARIABLE = "FLASH_ATTN_STANDIN_KERNEL"  # "flash4": flash-attn-4's kernels; unset: PyTorch's FA2

# The kernel every call goes through: torch.nn.attention.varlen.varlen_attn when None. Tests on a
# machine without CUDA put a reference implementation with the same signature here.
varlen_kernel = None


class UnsupportedByStandIn(ValueError):
    """An argument flash-attn accepts that this stand-in (PyTorch's FA2 entry) cannot honour."""


def _kernel(q: torch.Tensor):
    if varlen_kernel is not None:
        return varlen_kernel
    if not q.is_cuda:
        raise RuntimeError(
            "flash_attn stand-in: PyTorch's FlashAttention-2 kernels run on CUDA only; got tensors on "
            f"{q.device}. Use attn_implementation='sdpa' off the GPU."
        )
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def _refuse_unsupported(q, dropout_p, softcap, alibi_slopes, deterministic, block_table=None) -> None:
    problems = []
    if dropout_p:
        problems.append(f"dropout_p={dropout_p} (PyTorch's varlen FA2 entry runs without dropout; use 0.0)")
    if softcap:
        problems.append(f"softcap={softcap} (no logit soft-capping; use 0.0)")
    if alibi_slopes is not None:
        problems.append("alibi_slopes (no ALiBi bias)")
    if deterministic:
        problems.append("deterministic=True (no deterministic backward; unset FLASH_ATTENTION_DETERMINISTIC)")
    if block_table is not None:
        problems.append("block_table (no paged KV cache)")
    if q.dtype not in (torch.float16, torch.bfloat16):
        problems.append(f"{q.dtype} inputs (FlashAttention-2 takes float16 and bfloat16 only)")
    if problems:
        raise UnsupportedByStandIn("flash_attn stand-in (PyTorch FlashAttention-2) does not support: " + "; ".join(problems))


def _flash4_varlen():
    """flash-attn-4's varlen entry where the environment asks for it, else None."""
    if os.environ.get(KERNEL_VARIABLE, "") != "flash4":
        return None
    from flash_attn.cute import flash_attn_varlen_func as flash4_varlen

    return flash4_varlen


def _refuse_on_flash4(causal: bool, window_size, return_attn_probs: bool) -> None:
    problems = []
    if not causal or tuple(int(w) for w in window_size) != (-1, -1):
        problems.append(f"causal={causal}, window_size={tuple(window_size)} (causal full-context attention only)")
    if return_attn_probs:
        problems.append("return_attn_probs=True (no log-sum-exp on this route)")
    if problems:
        raise UnsupportedByStandIn(f"flash_attn stand-in with {KERNEL_VARIABLE}=flash4 does not support: "
                                   + "; ".join(problems))


def _window(causal: bool, window_size) -> tuple[int, int]:
    """flash-attn's (left, right) window under `causal`, in PyTorch's form: a causal call sees no key to
    its right, and PyTorch's entry treats exactly (-1, 0) as causal (a tuple, not a list)."""
    left, right = (int(w) for w in window_size)
    return (left, 0) if causal else (left, right)


def _as_int(value) -> int:
    return int(value.item()) if isinstance(value, torch.Tensor) else int(value)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """q: (total_q, heads, dim); k, v: (total_k, kv_heads, dim); cu_seqlens_*: (batch + 1,) int32.
    Returns out (total_q, heads, dim), or (out, softmax_lse (heads, total_q) float32, None)."""
    _refuse_unsupported(q, dropout_p, softcap, alibi_slopes, deterministic, block_table)
    if (flash4 := _flash4_varlen()) is not None:
        _refuse_on_flash4(causal, window_size, return_attn_probs)
        out = flash4(q, k, v, cu_seqlens_q=cu_seqlens_q.to(torch.int32), cu_seqlens_k=cu_seqlens_k.to(torch.int32),
                     max_seqlen_q=_as_int(max_seqlen_q), max_seqlen_k=_as_int(max_seqlen_k),
                     softmax_scale=softmax_scale, causal=True)
        return out[0] if isinstance(out, tuple) else out  # (out, lse) in some releases
    from torch.nn.attention.varlen import AuxRequest

    out, lse = _kernel(q)(
        q,
        k,
        v,
        cu_seqlens_q.to(torch.int32),
        cu_seqlens_k.to(torch.int32),
        _as_int(max_seqlen_q),
        _as_int(max_seqlen_k),
        return_aux=AuxRequest(lse=True),
        scale=softmax_scale,
        window_size=_window(causal, window_size),
    )
    return (out, lse, None) if return_attn_probs else out


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q: (batch, seqlen_q, heads, dim); k, v: (batch, seqlen_k, kv_heads, dim). Returns out
    (batch, seqlen_q, heads, dim), or (out, softmax_lse (batch, heads, seqlen_q) float32, None)."""
    _refuse_unsupported(q, dropout_p, softcap, alibi_slopes, deterministic)
    batch, seqlen_q, heads, _ = q.shape
    seqlen_k = k.shape[1]

    def offsets(length: int) -> torch.Tensor:
        return torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=q.device)

    result = flash_attn_varlen_func(
        q.reshape(batch * seqlen_q, heads, q.shape[-1]),
        k.reshape(batch * seqlen_k, k.shape[2], k.shape[-1]),
        v.reshape(batch * seqlen_k, v.shape[2], v.shape[-1]),
        offsets(seqlen_q),
        offsets(seqlen_k),
        seqlen_q,
        seqlen_k,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        return_attn_probs=return_attn_probs,
    )
    if not return_attn_probs:
        return result.view(batch, seqlen_q, heads, result.shape[-1])
    out, lse, _ = result
    return out.view(batch, seqlen_q, heads, out.shape[-1]), lse.view(heads, batch, seqlen_q).transpose(0, 1), None


def flash_attn_with_kvcache(*args, **kwargs):
    """Decoding with a KV cache: not covered (the stand-in serves training and scoring)."""
    raise NotImplementedError(
        "flash_attn stand-in: flash_attn_with_kvcache is not provided (PyTorch's FA2 entry has no KV-cache "
        "decoding); generate with attn_implementation='sdpa' or install flash-attn built for this torch"
    )
