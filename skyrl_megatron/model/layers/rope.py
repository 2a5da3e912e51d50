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

from skyrl_megatron.model.layers.fusions import compile_kernel

_MEGATRON_THD = None  # Megatron's own function, kept for comparison in tests
_FUSED = False  # rotate with the generated kernel (`install(fused=True)`)


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

    The eager rotation is Megatron's own arithmetic (`_apply_rotary_pos_emb_bshd`), bitwise, with
    two kernels fewer per call: the cos/sin rows come from `_TABLES` (computed once per
    micro-batch, not for query and key of every layer), and there is no concatenation with an
    empty pass-through part when RoPE covers the whole head. The fused rotation (`install(fused=
    True)`) does the same arithmetic in fp32 in one kernel per direction.
    """
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd, _rotate_half

    if multi_latent_attention is not None:
        mla_rotary_interleaved = multi_latent_attention
    if cp_group is None:
        raise ValueError("cp_group must be provided for THD format RoPE")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    if mla_rotary_interleaved or freqs.shape[-1] != t.shape[-1]:
        # partial or MLA-interleaved rotary: Megatron's function on this rank's frequency rows
        rows = frequency_rows(freqs, cu_seqlens, t.shape[0], cp_size, cp_rank)
        return _apply_rotary_pos_emb_bshd(
            t.unsqueeze(1),
            rows,
            rotary_interleaved=rotary_interleaved,
            mla_rotary_interleaved=mla_rotary_interleaved,
            mscale=mscale,
        ).squeeze(1)
    cos, sin = _TABLES.get(freqs, cu_seqlens, t.shape[0], cp_size, cp_rank, t.dtype, mscale)
    if _FUSED and not rotary_interleaved:
        return fused_rotate_half_rope(t, cos.squeeze(1), sin.squeeze(1))
    t = t.unsqueeze(1)  # [tokens, 1, heads, dim]: the layout Megatron's rotate-half indexes
    return ((t * cos) + (_rotate_half(t, rotary_interleaved) * sin)).squeeze(1)


def rotate_half_rope(t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """t [tokens, heads, dim] rotated by cos/sin [tokens, 1, dim] (rotate-half layout), in fp32."""
    t32 = t.float()
    first, second = torch.chunk(t32, 2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return (t32 * cos.float() + rotated * sin.float()).to(t.dtype)


# one generated kernel per direction (`model/layers/fusions.py`), compiled at its first call
fused_rotate_half_rope = compile_kernel(rotate_half_rope)


def frequency_rows(freqs: Tensor, cu_seqlens: Tensor, local_tokens: int, cp_size: int, cp_rank: int) -> Tensor:
    """The frequency row [local_tokens, 1, 1, dim] of each of this rank's packed tokens."""
    positions, sequence = thd_positions(cu_seqlens, local_tokens, cp_size, cp_rank)
    # the packed tokens of all CP ranks are the global total: no host read of cu_seqlens[-1]
    if freqs.dim() >= 1 and freqs.size(0) == local_tokens * cp_size:
        positions = positions + cu_seqlens[sequence]
    return freqs[positions]


class _RotationTables:
    """cos and sin rows of the packed tokens of the micro-batch being run.

    Every attention layer rotates query and key of the same tokens by the same rows, so they are
    computed at the first call of a micro-batch and reused until the inputs change. The inputs are
    recognised by identity: Megatron passes the same frequency table and boundary tensors to
    every layer, and a new micro-batch brings new boundary tensors. The last entry is held
    (a few MB), so an identity cannot be reused by another tensor while it is cached.
    """

    def __init__(self):
        self._inputs: tuple | None = None
        self._tables: tuple[Tensor, Tensor] | None = None

    def get(self, freqs, cu_seqlens, local_tokens, cp_size, cp_rank, dtype, mscale) -> tuple[Tensor, Tensor]:
        inputs = self._inputs
        settings = (local_tokens, cp_size, cp_rank, dtype, mscale)
        if inputs is not None and inputs[0] is freqs and inputs[1] is cu_seqlens and inputs[2:] == settings:
            return self._tables
        rows = frequency_rows(freqs, cu_seqlens, local_tokens, cp_size, cp_rank)
        # exactly Megatron's expressions, so the rotation is bitwise the same
        self._tables = ((torch.cos(rows) * mscale).to(dtype), (torch.sin(rows) * mscale).to(dtype))
        self._inputs = (freqs, cu_seqlens, *settings)
        return self._tables

    def clear(self) -> None:
        self._inputs = self._tables = None


_TABLES = _RotationTables()


def rotation_tables(freqs: Tensor, cu_seqlens: Tensor, local_tokens: int, cp_size: int, cp_rank: int,
                    dtype: torch.dtype, mscale: float = 1.0) -> tuple[Tensor, Tensor]:
    """cos and sin [local_tokens, 1, 1, dim] of this rank's packed tokens, as `apply_thd_rope` rotates by
    (computed once per micro-batch)."""
    return _TABLES.get(freqs, cu_seqlens, local_tokens, cp_size, cp_rank, dtype, mscale)


def is_fused() -> bool:
    return _FUSED


def install(fused: bool = False) -> None:
    """Route Megatron-Core's unfused THD RoPE to `apply_thd_rope` (idempotent).

    `fused`: rotate with the generated kernel. It applies to every model of the process; the
    workers build one model each.
    """
    global _MEGATRON_THD, _FUSED
    from megatron.core.models.common.embeddings import rope_utils

    _FUSED = fused
    if rope_utils._apply_rotary_pos_emb_thd is not apply_thd_rope:
        _MEGATRON_THD = rope_utils._apply_rotary_pos_emb_thd
        rope_utils._apply_rotary_pos_emb_thd = apply_thd_rope
