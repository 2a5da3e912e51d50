"""The generation engine's core: a Hugging Face causal LM that decodes, takes weight updates and sleeps.

Host-free: each host version puts its own face on it (``cpu_engine.py`` is skyrl-train 0.3.1's engine
interface, ``client.py`` skyrl 0.4's inference client over engine actors). It favours exactness over
speed: a plain KV-cached decode loop (``decoding.py``), sampling under vLLM's parameter names
(``sampling.py``). The development and test engine for machines without vLLM; vLLM stays the
production engine.

Calls are serialised on one lock: a weight update never interleaves with a generation step.
Generation runs in a worker thread so that, as an async Ray actor, the engine still answers
``abort_generation`` while it decodes.

Weight updates arrive with their tensors (``load_weights``; through Ray's object store when the
engine is an actor) or over a broadcast group (``join_weight_broadcast`` + ``receive_broadcast``);
either way every tensor is checked against the model before any is written.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from skyrl_megatron.digests import tensor_sha256
from skyrl_megatron.failures import register_current_worker
from skyrl_megatron.engines.broadcast import BroadcastGroup, BroadcastRendezvous
from skyrl_megatron.engines.checkpoint_names import checkpoint_named_tensors
from skyrl_megatron.engines.decoding import Decoder, RouteCapture, Vocabulary, compact_routes
from skyrl_megatron.engines.lora_merge import AdapterMerge, LoraAdapter
from skyrl_megatron.engines.sampling import SamplingSettings
from skyrl_megatron.engines.weight_updates import TensorAnnouncement, check_update, torch_dtype


ENGINE_ROLE = "HF engine"


class HFEngine:
    """Decoding, weight updates and sleep/wake for one Hugging Face causal LM on one device."""

    def __init__(
        self,
        model_path: str | Path,
        tokenizer: str | Path | PreTrainedTokenizerBase | None = None,
        dtype: str | torch.dtype = "float32",
        seed: int = 0,
        attn_implementation: str = "sdpa",
        return_routed_experts: bool = False,
        device: str | torch.device = "cpu",
        engine_index: int = 0,
        num_engines: int = 1,
    ):
        # as a Ray actor: named in the driver's failure registry, so a death is reported by pid and node
        register_current_worker(ENGINE_ROLE, engine_index, num_engines, coordinates="")
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch_dtype(dtype), attn_implementation=attn_implementation
        ).eval().to(self.device)
        self.model_path = str(model_path)
        # MoE routing replay (R3): each output row's experts per token and layer, as SkyRL 0.4's
        # `rollout_expert_indices` ([prompt + response - 1 tokens, L, k]; see compute/route_replay.py)
        self._routes = RouteCapture(self.model) if return_routed_experts else None
        if not isinstance(tokenizer, PreTrainedTokenizerBase):
            tokenizer = AutoTokenizer.from_pretrained(tokenizer or model_path)
        self.tokenizer = tokenizer
        self._vocab = Vocabulary(
            tokenizer=tokenizer,
            eos_ids=frozenset(self._eos_ids()),
            pad_id=next(i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0) if i is not None),
            max_positions=self.model.config.max_position_embeddings,
        )
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._lock = threading.Lock()
        self._in_flight: set[threading.Event] = set()
        self._broadcast: BroadcastGroup | None = None  # our own weight broadcast group, once joined
        self._adapters = AdapterMerge()  # LoRA adapters merged in, over the base weights they apply to
        self._sleeping = False

    def _eos_ids(self) -> set[int]:
        # generation_config may list several (chat checkpoints end turns with a token of their own)
        configured = self.model.generation_config.eos_token_id
        ids = set(configured) if isinstance(configured, list) else {configured}
        ids.add(self.tokenizer.eos_token_id)
        ids.discard(None)
        return ids

    # -- generation ------------------------------------------------------------------------------

    async def generate(self, input_batch, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Prompts (chat messages) or prompt token ids with vLLM sampling parameters -> responses."""
        if input_batch.get("return_sample_support"):
            raise ValueError("the HF engine does not return sample-support sets; set "
                             "generator.inference_engine.enable_return_sample_support_set=false")
        prompt_token_ids = self._prompt_token_ids(input_batch)
        settings = SamplingSettings.from_request(input_batch.get("sampling_params"))
        route_starts = self._route_starts(input_batch, prompt_token_ids)
        abort = threading.Event()
        self._in_flight.add(abort)
        try:
            return await asyncio.to_thread(self._generate_blocking, prompt_token_ids, settings, abort, route_starts)
        finally:
            self._in_flight.discard(abort)

    def _route_starts(self, input_batch, prompts: list[list[int]]) -> list[int]:
        """Where each row's returned routes begin: skyrl 0.4's multi-turn generator has the earlier turns'
        routes already and asks for the rest (``routed_experts_prompt_starts``); else the first token."""
        starts = input_batch.get("routed_experts_prompt_starts")
        if starts is None:
            return [0] * len(prompts)
        if self._routes is None:
            raise ValueError("routed_experts_prompt_starts given, but this engine was started without "
                             "return_routed_experts (generator.inference_engine.enable_return_routed_experts)")
        starts = [int(start) for start in starts]
        if len(starts) != len(prompts) or any(not 0 <= start <= len(p) for start, p in zip(starts, prompts)):
            raise ValueError(f"routed_experts_prompt_starts {starts} must give one start within each of the {len(prompts)} prompts")
        return starts

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
    def _generate_blocking(
        self, prompts: list[list[int]], settings: SamplingSettings, abort: threading.Event, route_starts: list[int]
    ):
        if self._sleeping:
            raise RuntimeError("generate() on a sleeping engine: wake_up() first")
        generator = self._generator
        if settings.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(settings.seed)
        with self._lock:
            responses = Decoder(self.model, self._vocab, settings, generator, self._routes).run(prompts, abort)
        texts = []
        for response in responses:
            text = self.tokenizer.decode(response.token_ids, skip_special_tokens=settings.skip_special_tokens)
            texts.append(text if response.text_end is None else text[: response.text_end])
        output = {
            "responses": texts,
            "response_ids": [response.token_ids for response in responses],
            "stop_reasons": [response.stop_reason for response in responses],
            "response_logprobs": None if settings.logprobs is None else [response.logprobs for response in responses],
        }
        if self._routes is not None:
            output["rollout_expert_indices"] = [
                compact_routes(response.routes)[start:] for response, start in zip(responses, route_starts)
            ]
        return output

    async def abort_generation(self) -> None:
        """Running and waiting generations return what they have so far, with stop reason "abort"."""
        for abort in list(self._in_flight):
            abort.set()

    # -- weights ---------------------------------------------------------------------------------

    async def load_weights(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        """HF-named full tensors (any device), checked as a whole, then copied in."""
        if not names:
            raise ValueError("weight update must not be empty")
        await asyncio.to_thread(self._load_blocking, list(names), list(tensors))

    @torch.no_grad()
    def _load_blocking(self, names: list[str], tensors: list[torch.Tensor]) -> None:
        with self._lock:
            held = checkpoint_named_tensors(self.model)
            check_update(held, names, tensors)
            for name, tensor in zip(names, tensors):
                held[name].copy_(tensor)

    async def join_weight_broadcast(self, rendezvous: BroadcastRendezvous, rank: int) -> None:
        """Join the trainer's broadcast group as `rank` (>= 1); returns once every member has joined."""
        if rank < 1:
            raise ValueError(f"engines join the weight broadcast as rank 1 or above (0 is the trainer), got {rank}")
        self._broadcast = await asyncio.to_thread(BroadcastGroup, rendezvous, rank)

    async def receive_broadcast(self, announcement: TensorAnnouncement) -> int:
        """Receive the announced tensors from the group's rank 0, then load them; the count loaded.

        Every announced tensor is received before any check: the sender broadcasts them regardless.
        """
        if self._broadcast is None:
            raise RuntimeError("receive_broadcast before join_weight_broadcast")

        def receive() -> list[torch.Tensor]:
            tensors = announcement.empty_tensors(self._broadcast.device)
            for tensor in tensors:
                self._broadcast.broadcast(tensor)
            return tensors

        tensors = await asyncio.to_thread(receive)
        await self.load_weights(list(announcement.names), tensors)
        return len(tensors)

    async def load_adapter(self, lora_path: str) -> None:
        await asyncio.to_thread(self._load_adapter_blocking, lora_path)

    def _load_adapter_blocking(self, lora_path: str) -> None:
        """Serve base + the PEFT adapter at `lora_path`, merged by checkpoint name (``lora_merge``: our own
        merge, not peft's, which drops per-expert adapters on fused experts before peft 0.21),
        replacing any earlier one.

        The base is each weight as it was before the first adapter touched it: with adapter sync the
        trainer never sends base weights, so adapters must not stack.
        """
        adapter = LoraAdapter.read(lora_path)  # read and checked outside the lock: generation goes on
        with self._lock:
            self._adapters.apply(checkpoint_named_tensors(self.model), adapter)

    async def named_weights(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the current weights under HF names (for checks that a sync delivered bitwise)."""
        with self._lock:
            return {name: tensor.detach().to("cpu", copy=True) for name, tensor in checkpoint_named_tensors(self.model).items()}

    async def weight_digests(self, names: list[str] | None = None) -> dict[str, str]:
        """SHA-256 of each held weight (HF names; `names` or all): a sync check that moves digests, not
        the model, out of the engine."""
        with self._lock:
            held = checkpoint_named_tensors(self.model)
            return {name: tensor_sha256(held[name]) for name in (names if names is not None else held)}

    # -- lifecycle -------------------------------------------------------------------------------

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        """On a GPU the weights move to host memory and the cache is emptied, so a colocated trainer
        gets the device back; on CPU there is nothing to give back. Weights are kept either way (unlike
        vLLM's level 2), so a sync after waking is correct but not required."""
        with self._lock:
            if self.device.type == "cuda" and not self._sleeping:
                self.model.to("cpu")
                torch.cuda.empty_cache()
            self._sleeping = True

    async def wake_up(self, *args: Any, **kwargs: Any) -> None:
        with self._lock:
            if self.device.type == "cuda" and self._sleeping:
                self.model.to(self.device)
            self._sleeping = False

    async def is_sleeping(self) -> bool:
        return self._sleeping

    async def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> None:
        pass  # KV caches live for one generate() call only

    async def teardown(self) -> None:
        pass


def start_engine_actors(
    engine_class: type[HFEngine],
    num_engines: int,
    model_path: str | Path,
    *,
    dtype: str = "float32",
    seed: int = 0,
    num_cpus: float = 1,
    tokenizer: str | Path | None = None,
    device: str = "cpu",
    options_for=None,
    **engine_options: Any,
) -> list:
    """`num_engines` async Ray actors of `engine_class` (its methods are coroutines), seeds seed, seed+1, ...;
    on CPU, or each on a GPU of its own unless `options_for(index)` gives Ray other options (placement).
    `engine_options` go to every engine (e.g. ``return_routed_experts``)."""
    import ray

    actor_class = ray.remote(num_cpus=num_cpus, num_gpus=1 if device == "cuda" else 0)(engine_class)
    return [
        actor_class.options(**(options_for(index) if options_for else {})).remote(
            str(model_path), tokenizer=tokenizer, dtype=dtype, seed=seed + index, device=device,
            engine_index=index, num_engines=num_engines, **engine_options,
        )
        for index in range(num_engines)
    ]

