"""A CPU inference engine for skyrl-train: a Hugging Face causal LM behind the host's engine interface.

The host generates rollouts through vLLM or SGLang, both GPU-only. This engine lets the whole RL loop
(rollouts, logprobs, weight sync from our Megatron workers) run where neither exists: CI machines,
laptops, CPU-only test boxes. It favours exactness over speed: a plain KV-cached decode loop over the
HF model, one forward per generated token for the whole (left-padded) batch.

Sampling follows the vLLM parameter names the host sends (``inference_engines/utils.py``
``get_vllm_sampling_params``): temperature (0 = greedy), top_k (-1 or 0 = off), top_p, min_p,
repetition_penalty, max_tokens, min_tokens, stop, stop_token_ids, ignore_eos, logprobs, seed. A key
this engine does not know is rejected rather than silently ignored.

Logprobs are ``log_softmax(logits / T)`` of the chosen token from the raw model logits (``T = 1`` for
greedy): the definition the trainer uses for ``action_log_probs``, so with equal weights and dtype the
two agree to rounding. Sampling filters (top-k/p, min-p, penalties, min_tokens) shape the sampling
distribution only, as in vLLM's default ``raw_logprobs`` mode.

With ``return_routed_experts=True`` (an MoE model) the output also carries
``rollout_expert_indices``: per row, the top-k experts its tokens were routed to in every MoE layer,
[prompt + response - 1 tokens, L, k] as SkyRL 0.4 names and shapes them (the last sampled token is
never fed back, so it has none), captured from the HF routers' own top-k. MoE routing replay R3
replays them in scoring and training (``compute/route_replay.py``).

Weight updates arrive two ways, both validated before anything is written:

* through the host's own broadcast strategy over gloo (``generator.weight_sync_backend=gloo``): the
  trainer's rank 0 joins a process group with the engines and sends one
  ``BroadcastWeightUpdateRequest`` (metadata) per tensor, then broadcasts the tensor. This is what
  the trainer uses, so the CPU run exercises the host's real sender;
* inside the request (:class:`NamedTensorsUpdateRequest`): with the engine as a Ray actor the tensors
  travel through Ray's object store, no process group needed (tools and tests).
"""

from __future__ import annotations

import asyncio
import difflib
import math
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from skyrl_megatron import host_api

# vLLM treats temperatures below this as greedy decoding.
_GREEDY_TEMPERATURE = 1e-5

# How the host spells max_tokens: vLLM's name, the config's max_generate_length, OpenAI's max_completion_tokens.
_MAX_TOKENS_KEYS = ("max_tokens", "max_generate_length", "max_completion_tokens")

STOP = "stop"
LENGTH = "length"
ABORT = "abort"


# ----------------------------------------------------------------------------------------------
# Sampling parameters
# ----------------------------------------------------------------------------------------------


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
            raise ValueError(f"sampling parameter(s) not supported by CpuInferenceEngine: {', '.join(unknown)}")
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


# ----------------------------------------------------------------------------------------------
# Token choice
# ----------------------------------------------------------------------------------------------


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
        logits = logits.index_fill(-1, torch.tensor(list(suppressed_ids)), -math.inf)
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


# ----------------------------------------------------------------------------------------------
# Decoding
# ----------------------------------------------------------------------------------------------


@dataclass
class _Response:
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
class _Vocabulary:
    """What decoding needs from the tokenizer and generation config."""

    tokenizer: PreTrainedTokenizerBase
    eos_ids: frozenset[int]
    pad_id: int
    max_positions: int


class _Decoder:
    """KV-cached decoding of a left-padded batch with a causal LM; one forward per token for all rows."""

    def __init__(
        self,
        model: torch.nn.Module,
        vocab: _Vocabulary,
        settings: SamplingSettings,
        generator: torch.Generator,
        routes: _RouteCapture | None = None,
    ):
        self.model = model
        self.routes = routes
        self.vocab = vocab
        self.settings = settings
        self.generator = generator
        self.stop_ids = set(settings.stop_token_ids) | (set() if settings.ignore_eos else set(vocab.eos_ids))

    def run(self, prompts: list[list[int]], abort: threading.Event) -> list[_Response]:
        responses = [_Response(limit=self._limit(prompt)) for prompt in prompts]
        input_ids, attention_mask = self._left_pad(prompts)
        # Left padding shifts each row's tokens; positions count real tokens only.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        # Tokens in each row's prompt or output so far, for the repetition penalty.
        seen = torch.zeros(len(prompts), self.model.config.vocab_size, dtype=torch.long)
        seen = seen.scatter_add_(1, input_ids, attention_mask) > 0
        rows = torch.arange(len(prompts))
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
            live = torch.tensor([not response.finished for response in responses])
            input_ids = torch.where(live, tokens, self.vocab.pad_id).unsqueeze(-1)
            seen[rows, tokens] = True
            attention_mask = torch.cat([attention_mask, torch.ones_like(input_ids)], dim=-1)
            position_ids = position_ids[:, -1:] + 1
        return responses

    def _keep_routes(self, responses: list[_Response], new_mask: torch.Tensor, step: int) -> None:
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
        return input_ids, attention_mask

    def _append(self, response: _Response, token: int, logprob: float) -> None:
        response.token_ids.append(token)
        response.logprobs.append(logprob)
        if token in self.stop_ids:
            response.stop_reason = STOP
        elif self.settings.stop and self._match_stop_string(response):
            response.stop_reason = STOP
        elif len(response.token_ids) >= response.limit:
            response.stop_reason = LENGTH

    def _match_stop_string(self, response: _Response) -> bool:
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
    def _finish_all(responses: list[_Response], reason: str) -> None:
        for response in responses:
            if not response.finished:
                response.stop_reason = reason


class _RouteCapture:
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


def _compact(routes: list[torch.Tensor]) -> np.ndarray:
    """A row's routes [tokens, L, k] in the smallest of the integer types SkyRL 0.4 carries them in."""
    joined = torch.cat(routes) if routes else torch.zeros(0, 0, 0, dtype=torch.long)
    top = int(joined.max()) if joined.numel() else 0
    dtype = np.uint8 if top < 2**8 else np.int16 if top < 2**15 else np.int32
    return joined.numpy().astype(dtype)


# ----------------------------------------------------------------------------------------------
# Weight updates
# ----------------------------------------------------------------------------------------------


@dataclass
class NamedTensorsUpdateRequest(host_api.weight_update_request_base()):
    """A weight update that carries its full HF-named tensors (the host's requests carry metadata only).

    Built from any (names, dtypes, shapes, tensors) bundle: our exporter's ``WeightBucket`` or the host's
    ``WeightChunk``. Pickles with its tensors, so Ray moves it to an engine actor through the object store.
    """

    tensors: list[torch.Tensor]

    def __post_init__(self):
        super().__post_init__()
        if len(self.tensors) != len(self.names):
            raise ValueError(f"{len(self.names)} names but {len(self.tensors)} tensors")
        for name, dtype, shape, tensor in zip(self.names, self.dtypes, self.shapes, self.tensors):
            if str(tensor.dtype) != dtype or list(tensor.shape) != list(shape):
                raise ValueError(
                    f"{name}: declared {dtype} {list(shape)}, tensor is {tensor.dtype} {list(tensor.shape)}"
                )

    @classmethod
    def from_chunk(cls, chunk: Any) -> NamedTensorsUpdateRequest:
        return cls(
            names=list(chunk.names),
            dtypes=list(chunk.dtypes),
            shapes=[list(shape) for shape in chunk.shapes],
            tensors=list(chunk.tensors),
        )

    @classmethod
    def of(cls, named_tensors: Mapping[str, torch.Tensor]) -> NamedTensorsUpdateRequest:
        return cls(
            names=list(named_tensors),
            dtypes=[str(t.dtype) for t in named_tensors.values()],
            shapes=[list(t.shape) for t in named_tensors.values()],
            tensors=list(named_tensors.values()),
        )


def _check_update(parameters: Mapping[str, torch.Tensor], request: NamedTensorsUpdateRequest) -> None:
    """Every problem with the request at once, before anything is written (all or nothing)."""
    problems = []
    for name, tensor in zip(request.names, request.tensors):
        target = parameters.get(name)
        if target is None:
            close = difflib.get_close_matches(name, parameters, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            problems.append(f"{name}: not a parameter of this model{hint}")
        elif target.shape != tensor.shape:
            problems.append(f"{name}: shape {list(tensor.shape)}, model has {list(target.shape)}")
        elif target.dtype != tensor.dtype:
            problems.append(f"{name}: dtype {tensor.dtype}, model has {target.dtype} (export in the engine's dtype)")
    if problems:
        raise ValueError("weight update rejected, nothing was loaded:\n  " + "\n  ".join(problems))


# ----------------------------------------------------------------------------------------------
# The engine
# ----------------------------------------------------------------------------------------------


def _torch_dtype(name: str | torch.dtype) -> torch.dtype:
    dtype = name if isinstance(name, torch.dtype) else getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must name a floating-point torch dtype (float32, bfloat16, ...), got {name!r}")
    return dtype


class CpuInferenceEngine(host_api.inference_engine_interface()):
    """The host's InferenceEngineInterface over a Hugging Face causal LM on CPU.

    Calls are serialised on one lock: a weight update never interleaves with a generation step.
    Generation runs in a worker thread so that, as an async Ray actor, the engine still answers
    ``abort_generation`` while it decodes.
    """

    def __init__(
        self,
        model_path: str | Path,
        tokenizer: str | Path | PreTrainedTokenizerBase | None = None,
        dtype: str | torch.dtype = "float32",
        seed: int = 0,
        attn_implementation: str = "sdpa",
        return_routed_experts: bool = False,
    ):
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=_torch_dtype(dtype), attn_implementation=attn_implementation
        ).eval()
        # MoE routing replay (R3): each output row's experts per token and layer, as SkyRL 0.4's
        # `rollout_expert_indices` ([prompt + response - 1 tokens, L, k]; see compute/route_replay.py)
        self._routes = _RouteCapture(self.model) if return_routed_experts else None
        if not isinstance(tokenizer, PreTrainedTokenizerBase):
            tokenizer = AutoTokenizer.from_pretrained(tokenizer or model_path)
        self.tokenizer = tokenizer
        self._vocab = _Vocabulary(
            tokenizer=tokenizer,
            eos_ids=frozenset(self._eos_ids()),
            pad_id=next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None),
            max_positions=self.model.config.max_position_embeddings,
        )
        self._generator = torch.Generator().manual_seed(seed)
        # Tied weights appear under each of their names, as an exporter may send either.
        self._parameters = dict(self.model.named_parameters(remove_duplicate=False))
        self._lock = threading.Lock()
        self._in_flight: set[threading.Event] = set()
        self._broadcast_group = None  # the host's weight-broadcast process group, once joined
        self._base_model = None  # the weights LoRA adapters apply to, kept at the first adapter load

    def _eos_ids(self) -> set[int]:
        # generation_config may list several (chat checkpoints end turns with a token of their own)
        configured = self.model.generation_config.eos_token_id
        ids = set(configured) if isinstance(configured, list) else {configured}
        ids.add(self.tokenizer.eos_token_id)
        ids.discard(None)
        return ids

    # -- generation ------------------------------------------------------------------------------

    async def generate(self, input_batch):
        """The host's InferenceEngineInput (prompts or prompt_token_ids, sampling_params) -> InferenceEngineOutput."""
        prompt_token_ids = self._prompt_token_ids(input_batch)
        settings = SamplingSettings.from_request(input_batch.get("sampling_params"))
        abort = threading.Event()
        self._in_flight.add(abort)
        try:
            return await asyncio.to_thread(self._generate_blocking, prompt_token_ids, settings, abort)
        finally:
            self._in_flight.discard(abort)

    def _prompt_token_ids(self, input_batch) -> list[list[int]]:
        prompts, prompt_token_ids = input_batch.get("prompts"), input_batch.get("prompt_token_ids")
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of `prompts` and `prompt_token_ids`")
        if prompt_token_ids is None:
            prompt_token_ids = self.tokenizer.apply_chat_template(
                prompts, add_generation_prompt=True, add_special_tokens=False, return_dict=True, tokenize=True
            )["input_ids"]
        if not prompt_token_ids:
            raise ValueError("generate() needs at least one prompt")
        if not all(prompt_token_ids):
            raise ValueError("every prompt needs at least one token")
        return [list(prompt) for prompt in prompt_token_ids]

    @torch.no_grad()
    def _generate_blocking(self, prompts: list[list[int]], settings: SamplingSettings, abort: threading.Event):
        generator = self._generator if settings.seed is None else torch.Generator().manual_seed(settings.seed)
        with self._lock:
            responses = _Decoder(self.model, self._vocab, settings, generator, self._routes).run(prompts, abort)
        texts = []
        for response in responses:
            text = self.tokenizer.decode(response.token_ids, skip_special_tokens=settings.skip_special_tokens)
            texts.append(text if response.text_end is None else text[: response.text_end])
        return {
            "responses": texts,
            "response_ids": [response.token_ids for response in responses],
            "stop_reasons": [response.stop_reason for response in responses],
            "response_logprobs": None if settings.logprobs is None else [response.logprobs for response in responses],
            **({"rollout_expert_indices": [_compact(r.routes) for r in responses]} if self._routes is not None else {}),
        }

    async def abort_generation(self) -> None:
        """Running and waiting generations return what they have so far, with stop reason "abort"."""
        for abort in list(self._in_flight):
            abort.set()

    async def chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError("CpuInferenceEngine serves generate() only, not the OpenAI /chat/completions API")

    async def completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError("CpuInferenceEngine serves generate() only, not the OpenAI /completions API")

    # -- weights -------------------------------------------------------------------------------

    async def init_weight_update_communicator(self, init_info) -> None:
        """Join the host's broadcast group (gloo) as rank ``init_info.rank_offset``; the trainer's rank 0 is 0."""
        broadcast_info = host_api.broadcast_init_info_class()
        if not isinstance(init_info, broadcast_info) or init_info.backend != "gloo":
            raise ValueError(
                f"CpuInferenceEngine receives weights over gloo broadcast only, got {type(init_info).__name__}"
                f"{'' if not isinstance(init_info, broadcast_info) else f' with backend {init_info.backend!r}'}: "
                "set generator.weight_sync_backend=gloo and trainer.placement.colocate_all=false"
            )
        if self._broadcast_group is not None and not init_info.override_existing_receiver:
            return
        self._broadcast_dtype = _torch_dtype(init_info.model_dtype_str)
        self._broadcast_group = await asyncio.to_thread(host_api.join_weight_broadcast_group, init_info)

    async def update_named_weights(self, request) -> None:
        if isinstance(request, host_api.lora_load_request_class()):
            await asyncio.to_thread(self._load_adapter_blocking, request.lora_path)
            return
        if not len(request):
            raise ValueError("weight update request must not be empty")
        if isinstance(request, host_api.broadcast_update_request_class()):
            request = await asyncio.to_thread(self._receive_broadcast, request)
        elif not isinstance(request, NamedTensorsUpdateRequest):
            raise TypeError(
                f"CpuInferenceEngine takes NamedTensorsUpdateRequest (tensors inside) or the host's "
                f"BroadcastWeightUpdateRequest (after init_weight_update_communicator), got {type(request).__name__}"
            )
        await asyncio.to_thread(self._load_blocking, request)

    def _receive_broadcast(self, request) -> NamedTensorsUpdateRequest:
        """Every announced tensor is received before any check: the sender broadcasts them regardless."""
        if self._broadcast_group is None:
            raise RuntimeError("broadcast weight update before init_weight_update_communicator")
        tensors = []
        for dtype, shape in zip(request.dtypes, request.shapes):
            tensor = torch.empty(list(shape), dtype=_torch_dtype(dtype))
            torch.distributed.broadcast(tensor, 0, group=self._broadcast_group)
            tensors.append(tensor)
        return NamedTensorsUpdateRequest(
            names=list(request.names),
            dtypes=[str(t.dtype) for t in tensors],
            shapes=[list(t.shape) for t in tensors],
            tensors=tensors,
        )

    @torch.no_grad()
    def _load_blocking(self, request: NamedTensorsUpdateRequest) -> None:
        _check_update(self._parameters, request)
        with self._lock:
            for name, tensor in zip(request.names, request.tensors):
                self._parameters[name].copy_(tensor)

    @torch.no_grad()
    def _load_adapter_blocking(self, lora_path: str) -> None:
        """Serve base + the PEFT adapter at `lora_path`, merged (peft's own merge), replacing any earlier one.

        The base is the model as it was before the first adapter arrived: with adapter sync the
        trainer never sends base weights, so adapters must not stack.
        """
        import copy

        from peft import PeftModel

        if self._base_model is None:
            self._base_model = copy.deepcopy(self.model)
        merged = PeftModel.from_pretrained(copy.deepcopy(self._base_model), lora_path).merge_and_unload()
        with self._lock:
            self.model.load_state_dict(merged.state_dict())

    async def named_weights(self) -> dict[str, torch.Tensor]:
        """A copy of the current weights under HF names (for checks that a sync delivered bitwise)."""
        with self._lock:
            return {name: tensor.detach().clone() for name, tensor in self.model.state_dict().items()}

    # -- lifecycle: the model lives in host memory, next to nothing the trainer needs back ----------

    async def wake_up(self, *args: Any, **kwargs: Any) -> None:
        pass

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        # Weights are kept (unlike vLLM's level 2), so a sync after waking is correct but not required.
        pass

    async def reset_prefix_cache(self) -> None:
        pass  # KV caches live for one generate() call only

    async def teardown(self) -> None:
        pass

    def tp_size(self) -> int:
        return 1

    def pp_size(self) -> int:
        return 1

    def dp_size(self) -> int:
        return 1


# ----------------------------------------------------------------------------------------------
# Ray
# ----------------------------------------------------------------------------------------------


def cpu_engine_actor_class(num_cpus: float = 1):
    """``ray.remote(CpuInferenceEngine)``: an async actor (its engine methods are coroutines)."""
    import ray

    return ray.remote(num_cpus=num_cpus)(CpuInferenceEngine)


def create_ray_wrapped_cpu_engines(
    num_engines: int,
    model_path: str | Path,
    *,
    dtype: str = "float32",
    seed: int = 0,
    num_cpus: float = 1,
    tokenizer: str | Path | None = None,
) -> list:
    """Engine actors wrapped as the host holds its own (``RayWrappedInferenceEngine``); seeds seed, seed+1, ..."""
    actor_class = cpu_engine_actor_class(num_cpus)
    return [
        host_api.ray_wrapped_inference_engine(
            actor_class.remote(str(model_path), tokenizer=tokenizer, dtype=dtype, seed=seed + index)
        )
        for index in range(num_engines)
    ]
