"""Step 3, model inputs: one micro-batch's rows as the model consumes them, padded or packed (THD).

* padded layout: every row is shifted left so its real tokens start at column 0 (trailing padding
  is harmless under a causal mask: no real token attends to it);
* packed layout (THD): the real tokens of all rows are concatenated into one row, with
  `PackedSeqParams` marking the boundaries; no compute is spent on padding (compute/packing.py).
"""

from __future__ import annotations

import torch

from skyrl_megatron.compute.microbatch.model_inputs import ModelInputs
from skyrl_megatron.compute.microbatch.rows import IGNORE_LABEL, RowSpans, host_labels
from skyrl_megatron.compute.packing import PackingSettings, pack_padded_batch, round_up


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
    labels = pack_padded_batch(
        host_labels(sequences, attention_mask), attention_mask, settings.parallel, IGNORE_LABEL, min_tokens=min_tokens
    ).tokens
    return ModelInputs(packed.tokens, packed.position_ids, labels, packed.packed_seq_params, spans, host_columns, packed)
