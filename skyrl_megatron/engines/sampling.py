"""Sampling parameters under vLLM's names, and the choice of each next token (host-free).

Sampling follows the vLLM parameter names the hosts send: temperature (0 = greedy), top_k (-1 or 0 =
off), top_p, min_p, repetition_penalty, max_tokens, min_tokens, stop, stop_token_ids, ignore_eos,
logprobs, seed. A key the engine does not know is rejected rather than silently ignored.

Logprobs are ``log_softmax(logits / T)`` of the chosen token from the raw model logits (``T = 1`` for
greedy): the definition the trainer uses for ``action_log_probs``. Sampling filters (top-k/p, min-p,
penalties, min_tokens) shape the sampling distribution only, as in vLLM's default ``raw_logprobs`` mode.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# vLLM treats temperatures below this as greedy decoding.
_GREEDY_TEMPERATURE = 1e-5

# How the host spells max_tokens: vLLM's name, the config's max_generate_length, OpenAI's max_completion_tokens.
_MAX_TOKENS_KEYS = ("max_tokens", "max_generate_length", "max_completion_tokens")

@dataclass(frozen=True)
class SamplingSettings:
    """One request's sampling parameters, under vLLM's names and defaults."""

    max_tokens: int | None = None  # None: up to the model's max_position_embeddings
    min_tokens: int = 0  # EOS and stop tokens are suppressed until this many tokens exist
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: no logprobs; any int: the chosen token's logprob
    seed: int | None = None  # a per-request generator instead of the engine's own stream

    @classmethod
    def from_request(cls, params: Mapping[str, Any] | None) -> SamplingSettings:
        """From the host's sampling-params dict; unset parameters arrive as None and take the defaults."""
        params = {key: value for key, value in (params or {}).items() if value is not None}
        limits = {key: params.pop(key) for key in _MAX_TOKENS_KEYS if key in params}
        if len(set(limits.values())) > 1:
            raise ValueError(f"conflicting token limits {limits}; give one of them")
        if limits:
            params["max_tokens"] = next(iter(limits.values()))
        n = params.pop("n", 1)
        if n != 1:
            raise ValueError(f"n={n} is not supported: send each prompt n times (the host's generator does)")
        unknown = sorted(set(params) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"sampling parameter(s) not supported by the HF engine: {', '.join(unknown)}")
        for key in ("stop", "stop_token_ids"):
            if key in params:
                value = params[key]
                params[key] = (value,) if isinstance(value, (str, int)) else tuple(value)
        return cls(**params)

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the reported logprobs: the sampling one, or 1 for greedy decoding."""
        return 1.0 if self.greedy else self.temperature


def _apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL-style penalty on every token already in the prompt or the output (vLLM's definition)."""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def _filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth_best = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_best, -math.inf)


def _filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches p (always at least one)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted = mass_before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, -math.inf)


def _filter_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, -math.inf)


def choose_tokens(
    logits: torch.Tensor,
    settings: SamplingSettings,
    *,
    seen: torch.Tensor,
    suppressed_ids: Sequence[int],
    generator: torch.Generator,
) -> torch.Tensor:
    """The next token of each row, [B], from raw fp32 logits [B, V]."""
    if settings.repetition_penalty != 1.0:
        logits = _apply_repetition_penalty(logits, seen, settings.repetition_penalty)
    if suppressed_ids:
        logits = logits.index_fill(-1, torch.tensor(list(suppressed_ids), device=logits.device), -math.inf)
    if settings.greedy:
        return logits.argmax(dim=-1)
    logits = logits / settings.temperature
    logits = _filter_top_k(logits, settings.top_k)
    logits = _filter_top_p(logits, settings.top_p)
    logits = _filter_min_p(logits, settings.min_p)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T)[token] per row: the trainer's logprob definition."""
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
