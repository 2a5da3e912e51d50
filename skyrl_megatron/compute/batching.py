"""From the host's padded RL batch to Megatron micro-batches, and per-token results back.

The host hands a worker `sequences` [B, S] whose rows are a left-padded prompt followed by a
right-padded response, with `attention_mask` marking the real tokens (one contiguous run per row),
and per-response tensors [B, A] for the last A columns. Megatron's attention (ours or TE's) is
causal without a padding mask, so the real tokens of a row must start at position 0:

* padded layout: every row is shifted left so its real tokens start at column 0 (trailing padding
  is harmless under a causal mask: no real token attends to it);
* packed layout (THD): the real tokens of all rows are concatenated into one row, with
  `PackedSeqParams` marking the boundaries; no compute is spent on padding.

Either way the model's per-token outputs are mapped back to the host's [B, S] columns, and the
response values are the columns predicting the last A tokens. Which rows go together is decided by
:func:`plan_micro_batches`: a fixed number of rows, or a token budget.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from skyrl_megatron.compute.packing import (
    PackedBatch,
    pack_padded_batch,
    packed_lengths,
    packing_alignment,
    round_up,
    unpack_to_padded,
)
from skyrl_megatron.parallel import ParallelConfig

IGNORE_LABEL = -100


@dataclass(frozen=True)
class RowSpans:
    """Where each row's real tokens are: columns [start, start + length) of the host's [B, S] layout."""

    start: torch.Tensor  # [B] int64
    length: torch.Tensor  # [B] int64

    @classmethod
    def from_attention_mask(cls, attention_mask: torch.Tensor) -> "RowSpans":
        mask = attention_mask.bool()
        length = mask.sum(-1)
        # the first real column; rows without any real token start at 0 with length 0
        start = torch.where(length > 0, mask.int().argmax(-1), torch.zeros_like(length))
        columns = torch.arange(mask.shape[1]).unsqueeze(0)
        contiguous = mask == ((columns >= start.unsqueeze(1)) & (columns < (start + length).unsqueeze(1)))
        if not bool(contiguous.all()):
            raise ValueError(
                "attention_mask rows must mark one contiguous run of real tokens (left-padded prompt, "
                "right-padded response); got a row with a gap"
            )
        return cls(start=start.long(), length=length.long())


@dataclass(frozen=True)
class PackingSettings:
    """How rows become model inputs: padded or packed, for the TP/SP/CP sizes that constrain lengths.

    Under context parallelism every sequence is cut into 2 x CP equal chunks, and under sequence
    parallelism each CP rank's share must divide among the TP ranks (see compute/packing.py).
    """

    packed: bool = False
    tensor: int = 1
    sequence_parallel: bool = False
    context: int = 1

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(tensor=self.tensor, context=self.context, sequence_parallel=self.sequence_parallel)

    @property
    def row_align(self) -> int:
        """Multiple for a padded row's length (and a packed row's total length)."""
        return packing_alignment(self.parallel)[1]


@dataclass
class ModelInputs:
    """One micro-batch as the model consumes it, and how to map its per-token outputs back."""

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
        start, length = self.spans.start.to(device), self.spans.length.to(device)
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
        out[model_index.to(device)] = per_token.reshape(-1, *features)[host_index.to(device)]
        return out.reshape(*self.input_ids.shape, *features)

    def to_host_layout(self, per_token: torch.Tensor, fill_value) -> torch.Tensor:
        """[b', s', ...] in the model layout -> [b, S, ...] in the host's columns; `fill_value` at padding."""
        model_index, host_index = self.real_token_positions()
        features = per_token.shape[2:]
        out = per_token.new_full((self.spans.length.numel() * self.host_columns, *features), fill_value)
        device = per_token.device
        out[host_index.to(device)] = per_token.reshape(-1, *features)[model_index.to(device)]
        return out.reshape(self.spans.length.numel(), self.host_columns, *features)


def _host_labels(sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, S] next-token labels in the host's columns: the following token where it is real."""
    labels = torch.full_like(sequences, IGNORE_LABEL)
    follows = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
    labels[:, :-1] = torch.where(follows, sequences[:, 1:], labels[:, :-1])
    return labels


def build_model_inputs(
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    settings: PackingSettings,
    *,
    pad_token_id: int = 0,
    padded_shape: tuple[int, int] | None = None,
) -> ModelInputs:
    """Model inputs for rows `sequences` [b, S] with their `attention_mask`.

    `padded_shape` forces the model-side shape ([rows, columns] for padded, [1, tokens] for packed):
    pipeline stages exchange fixed-shape activations, so every micro-batch of one schedule call is
    given the same shape.
    """
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
    host_labels = _host_labels(sequences, attention_mask)
    for i, (start, length) in enumerate(zip(spans.start.tolist(), spans.length.tolist())):
        input_ids[i, :length] = sequences[i, start : start + length]
        labels[i, :length] = host_labels[i, start : start + length]
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
        _host_labels(sequences, attention_mask), attention_mask, settings.parallel, IGNORE_LABEL, min_tokens=min_tokens
    ).tokens
    return ModelInputs(packed.tokens, packed.position_ids, labels, packed.packed_seq_params, spans, host_columns, packed)


def model_shape(group_lengths: list[list[int]], settings: PackingSettings) -> tuple[int, int]:
    """The smallest model-side shape (rows, columns) that holds every micro-batch, whose rows have
    `group_lengths` real tokens each; computed from the lengths, without building the inputs."""
    groups = [lengths for lengths in group_lengths if lengths]
    if not groups:
        return 1, settings.row_align
    if settings.packed:
        return 1, max(sum(packed_lengths(lengths, settings.parallel)) for lengths in groups)
    widest = max(max(lengths) for lengths in groups)
    return max(len(lengths) for lengths in groups), round_up(max(widest, 1), settings.row_align)


@dataclass(frozen=True)
class MicroBatchPlan:
    """Which local rows form each micro-batch (indices into the rank's batch), in order."""

    groups: list[torch.Tensor] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.groups)


def plan_micro_batches(
    lengths: torch.Tensor,
    *,
    micro_batch_size: int | None = None,
    max_tokens: int | None = None,
) -> MicroBatchPlan:
    """Split rows (with `lengths` real tokens each) into micro-batches.

    Without `max_tokens`, every `micro_batch_size` consecutive rows form one. With `max_tokens`,
    rows are packed first-fit-decreasing: longest first, each into the first micro-batch with room
    for it (a row longer than the budget gets one of its own). RL batches have long-tailed lengths;
    taking rows in order leaves many micro-batches part-empty, and fewer, fuller micro-batches mean
    fewer kernel launches and less padding where micro-batches must share a shape. Results map
    back through each micro-batch's row indices, so the order is free.
    """
    n = lengths.numel()
    if max_tokens is None:
        if not micro_batch_size or micro_batch_size < 1:
            raise ValueError("plan_micro_batches needs micro_batch_size >= 1 or max_tokens")
        return MicroBatchPlan([torch.arange(i, min(i + micro_batch_size, n)) for i in range(0, n, micro_batch_size)])
    if max_tokens < 1:
        raise ValueError(f"max_tokens_per_microbatch must be >= 1, got {max_tokens}")
    bins: list[list[int]] = []
    room: list[int] = []
    longest_first = sorted(range(n), key=lambda i: (-int(lengths[i]), i))  # ties by index: deterministic
    for i in longest_first:
        length = int(lengths[i])
        slot = next((b for b, free in enumerate(room) if length <= free), None)
        if slot is None:
            bins.append([i])
            room.append(max_tokens - length)
        else:
            bins[slot].append(i)
            room[slot] -= length
    return MicroBatchPlan([torch.tensor(sorted(rows)) for rows in bins])


def pad_plan(plan: MicroBatchPlan, num_micro_batches: int) -> MicroBatchPlan:
    """Append empty micro-batches up to `num_micro_batches` (ranks that share expert or pipeline
    collectives must run the same number of forward passes)."""
    empty = torch.zeros(0, dtype=torch.long)
    return MicroBatchPlan(list(plan.groups) + [empty] * (num_micro_batches - len(plan.groups)))
