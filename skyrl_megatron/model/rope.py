"""Rotary embeddings for packed (THD) micro-batches in one gather instead of one loop per sequence.

Megatron-Core's unfused THD RoPE (`rope_utils._apply_rotary_pos_emb_thd`, used whenever RoPE
fusion is off, which it must be without Transformer Engine) splits the packed tokens into their
sequences on the host (`cu_seqlens.tolist()`, `.item()`) and rotates each sequence separately.
An RL micro-batch packs dozens of sequences, so every attention layer pays two host syncs and a
few hundred small kernels for query and key: the GPU waits on Python, and the cost does not shrink
with the model (on one H200, Qwen3-1.7B and Qwen3-4B took the same time per token).

`apply_thd_rope` computes every token's position on the device (its offset inside its sequence,
mapped to the original position under context parallelism's two-chunk split) and rotates all
tokens with one gather of the frequency table. Its arguments and results are those of
Megatron's function, both frequency layouts included, so `install()` can put it in its place.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MEGATRON_THD = None  # Megatron's own function, kept for comparison in tests


def thd_positions(cu_seqlens: Tensor, local_tokens: int, cp_size: int, cp_rank: int) -> tuple[Tensor, Tensor]:
    """Position of each of this rank's packed tokens inside its (global, padded) sequence, and the
    index of that sequence.

    `cu_seqlens` are the global boundaries; under context parallelism each sequence is cut into
    2 x CP chunks and rank r holds chunks r and 2CP-1-r (Megatron's load-balanced split), so its
    `local_tokens` are the global count divided by CP.
    """
    local_cu = torch.div(cu_seqlens, cp_size, rounding_mode="floor")
    token = torch.arange(local_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    sequence = torch.searchsorted(local_cu[1:], token, right=True)
    offset = token - local_cu[sequence]
    if cp_size == 1:
        return offset, sequence
    chunk = torch.div(local_cu[1:] - local_cu[:-1], 2, rounding_mode="floor")[sequence]
    position = torch.where(
        offset < chunk,
        cp_rank * chunk + offset,
        (2 * cp_size - cp_rank - 1) * chunk + (offset - chunk),
    )
    return position, sequence


def apply_thd_rope(
    t: Tensor,
    cu_seqlens: Tensor,
    freqs: Tensor,
    rotary_interleaved: bool = False,
    mla_rotary_interleaved: bool = False,
    mscale: float = 1.0,
    cp_group=None,
    multi_latent_attention: bool | None = None,
) -> Tensor:
    """RoPE on packed `t` [tokens, heads, dim]; Megatron's `_apply_rotary_pos_emb_thd` contract.

    `freqs` is either the table of positions [max_seqlen, 1, 1, dim] (each sequence starts at 0)
    or, when it has one row per packed token of the global batch, positions for the whole batch
    (each sequence reads from its own offset), as Megatron distinguishes them.
    """
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    if multi_latent_attention is not None:
        mla_rotary_interleaved = multi_latent_attention
    if cp_group is None:
        raise ValueError("cp_group must be provided for THD format RoPE")
    cp_size = cp_group.size()
    positions, sequence = thd_positions(cu_seqlens, t.shape[0], cp_size, cp_group.rank())
    # the packed tokens of all CP ranks are the global total: no host read of cu_seqlens[-1]
    if freqs.dim() >= 1 and freqs.size(0) == t.shape[0] * cp_size:
        positions = positions + cu_seqlens[sequence]
    return _apply_rotary_pos_emb_bshd(
        t.unsqueeze(1),
        freqs[positions],
        rotary_interleaved=rotary_interleaved,
        mla_rotary_interleaved=mla_rotary_interleaved,
        mscale=mscale,
    ).squeeze(1)


def install() -> None:
    """Route Megatron-Core's unfused THD RoPE to `apply_thd_rope` (idempotent, once per process)."""
    global _MEGATRON_THD
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils._apply_rotary_pos_emb_thd is not apply_thd_rope:
        _MEGATRON_THD = rope_utils._apply_rotary_pos_emb_thd
        rope_utils._apply_rotary_pos_emb_thd = apply_thd_rope
