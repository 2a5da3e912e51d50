"""skyrl 0.4's face on the HF engine: an inference client over engine actors.

skyrl 0.4's trainer and generators talk to one ``InferenceEngineInterface`` client (for vLLM, HTTP to
its servers). ``generator.engine=cpu`` gives them this one instead: the same calls, served by
``hf_engine.HFEngine`` Ray actors. Weight sync goes over a broadcast group of our own
(``broadcast.py``): the policy's rank 0 meets the engines through :meth:`EngineClient.join_weight_broadcast`
and sends each bucket after announcing it (:meth:`EngineClient.receive_broadcast`).

The client is pickled to the policy's workers (the host ships it in ``init_weight_sync_state``): it
carries actor handles and plain values only.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

from skyrl_megatron import host_api
from skyrl_megatron.engines.broadcast import BroadcastRendezvous
from skyrl_megatron.engines.hf_engine import ENGINE_ROLE, HFEngine, start_engine_actors
from skyrl_megatron.failures import EngineFailure, dead_actors
from skyrl_megatron.engines.weight_updates import TensorAnnouncement


class EngineClient(host_api.inference_engine_interface()):
    """The host's inference client over HF engine actors; each generate() call is split across them."""

    def __init__(self, engines: list, model_name: str, model_dtype: str):
        if not engines:
            raise ValueError("an engine client needs at least one engine")
        self.engines = list(engines)
        self._model_name = model_name
        self.model_dtype = model_dtype  # what the engines hold, so what a sync sends
        self._weight_version = 0
        self._next_engine = itertools.count()
        self._resumed: asyncio.Event | None = None  # made on first use, in the caller's event loop

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_resumed"] = None
        state["_next_engine"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._next_engine = itertools.count()

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    @property
    def weight_version(self) -> int:
        """Weight syncs so far (the host salts prefix caches with it)."""
        return self._weight_version

    def increment_weight_version(self) -> None:
        self._weight_version += 1

    # -- generation ------------------------------------------------------------------------------

    async def generate(self, input_batch, model: str | None = None) -> dict[str, Any]:
        """Split the batch's prompts into contiguous shares, one per engine, and join the outputs in order."""
        await self._wait_while_paused()
        key = "prompt_token_ids" if input_batch.get("prompt_token_ids") is not None else "prompts"
        prompts = list(input_batch.get(key) or [])
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        shares = _split(len(prompts), len(self.engines))
        first = next(self._next_engine) % len(self.engines)  # single prompts go round the engines
        calls = []
        for offset, (start, stop) in enumerate(shares):
            engine = self.engines[(first + offset) % len(self.engines)]
            share = {**input_batch, key: prompts[start:stop]}
            for per_prompt in _PER_PROMPT_KEYS:
                if input_batch.get(per_prompt) is not None:
                    share[per_prompt] = list(input_batch[per_prompt])[start:stop]
            calls.append(engine.generate.remote(share))
        outputs = await self._all(calls, "generation")
        return _concatenate(outputs)

    async def _all(self, calls: list, what: str) -> list:
        """The engines' answers to `calls`; an engine that died makes it one error naming it."""
        import ray

        try:
            return await asyncio.gather(*calls)
        except ray.exceptions.RayActorError as error:
            raise await self.engine_failure(what, error) from None

    async def engine_failure(self, what: str, error: BaseException) -> EngineFailure:
        """The error for `error` during `what`: the engines that died, by pid and node."""
        fallback = [f"{ENGINE_ROLE} {index} of {len(self.engines)}" for index in range(len(self.engines))]
        dead = await asyncio.to_thread(dead_actors, self.engines, fallback)
        who = "; ".join(dead) if dead else "an HF engine (none found dead)"
        cause = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        return EngineFailure(f"{who} failed during {what}: {cause}. The trainer's weights and checkpoints are "
                             "untouched; rerun to resume from the last checkpoint")

    async def _wait_while_paused(self) -> None:
        if self._resumed is not None:
            await self._resumed.wait()

    async def pause_generation(self, *args: Any, **kwargs: Any) -> None:
        """New requests wait until resume; the engines finish the ones they run (their lock orders a
        weight update after them), so nothing is lost."""
        if self._resumed is None:
            self._resumed = asyncio.Event()
        self._resumed.clear()

    async def resume_generation(self) -> None:
        if self._resumed is not None:
            self._resumed.set()

    async def abort_generation(self) -> None:
        await asyncio.gather(*(engine.abort_generation.remote() for engine in self.engines))

    async def finish_session(self, session_id: str) -> None:
        pass  # no session-aware routing to release

    async def chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError(_NO_HTTP.format(what="/chat/completions"))

    async def render_chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError(_NO_HTTP.format(what="chat rendering"))

    async def completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError(_NO_HTTP.format(what="/completions"))

    def get_endpoint_url(self) -> str:
        raise NotImplementedError(_NO_HTTP.format(what="an HTTP endpoint"))

    # -- lifecycle -------------------------------------------------------------------------------

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        await asyncio.gather(*(engine.sleep.remote() for engine in self.engines))

    async def wake_up(self, *args: Any, **kwargs: Any) -> None:
        await asyncio.gather(*(engine.wake_up.remote() for engine in self.engines))

    async def sleep_for_weight_sync(self, *args: Any, **kwargs: Any) -> None:
        await self.sleep()

    async def wake_for_weight_sync(self, *args: Any, **kwargs: Any) -> None:
        await self.wake_up()

    async def is_sleeping(self) -> bool:
        return all(await asyncio.gather(*(engine.is_sleeping.remote() for engine in self.engines)))

    async def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> None:
        await asyncio.gather(*(engine.reset_prefix_cache.remote() for engine in self.engines))

    async def teardown(self) -> None:
        await asyncio.gather(*(engine.teardown.remote() for engine in self.engines))

    async def get_world_size(self) -> tuple[int, int]:
        return len(self.engines), 1

    # -- weights ---------------------------------------------------------------------------------

    def join_weight_broadcast(self, rendezvous: BroadcastRendezvous) -> list:
        """Engine i joins `rendezvous` as rank i + 1; the refs resolve once rank 0 has joined too."""
        if rendezvous.world_size != len(self.engines) + 1:
            raise ValueError(f"rendezvous for {rendezvous.world_size} ranks, but there are {len(self.engines)} engines + the sender")
        return [engine.join_weight_broadcast.remote(rendezvous, rank) for rank, engine in enumerate(self.engines, 1)]

    def receive_broadcast(self, announcement: TensorAnnouncement) -> list:
        """Every engine starts receiving the announced tensors; rank 0 broadcasts them next."""
        return [engine.receive_broadcast.remote(announcement) for engine in self.engines]

    async def update_named_weights(self, request) -> None:
        """Tensors inside the request (``{"names": [...], "tensors": [...]}``), through Ray's object store."""
        if not isinstance(request, dict) or "tensors" not in request:
            raise TypeError("EngineClient.update_named_weights takes {'names': [...], 'tensors': [...]}; the "
                            "policy workers sync over the client's broadcast group")
        await self._all([engine.load_weights.remote(request["names"], request["tensors"]) for engine in self.engines],
                        "a weight update")

    async def load_lora_adapter(self, lora_name: str, lora_path: str | None = None, **kwargs: Any) -> dict[str, Any]:
        if lora_path is None:
            raise ValueError("the HF engine loads LoRA adapters from a directory: give lora_path")
        await self._all([engine.load_adapter.remote(lora_path) for engine in self.engines], "an adapter load")
        return {"lora_name": lora_name}

    async def named_weights(self) -> list[dict]:
        """Each engine's weights (CPU copies), for bitwise checks."""
        return list(await asyncio.gather(*(engine.named_weights.remote() for engine in self.engines)))


# request fields with one entry per prompt: each engine gets its prompts' entries
_PER_PROMPT_KEYS = ("session_ids", "routed_experts_prompt_starts")

_NO_HTTP = "the HF engine serves generate() only, not {what} (vLLM's OpenAI server does)"


def _split(count: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) shares of `count` items over at most `parts` engines, sizes within one."""
    parts = min(parts, count)
    base, extra = divmod(count, parts)
    bounds, start = [], 0
    for index in range(parts):
        stop = start + base + (index < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def _concatenate(outputs: list[dict[str, Any]]) -> dict[str, Any]:
    joined: dict[str, Any] = {}
    for key in outputs[0]:
        values = [output[key] for output in outputs]
        joined[key] = None if any(value is None for value in values) else [item for value in values for item in value]
    return joined


def create_engine_client(
    num_engines: int,
    model_path: str | Path,
    *,
    dtype: str = "float32",
    seed: int = 0,
    num_cpus: float = 1,
    tokenizer: str | Path | None = None,
    model_name: str | None = None,
    device: str = "cpu",
    return_routed_experts: bool = False,
) -> EngineClient:
    """`num_engines` HF engine actors behind one client, on CPU or each on a GPU of its own; seeds seed, seed+1, ...
    With `return_routed_experts` (an MoE model) every output carries ``rollout_expert_indices``: per row the
    experts of each token the engine forwarded, [prompt + response - 1, MoE layers, k] (see hf_engine.py)."""
    engines = start_engine_actors(HFEngine, num_engines, model_path, dtype=dtype, seed=seed, num_cpus=num_cpus,
                                  tokenizer=tokenizer, device=device, return_routed_experts=return_routed_experts)
    return EngineClient(engines, model_name or str(model_path), dtype)
