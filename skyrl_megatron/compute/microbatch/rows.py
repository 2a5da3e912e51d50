"""Step 1, rows: where each of the host's rows holds its real tokens, and its next-token labels.

The host hands a worker `sequences` [B, S] whose rows are a left-padded prompt followed by a
right-padded response, with `attention_mask` marking the real tokens (one contiguous run per row),
and per-response tensors [B, A] for the last A columns. Megatron's attention (ours or TE's) is
causal without a padding mask, so the later steps move each row's real tokens to position 0.
The spans are found once for the rank's whole batch (the plan needs every row's length); the labels
(`host_labels`) per micro-batch, for its rows only, so that only the first micro-batch's share stands
before the first kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
class HostRows:
    """The rank's rows in the host's [B, S] columns, with their real-token spans."""

    sequences: torch.Tensor  # [B, S]
    attention_mask: torch.Tensor  # [B, S]
    spans: RowSpans

    @classmethod
    def from_batch(cls, sequences: torch.Tensor, attention_mask: torch.Tensor) -> "HostRows":
        return cls(sequences, attention_mask, RowSpans.from_attention_mask(attention_mask))


def host_labels(sequences: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, S] next-token labels in the host's columns: the following token where it is real."""
    labels = torch.full_like(sequences, IGNORE_LABEL)
    follows = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
    labels[:, :-1] = torch.where(follows, sequences[:, 1:], labels[:, :-1])
    return labels
