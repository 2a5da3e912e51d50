"""Step 3, model inputs: one micro-batch's rows as the model consumes them, padded or packed (THD).

* padded layout: every row is shifted left so its real tokens start at column 0 (trailing padding
  is harmless under a causal mask: no real token attends to it);
* packed layout (THD): the real tokens of all rows are concatenated into one row, with
  `PackedSeqParams` marking the boundaries; no compute is spent on padding (`pack_padded_batch`).

A batch arrives padded, as the host holds it: `sequences` [B, S] and an `attention_mask` [B, S] with a
left-padded prompt and a right-padded response::

    row 0:  _ _ p p p r r _        (_ padding, p prompt, r response)
    row 1:  p p p p r r r r

**Packing** drops the padding and lays the rows end to end in one row [1, T] (THD: "total tokens" x
heads x head dim inside attention)::

    tokens:       p p p r r · · · p p p p r r r r        (· alignment padding, here for CP = 2)
    position_ids: 0 1 2 3 4 5 6 7 0 1 2 3 4 5 6 7        (restart at 0 for every sequence)
    cu_seqlens:   [0, 8, 16]                             (sequence i is tokens[cu[i]:cu[i+1]])

Each sequence is padded at its end to the alignment the plan's `PackingSettings` give (`plan.py`:
`packed_lengths`). Padding sits after a sequence's real tokens, so under causal attention it never
changes them; it belongs to that sequence (its positions continue the sequence's). `PackedSeqParams`
carries the padded boundaries (as `cu_seqlens_*` and `cu_seqlens_*_padded` alike): Megatron's RoPE and
our core attention read the layout from them, and the context-parallel split cuts the row at them
(`model/layers/context_parallel_layout.py`).
"""

from __future__ import annotations

import torch

from skyrl_megatron.compute.microbatch.model_inputs import ModelInputs, PackedBatch, pack_like
from skyrl_megatron.compute.microbatch.plan import PackingSettings, packed_lengths, round_up
from skyrl_megatron.compute.microbatch.rows import IGNORE_LABEL, RowSpans, host_labels
from skyrl_megatron.parallel import ParallelConfig


def build_model_inputs(
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    settings: PackingSettings,
    *,
    pad_token_id: int = 0,
    padded_shape: tuple[int, int] | None = None,
    spans: RowSpans | None = None,
) -> ModelInputs:
    """Model inputs for rows `sequences` [b, S] with their `attention_mask` (and their `spans`, when
    the caller has them already).

    `padded_shape` forces the model-side shape ([rows, columns] for padded, [1, tokens] for packed):
    pipeline stages exchange fixed-shape activations, so every micro-batch of one schedule call is
    given the same shape.
    """
    if spans is None:
        spans = RowSpans.from_attention_mask(attention_mask)
    if settings.packed:
        return _packed_inputs(sequences, attention_mask, spans, settings, pad_token_id, padded_shape)
    return _padded_inputs(sequences, attention_mask, spans, settings, pad_token_id, padded_shape)


def _padded_inputs(sequences, attention_mask, spans, settings, pad_token_id, padded_shape) -> ModelInputs:
    host_columns = sequences.shape[1]
    num_rows, width = sequences.shape[0], round_up(max([*spans.length.tolist(), 1]), settings.row_align)
    if padded_shape is not None:
        if padded_shape[0] < num_rows or padded_shape[1] < width:
            raise ValueError(f"padded_shape {padded_shape} is smaller than the micro-batch ({num_rows}, {width})")
        num_rows, width = padded_shape
    input_ids = torch.full((num_rows, width), pad_token_id, dtype=torch.long)
    labels = torch.full((num_rows, width), IGNORE_LABEL, dtype=torch.long)
    labels_in_host_columns = host_labels(sequences, attention_mask)
    for i, (start, length) in enumerate(zip(spans.start.tolist(), spans.length.tolist())):
        input_ids[i, :length] = sequences[i, start : start + length]
        labels[i, :length] = labels_in_host_columns[i, start : start + length]
    position_ids = torch.arange(width).unsqueeze(0).expand(num_rows, width).contiguous()
    return ModelInputs(input_ids, position_ids, labels, None, spans, host_columns)


def _packed_inputs(sequences, attention_mask, spans, settings, pad_token_id, padded_shape) -> ModelInputs:
    from megatron.core.packed_seq_params import PackedSeqParams

    host_columns = sequences.shape[1]
    min_tokens = padded_shape[1] if padded_shape is not None else 0
    if sequences.shape[0] == 0:
        # an empty micro-batch (padding the count across ranks): one ignored sequence of pad tokens
        total = max(min_tokens, settings.row_align)
        cu = torch.tensor([0, total], dtype=torch.int32)
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
            cu_seqlens_kv_padded=cu, max_seqlen_q=total, max_seqlen_kv=total,
        )
        ids = torch.full((1, total), pad_token_id, dtype=torch.long)
        return ModelInputs(ids, torch.arange(total).unsqueeze(0), torch.full_like(ids, IGNORE_LABEL), params, spans, host_columns)
    packed = pack_padded_batch(sequences, attention_mask, settings.parallel, pad_token_id, min_tokens=min_tokens)
    labels = pack_like(host_labels(sequences, attention_mask), packed, IGNORE_LABEL)
    return ModelInputs(packed.tokens, packed.position_ids, labels, packed.packed_seq_params, spans, host_columns, packed)


def pack_padded_batch(
    tokens: torch.Tensor,
    attention_mask: torch.Tensor,
    parallel: ParallelConfig = ParallelConfig(),
    pad_token_id: int = 0,
    min_tokens: int = 0,
) -> PackedBatch:
    """Pack the real tokens (`attention_mask` == 1) of a padded batch [B, S] into one row [1, T].

    Tokens keep their order within a row. Alignment padding for `parallel` (see the module
    docstring) is filled with `pad_token_id`. `min_tokens` (a multiple of the row alignment) pads
    the last sequence further: pipeline stages exchange fixed-shape activations, so every
    micro-batch of one schedule call is given the same T.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    if tokens.dim() != 2 or tokens.shape != attention_mask.shape:
        raise ValueError(
            f"tokens {tuple(tokens.shape)} and attention_mask {tuple(attention_mask.shape)} must both be [B, S]"
        )
    batch, seq = tokens.shape
    device = tokens.device
    mask = attention_mask.bool()
    seq_lengths = tuple(int(n) for n in mask.sum(dim=1).tolist())
    if not any(seq_lengths):
        raise ValueError("the batch has no tokens (attention_mask is all zero)")
    padded = packed_lengths(seq_lengths, parallel, min_tokens)
    starts = [0]
    for length in padded:
        starts.append(starts[-1] + length)

    padded_index = mask.reshape(-1).nonzero().squeeze(1)  # row-major: sequence by sequence, in order
    packed_index = torch.cat([torch.arange(start, start + n) for start, n in zip(starts, seq_lengths)]).to(device)
    packed_tokens = torch.full((starts[-1],), pad_token_id, dtype=tokens.dtype, device=device)
    packed_tokens[packed_index] = tokens.reshape(-1)[padded_index]
    position_ids = torch.cat([torch.arange(length) for length in padded]).to(device)

    cu_seqlens = torch.tensor(starts, dtype=torch.int32, device=device)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens,
        cu_seqlens_kv_padded=cu_seqlens,
        max_seqlen_q=max(padded),
        max_seqlen_kv=max(padded),
    )
    return PackedBatch(
        tokens=packed_tokens.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        packed_seq_params=params,
        seq_lengths=seq_lengths,
        seq_lengths_padded=tuple(padded),
        batch_shape=(batch, seq),
        padded_index=padded_index,
        packed_index=packed_index,
    )
