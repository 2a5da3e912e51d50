"""Synthetic RL batches shaped like the host's `TrainingInputBatch`, for worker tests and benchmarks.

Rows are a left-padded prompt followed by a right-padded response, with varied lengths so that
padding, packing and token budgets are all exercised.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def make_rl_batch(
    rows: int,
    prompt_length: int,
    response_length: int,
    *,
    vocab_size: int = 256,
    seed: int = 0,
    pad_token_id: int = 0,
) -> dict[str, torch.Tensor]:
    """`sequences`, `attention_mask` [rows, P + A] and [rows, A] `loss_mask`, `advantages`,
    `rollout_logprobs`; each row has its own prompt and response lengths (at least one token each)."""
    g = torch.Generator().manual_seed(seed)
    total = prompt_length + response_length
    sequences = torch.randint(1, vocab_size, (rows, total), generator=g)
    attention_mask = torch.ones(rows, total, dtype=torch.long)
    for i in range(rows):
        left_pad = int(torch.randint(0, prompt_length, (1,), generator=g))
        right_pad = int(torch.randint(0, response_length, (1,), generator=g))
        attention_mask[i, :left_pad] = 0
        if right_pad:
            attention_mask[i, total - right_pad :] = 0
    sequences = sequences.masked_fill(attention_mask == 0, pad_token_id)
    loss_mask = attention_mask[:, prompt_length:].clone()
    advantages = torch.randn(rows, 1, generator=g).expand(rows, response_length) * loss_mask
    return {
        "sequences": sequences,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "advantages": advantages.contiguous(),
        "rollout_logprobs": -torch.rand(rows, response_length, generator=g) * loss_mask,
    }


def perturb_logprobs(logprobs: torch.Tensor, loss_mask: torch.Tensor, scale: float, seed: int = 0) -> torch.Tensor:
    """`logprobs` moved by seeded noise on the response tokens: "old" logprobs that differ from the
    current policy's, so ratios leave 1 and clipping engages."""
    if scale == 0:
        return logprobs
    noise = torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(seed)) * scale
    return logprobs + noise * loss_mask


def padded_token_rows(lengths: Sequence[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows of random token ids in [1, 256), one row per length, and their attention mask."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(tokens)
    for i, n in enumerate(lengths):
        tokens[i, :n] = torch.randint(1, 256, (n,), generator=generator)
        mask[i, :n] = 1
    return tokens, mask
