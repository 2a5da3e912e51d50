"""KV-cached decoding of a left-padded batch with a Hugging Face causal LM (host-free, any device).

One forward per generated token for the whole batch; rows that finish keep stepping on padding. With
an MoE model the routers' top-k choices can be captured per token for routing replay (R3).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from skyrl_megatron.engines.sampling import SamplingSettings, choose_tokens, token_logprobs

STOP = "stop"
LENGTH = "length"
ABORT = "abort"


@dataclass
class Response:
    """One row's generation so far."""

    limit: int  # most tokens this row may generate
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str | None = None  # None while still generating
    routes: list[torch.Tensor] = field(default_factory=list)  # [tokens, L, k] per forward that routed this row
    text_end: int | None = None  # where a matched stop string cuts the decoded text

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None


@dataclass(frozen=True)
class Vocabulary:
    """What decoding needs from the tokenizer and generation config."""

    tokenizer: PreTrainedTokenizerBase
    eos_ids: frozenset[int]
    pad_id: int
    max_positions: int


class Decoder:
    """KV-cached decoding of a left-padded batch with a causal LM; one forward per token for all rows."""

    def __init__(
        self,
        model: torch.nn.Module,
        vocab: Vocabulary,
        settings: SamplingSettings,
        generator: torch.Generator,
        routes: RouteCapture | None = None,
    ):
        self.model = model
        self.device = next(model.parameters()).device
        self.routes = routes
        self.vocab = vocab
        self.settings = settings
        self.generator = generator
        self.stop_ids = set(settings.stop_token_ids) | (set() if settings.ignore_eos else set(vocab.eos_ids))

    def run(self, prompts: list[list[int]], abort: threading.Event) -> list[Response]:
        responses = [Response(limit=self._limit(prompt)) for prompt in prompts]
        input_ids, attention_mask = self._left_pad(prompts)
        # Left padding shifts each row's tokens; positions count real tokens only.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        # Tokens in each row's prompt or output so far, for the repetition penalty.
        seen = torch.zeros(len(prompts), self.model.config.vocab_size, dtype=torch.long, device=self.device)
        seen = seen.scatter_add_(1, input_ids, attention_mask) > 0
        rows = torch.arange(len(prompts), device=self.device)
        cache = None
        for step in range(max(response.limit for response in responses)):
            if abort.is_set():
                self._finish_all(responses, ABORT)
                break
            output = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache = output.past_key_values
            if self.routes is not None:
                self._keep_routes(responses, attention_mask[:, -input_ids.shape[1] :], step)
            logits = output.logits[:, -1, :].float()
            suppressed = sorted(self.stop_ids) if step < self.settings.min_tokens else ()
            tokens = choose_tokens(
                logits, self.settings, seen=seen, suppressed_ids=suppressed, generator=self.generator
            )
            logprobs = token_logprobs(logits, tokens, self.settings.logprob_temperature)
            for response, token, logprob in zip(responses, tokens.tolist(), logprobs.tolist()):
                if not response.finished:
                    self._append(response, token, logprob)
            if all(response.finished for response in responses):
                break
            # Finished rows keep stepping (one batch) on padding; their outputs are ignored.
            live = torch.tensor([not response.finished for response in responses], device=self.device)
            input_ids = torch.where(live, tokens, self.vocab.pad_id).unsqueeze(-1)
            seen[rows, tokens] = True
            attention_mask = torch.cat([attention_mask, torch.ones_like(input_ids)], dim=-1)
            position_ids = position_ids[:, -1:] + 1
        return responses

    def _keep_routes(self, responses: list[Response], new_mask: torch.Tensor, step: int) -> None:
        """The experts this forward chose for each row's new real tokens: the prompt, then each sampled
        token fed back (the last sampled token is never fed, so it has no route)."""
        routes = self.routes.take(tuple(new_mask.shape))  # [b, new, L, k]
        for row, response in enumerate(responses):
            if step == 0:
                response.routes.append(routes[row][new_mask[row].bool()])
            elif not response.finished:  # its input was the token it sampled in the previous step
                response.routes.append(routes[row])

    def _limit(self, prompt: list[int]) -> int:
        room = self.vocab.max_positions - len(prompt)
        if room < 1:
            raise ValueError(
                f"prompt of {len(prompt)} tokens leaves no room within {self.vocab.max_positions} positions"
            )
        return room if self.settings.max_tokens is None else min(room, self.settings.max_tokens)

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(prompt) for prompt in prompts)
        input_ids = torch.full((len(prompts), width), self.vocab.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        return input_ids.to(self.device), attention_mask.to(self.device)

    def _append(self, response: Response, token: int, logprob: float) -> None:
        response.token_ids.append(token)
        response.logprobs.append(logprob)
        if token in self.stop_ids:
            response.stop_reason = STOP
        elif self.settings.stop and self._match_stop_string(response):
            response.stop_reason = STOP
        elif len(response.token_ids) >= response.limit:
            response.stop_reason = LENGTH

    def _match_stop_string(self, response: Response) -> bool:
        # A stop string completed by an earlier token would have finished the row then, so any
        # occurrence found now is new.
        text = self.vocab.tokenizer.decode(response.token_ids, skip_special_tokens=self.settings.skip_special_tokens)
        matches = [(text.find(stop), stop) for stop in self.settings.stop if stop and stop in text]
        if not matches:
            return False
        start, stop = min(matches)
        response.text_end = start + len(stop) if self.settings.include_stop_str_in_output else start
        return True

    @staticmethod
    def _finish_all(responses: list[Response], reason: str) -> None:
        for response in responses:
            if not response.finished:
                response.stop_reason = reason


class RouteCapture:
    """The top-k expert indices a Hugging Face MoE model's routers return, layer by layer (a forward
    hook on each router; Qwen3-MoE's returns (logits, weights, indices))."""

    def __init__(self, model: torch.nn.Module):
        self.routers = [m for m in model.modules() if hasattr(m, "top_k") and hasattr(m, "num_experts") and m is not model]
        if not self.routers:
            raise ValueError("return_routed_experts needs an MoE model; this one has no top-k routers")
        self._last: list[torch.Tensor | None] = [None] * len(self.routers)
        self._handles = [router.register_forward_hook(self._hook(i)) for i, router in enumerate(self.routers)]

    def _hook(self, layer: int):
        def hook(module, args, output) -> None:
            indices = output[-1] if isinstance(output, tuple) else None
            if indices is None or indices.is_floating_point():
                raise TypeError(f"router {type(module).__name__} returns no top-k indices; routes cannot be captured")
            self._last[layer] = indices.detach()

        return hook

    def take(self, shape: tuple[int, int]) -> torch.Tensor:
        """The last forward's routes as [b, new tokens, L, k] for its input of `shape`."""
        per_layer = [indices.reshape(*shape, -1) for indices in self._last]
        self._last = [None] * len(self.routers)
        return torch.stack(per_layer, dim=2)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def compact_routes(routes: list[torch.Tensor]) -> np.ndarray:
    """A row's routes [tokens, L, k] in the smallest of the integer types SkyRL 0.4 carries them in."""
    joined = torch.cat(routes).cpu() if routes else torch.zeros(0, 0, 0, dtype=torch.long)
    top = int(joined.max()) if joined.numel() else 0
    dtype = np.uint8 if top < 2**8 else np.int16 if top < 2**15 else np.int32
    return joined.numpy().astype(dtype)
