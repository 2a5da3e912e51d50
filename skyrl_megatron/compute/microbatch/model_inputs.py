"""What the micro-batch steps hand on: `ModelInputs` (with the maps between the host's [B, S] columns and
the model layout: padded rows from column 0, or one packed THD row, `PackedBatch`) and the finished
`MicroBatch`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from skyrl_megatron.compute.logprobs import LogprobTargets
from skyrl_megatron.compute.microbatch.rows import RowSpans
from skyrl_megatron.compute.route_replay import RouteTargets
from skyrl_megatron.model.layers.context_parallel_layout import ContextParallelSplit

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams


@dataclass(frozen=True)
class PackedBatch:
    """A padded batch packed into one THD row (`inputs.pack_padded_batch`), and what is needed to map
    outputs back."""

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
    out[packed.padded_index] = packed_output[0, packed.packed_index]
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


@dataclass
class MicroBatch:
    """One micro-batch, ready for the model call."""

    inputs: ModelInputs  # global (all CP ranks' tokens), for mapping outputs back
    model_input_ids: torch.Tensor  # this CP rank's share of the tokens, on the device
    model_position_ids: torch.Tensor
    targets: LogprobTargets  # this CP rank's share, on the device
    rows: torch.Tensor  # indices into the rank's batch
    response: dict[str, torch.Tensor]  # [rows, A] slices of the response tensors
    cp_split: ContextParallelSplit | None = None
    real_tokens: torch.Tensor | None = None  # this CP rank's [b, s] real-token mask, for router metrics
    routes: RouteTargets | None = None  # MoE routes to replay or record, in the routers' token order
    recorded: dict[int, torch.Tensor] | None = None  # routes recorded by this rank's routers {layer: [tokens, k]}
