"""Reference attention for checking the flash_attn stand-in: per packed segment, in float32 math,
with the stand-in's kernel signature (torch.nn.attention.varlen.varlen_attn's). Runs anywhere.

Masking follows FlashAttention-2: query i of a segment with Lq queries and Lk keys sits at key
position i + Lk - Lq (bottom-right alignment) and sees keys j with pos - left <= j <= pos + right,
a negative bound meaning unbounded; `window_size == (-1, 0)` is causal.
"""

from __future__ import annotations

import torch


def allowed(lq: int, lk: int, window_size=(-1, -1)) -> torch.Tensor:
    """(lq, lk) bool: which keys each query sees, FlashAttention-2's rule (see the module doc)."""
    position = torch.arange(lq).unsqueeze(1) + (lk - lq)
    key = torch.arange(lk).unsqueeze(0)
    left, right = window_size
    mask = torch.ones(lq, lk, dtype=torch.bool)
    if right >= 0:
        mask &= key <= position + right
    if left >= 0:
        mask &= key >= position - left
    return mask


def segment_attention(q, k, v, scale=None, window_size=(-1, -1)):
    """q: (Lq, heads, dim); k, v: (Lk, kv_heads, dim). Returns out (Lq, heads, dim) in q's dtype and
    lse (heads, Lq) float32. Differentiable."""
    heads, kv_heads = q.shape[1], k.shape[1]
    group = heads // kv_heads
    qf, kf, vf = (t.float().transpose(0, 1) for t in (q, k, v))  # (heads, L, dim)
    kf, vf = kf.repeat_interleave(group, dim=0), vf.repeat_interleave(group, dim=0)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (qf @ kf.transpose(1, 2)) * scale
    scores = scores.masked_fill(~allowed(q.shape[0], k.shape[0], window_size).to(scores.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ vf
    return out.transpose(0, 1).to(q.dtype), lse


def varlen_attention(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
    """The signature of torch.nn.attention.varlen.varlen_attn, computed segment by segment."""
    outs, lses = [], []
    for i in range(cu_seq_q.numel() - 1):
        qs, qe, ks, ke = int(cu_seq_q[i]), int(cu_seq_q[i + 1]), int(cu_seq_k[i]), int(cu_seq_k[i + 1])
        out, lse = segment_attention(q[qs:qe], k[ks:ke], v[ks:ke], scale, tuple(window_size))
        outs.append(out)
        lses.append(lse)
    out, lse = torch.cat(outs), torch.cat(lses, dim=1)
    if return_aux is not None and return_aux.lse:
        return out, lse
    return out
