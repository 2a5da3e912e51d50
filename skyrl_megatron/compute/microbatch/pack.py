"""Step 3, pack: one micro-batch's rows laid out as the model consumes them, padded or packed (THD).

* padded layout: every row is shifted left so its real tokens start at column 0 (trailing padding
  is harmless under a causal mask: no real token attends to it);
* packed layout (THD): the real tokens of all rows are concatenated into one row, with
  `PackedSeqParams` marking the boundaries; no compute is spent on padding.

A batch arrives padded, as the host holds it: `sequences` [B, S] and an `attention_mask` [B, S] with a
left-padded prompt and a right-padded response::

    row 0:  _ _ p p p r r _        (_ padding, p prompt, r response)
    row 1:  p p p p r r r r

**Packing** drops the padding and lays the rows end to end in one row [1, T] (THD: "total tokens" x
heads x head dim inside attention)::

    tokens:       p p p r r · · · p p p p r r r r        (· alignment padding, here for CP = 2)
    position_ids: 0 1 2 3 4 5 6 7 0 1 2 3 4 5 6 7        (restart at 0 for every sequence)
    cu_seqlens:   [0, 8, 16]                             (sequence i is tokens[cu[i]:cu[i+1]])

Each sequence is padded at its end to the length the plan gave it (`MicroBatchLayout.packed_lengths`,
aligned for CP and SP by `plan.packed_lengths`). Padding sits after a sequence's real tokens, so under
causal attention it never changes them; it belongs to that sequence (its positions continue the
sequence's). `PackedSeqParams` carries the padded boundaries (as `cu_seqlens_*` and
`cu_seqlens_*_padded` alike): Megatron's RoPE and our core attention read the layout from them, and the
context-parallel split cuts the row at them (`model/layers/context_parallel_layout.py`).

Every per-token tensor of the micro-batch takes this layout here, in one place: the tokens, their
labels, and, for the routers, the real-token mask and the routes to replay. `ModelInputs` keeps the
maps between the host's columns and the model layout, for the way back (`results.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from skyrl_megatron.compute.microbatch.plan import MicroBatchLayout, packed_lengths
from skyrl_megatron.compute.microbatch.rows import IGNORE_LABEL, HostRows, RowSpans, host_labels
from skyrl_megatron.compute.route_replay import NO_ROUTE
from skyrl_megatron.host_copies import to_device
from skyrl_megatron.parallel import ParallelConfig

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams


@dataclass(frozen=True)
class PackedBatch:
    """A padded batch packed into one THD row, and what is needed to map outputs back."""

    tokens: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    packed_seq_params: PackedSeqParams  # global padded boundaries, the same on every CP rank
    seq_lengths: tuple[int, ...]  # real tokens per sequence
    seq_lengths_padded: tuple[int, ...]  # tokens per sequence in the packed row (they sum to T)
    batch_shape: tuple[int, int]  # (B, S) of the padded batch
    padded_index: torch.Tensor  # [N] flat positions in the [B*S] padded batch of the real tokens,
    packed_index: torch.Tensor  # [N] and their positions in the packed row

    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[1]


def pack_like(padded_values: torch.Tensor, packed: PackedBatch, fill_value: int | float) -> torch.Tensor:
    """Per-token values of the padded batch [B, S] laid out as the packed row [1, T] (`fill_value` in its
    alignment padding): the tokens' packing applied to other columns (labels), without packing again."""
    out = padded_values.new_full((packed.num_tokens,), fill_value)
    out[packed.packed_index] = padded_values.reshape(-1)[packed.padded_index]
    return out.unsqueeze(0)


def unpack_to_padded(packed_output: torch.Tensor, packed: PackedBatch, fill_value: float = 0.0) -> torch.Tensor:
    """Per-token outputs of the packed row [1, T, ...] -> [B, S, ...] at the tokens' padded positions;
    padding positions get `fill_value`."""
    if tuple(packed_output.shape[:2]) != (1, packed.num_tokens):
        raise ValueError(f"expected packed output [1, {packed.num_tokens}, ...], got {tuple(packed_output.shape)}")
    batch, seq = packed.batch_shape
    features = packed_output.shape[2:]
    out = packed_output.new_full((batch * seq, *features), fill_value)
    # the host's indices moved explicitly: indexing a GPU tensor with host ones copies them from pageable
    # memory, which waits for the device (here: for the forward the loss follows)
    device = packed_output.device
    out[to_device(packed.padded_index, device)] = packed_output[0, to_device(packed.packed_index, device)]
    return out.reshape(batch, seq, *features)


@dataclass
class ModelInputs:
    """One micro-batch as the model consumes it (all CP ranks' tokens), and how its per-token data
    maps to and from the host's columns."""

    input_ids: torch.Tensor  # [b, s] (padded) or [1, T] (packed)
    position_ids: torch.Tensor
    labels: torch.Tensor  # next-token ids in the same layout, IGNORE_LABEL where there is none
    packed_seq_params: Any | None  # megatron PackedSeqParams for the packed layout
    spans: RowSpans
    host_columns: int  # S
    packed: PackedBatch | None = None  # the packing, for mapping outputs back

    def to_host_columns(self, per_token: torch.Tensor) -> torch.Tensor:
        """Per-token outputs in the model layout -> [b, S] in the host's columns (0 at padding)."""
        b = self.spans.length.numel()
        if b == 0:
            return per_token.new_zeros(0, self.host_columns)
        if self.packed is not None:
            return unpack_to_padded(per_token, self.packed)
        device = per_token.device
        start, length = to_device(self.spans.start, device), to_device(self.spans.length, device)
        width = int(self.spans.length.max())
        steps = torch.arange(width, device=device)
        valid = steps.unsqueeze(0) < length.unsqueeze(1)  # [b, width]
        source = per_token[:b, :width]
        out = per_token.new_zeros(b, self.host_columns)
        columns = (start.unsqueeze(1) + steps).clamp(max=self.host_columns - 1)
        return out.scatter(1, columns, torch.where(valid, source, torch.zeros_like(source)))

    def real_token_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat positions in the model layout [b' * s'], flat positions in the host's [b * S]) of
        the real tokens, in the same order: the map between the two layouts for per-token data of
        any trailing shape (routes, masks)."""
        if self.packed is not None:
            return self.packed.packed_index.cpu(), self.packed.padded_index.cpu()
        start, length = self.spans.start.cpu(), self.spans.length.cpu()
        if length.numel() == 0:
            empty = torch.zeros(0, dtype=torch.long)
            return empty, empty
        width = self.input_ids.shape[1]
        steps = torch.arange(int(length.max()))
        rows, columns = (steps.unsqueeze(0) < length.unsqueeze(1)).nonzero(as_tuple=True)
        return rows * width + columns, rows * self.host_columns + start[rows] + columns

    def from_host_layout(self, per_token: torch.Tensor, fill_value) -> torch.Tensor:
        """[b, S, ...] in the host's columns -> the model layout [b', s', ...]; `fill_value` at padding."""
        model_index, host_index = self.real_token_positions()
        features = per_token.shape[2:]
        out = per_token.new_full((self.input_ids.numel(), *features), fill_value)
        device = per_token.device
        out[to_device(model_index, device)] = per_token.reshape(-1, *features)[to_device(host_index, device)]
        return out.reshape(*self.input_ids.shape, *features)

    def to_host_layout(self, per_token: torch.Tensor, fill_value) -> torch.Tensor:
        """[b', s', ...] in the model layout -> [b, S, ...] in the host's columns; `fill_value` at padding."""
        model_index, host_index = self.real_token_positions()
        features = per_token.shape[2:]
        out = per_token.new_full((self.spans.length.numel() * self.host_columns, *features), fill_value)
        device = per_token.device
        out[to_device(host_index, device)] = per_token.reshape(-1, *features)[to_device(model_index, device)]
        return out.reshape(self.spans.length.numel(), self.host_columns, *features)

    def real_token_mask(self) -> torch.Tensor:
        """[b, s] bool in the model layout (before any CP split): True at real tokens."""
        mask = torch.zeros(self.input_ids.shape, dtype=torch.bool)
        if self.packed is not None:
            mask[0, self.packed.packed_index.cpu()] = True
        elif self.spans.length.numel():
            # padded rows hold their real tokens from column 0
            width = mask.shape[1]
            lengths = self.spans.length.cpu()
            mask[: lengths.numel()] = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
        return mask


@dataclass(frozen=True)
class PackedMicroBatch:
    """A micro-batch in the model layout (all CP ranks' tokens): its model inputs, and the per-token data
    its routers take (each None where not asked for)."""

    inputs: ModelInputs
    real_tokens: torch.Tensor | None = None  # [b', s'] bool: True at real tokens (MoE router metrics)
    padding: torch.Tensor | None = None  # [b', s'] bool: True at padding (routing replay routes it fixedly)
    routes: torch.Tensor | None = None  # [b', s', L, k] routes to replay, NO_ROUTE where none


def pack(
    rows: HostRows,
    layout: MicroBatchLayout,
    *,
    pad_token_id: int = 0,
    routes: torch.Tensor | None = None,
    with_routes: bool = False,
    with_real_tokens: bool = False,
) -> PackedMicroBatch:
    """Micro-batch `layout.rows` of the rank's `rows`, laid out as `layout` says.

    `with_real_tokens` adds the real-token mask (MoE router metrics); `with_routes` the padding mask and,
    where `routes` [B, S, L, k] (host columns) are given, the routes to replay.
    """
    index = layout.rows
    sequences, attention_mask = rows.sequences[index], rows.attention_mask[index]
    labels = host_labels(sequences, attention_mask)
    spans = RowSpans(rows.spans.start[index], rows.spans.length[index])
    if layout.packed:
        inputs = _packed_inputs(sequences, attention_mask, labels, spans, layout, pad_token_id)
    else:
        inputs = _padded_inputs(sequences, labels, spans, layout, pad_token_id)
    real = inputs.real_token_mask() if with_real_tokens or with_routes else None
    return PackedMicroBatch(
        inputs,
        real_tokens=real if with_real_tokens else None,
        padding=~real if with_routes else None,
        routes=None if routes is None else inputs.from_host_layout(routes[index], NO_ROUTE),
    )


def _padded_inputs(sequences, labels_in_host_columns, spans, layout, pad_token_id) -> ModelInputs:
    host_columns = sequences.shape[1]
    num_rows, width = layout.shape
    input_ids = torch.full((num_rows, width), pad_token_id, dtype=torch.long)
    labels = torch.full((num_rows, width), IGNORE_LABEL, dtype=torch.long)
    for i, (start, length) in enumerate(zip(spans.start.tolist(), spans.length.tolist())):
        input_ids[i, :length] = sequences[i, start : start + length]
        labels[i, :length] = labels_in_host_columns[i, start : start + length]
    position_ids = torch.arange(width).unsqueeze(0).expand(num_rows, width).contiguous()
    return ModelInputs(input_ids, position_ids, labels, None, spans, host_columns)


def _packed_inputs(sequences, attention_mask, labels_in_host_columns, spans, layout, pad_token_id) -> ModelInputs:
    from megatron.core.packed_seq_params import PackedSeqParams

    host_columns = sequences.shape[1]
    if sequences.shape[0] == 0:
        # an empty micro-batch (padding the count across ranks): one ignored sequence of pad tokens
        total = layout.shape[1]
        cu = torch.tensor([0, total], dtype=torch.int32)
        params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
            cu_seqlens_kv_padded=cu, max_seqlen_q=total, max_seqlen_kv=total,
        )
        ids = torch.full((1, total), pad_token_id, dtype=torch.long)
        return ModelInputs(ids, torch.arange(total).unsqueeze(0), torch.full_like(ids, IGNORE_LABEL), params, spans, host_columns)
    seq_lengths = _sequence_lengths(sequences, attention_mask)
    packed = _pack_tokens(sequences, attention_mask, seq_lengths, layout.packed_lengths, pad_token_id)
    labels = pack_like(labels_in_host_columns, packed, IGNORE_LABEL)
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
    seq_lengths = _sequence_lengths(tokens, attention_mask)
    return _pack_tokens(tokens, attention_mask, seq_lengths, packed_lengths(seq_lengths, parallel, min_tokens), pad_token_id)


def _sequence_lengths(tokens: torch.Tensor, attention_mask: torch.Tensor) -> tuple[int, ...]:
    """Real tokens per row of a padded batch [B, S] that has some."""
    if tokens.dim() != 2 or tokens.shape != attention_mask.shape:
        raise ValueError(
            f"tokens {tuple(tokens.shape)} and attention_mask {tuple(attention_mask.shape)} must both be [B, S]"
        )
    seq_lengths = tuple(int(n) for n in attention_mask.bool().sum(dim=1).tolist())
    if not any(seq_lengths):
        raise ValueError("the batch has no tokens (attention_mask is all zero)")
    return seq_lengths


def _pack_tokens(
    tokens: torch.Tensor,
    attention_mask: torch.Tensor,
    seq_lengths: tuple[int, ...],
    padded: tuple[int, ...] | list[int],
    pad_token_id: int,
) -> PackedBatch:
    """The rows' real tokens laid end to end, row i's `seq_lengths[i]` tokens padded to `padded[i]`."""
    from megatron.core.packed_seq_params import PackedSeqParams

    batch, seq = tokens.shape
    device = tokens.device
    starts = [0]
    for length in padded:
        starts.append(starts[-1] + length)

    padded_index = attention_mask.bool().reshape(-1).nonzero().squeeze(1)  # row-major: sequence by sequence
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
