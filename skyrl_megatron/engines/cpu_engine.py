"""skyrl-train 0.3.1's face on the HF engine: its ``InferenceEngineInterface`` as a Ray actor.

The host holds engines as ``RayWrappedInferenceEngine`` actors behind its ``InferenceEngineClient``;
``generator.engine=cpu`` puts this one where it would start vLLM/SGLang. The decoding, weights and
lifecycle are the host-free core's (``hf_engine.HFEngine``); this module maps the host's types onto it.

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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from skyrl_megatron import host_api
from skyrl_megatron.engines.hf_engine import HFEngine, start_engine_actors
from skyrl_megatron.engines.weight_updates import torch_dtype


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


class CpuInferenceEngine(HFEngine, host_api.inference_engine_interface()):
    """The host's InferenceEngineInterface over the HF engine (on CPU unless `device` says otherwise)."""

    _host_group = None  # the host's weight-broadcast process group, once joined
    _host_receiver = None  # the host's CUDA IPC receiver (colocated on a GPU), once initialised

    async def chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError("the HF engine serves generate() only, not the OpenAI /chat/completions API")

    async def completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError("the HF engine serves generate() only, not the OpenAI /completions API")

    # -- the host's weight-sync protocol -----------------------------------------------------------

    async def init_weight_update_communicator(self, init_info) -> None:
        """Join the host's broadcast group (gloo; NCCL on a GPU) as rank ``init_info.rank_offset``; the trainer's rank 0 is 0."""
        if self.device.type == "cuda" and isinstance(init_info, host_api.cuda_ipc_init_info_class()):
            # colocated with the policy: the host's own receiver opens the IPC handles of its packed chunks
            if self._host_receiver is None or init_info.override_existing_receiver:
                self._host_receiver = init_info.strategy_type().create_receiver(init_info)
            return
        broadcast_info = host_api.broadcast_init_info_class()
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if not isinstance(init_info, broadcast_info) or init_info.backend != backend:
            raise ValueError(
                f"the HF engine on {self.device.type} receives weights over {backend} broadcast only, got "
                f"{type(init_info).__name__}"
                f"{'' if not isinstance(init_info, broadcast_info) else f' with backend {init_info.backend!r}'}: "
                f"set generator.weight_sync_backend={backend}"
                + ("" if self.device.type == "cuda" else " and trainer.placement.colocate_all=false")
            )
        if self._host_group is not None and not init_info.override_existing_receiver:
            return
        torch_dtype(init_info.model_dtype_str)  # a dtype the engine can hold, or a clear error now
        self._host_group = await asyncio.to_thread(host_api.join_weight_broadcast_group, init_info)

    async def update_named_weights(self, request) -> None:
        if isinstance(request, host_api.lora_load_request_class()):
            await self.load_adapter(request.lora_path)
            return
        if not len(request):
            raise ValueError("weight update request must not be empty")
        if isinstance(request, host_api.broadcast_update_request_class()):
            request = await asyncio.to_thread(self._receive_host_broadcast, request)
        elif self._host_receiver is not None and isinstance(request, host_api.cuda_ipc_update_request_class()):
            # views into the trainer's packed chunk: copied into the model before the sender reuses it
            names, tensors = zip(*self._host_receiver.receive_weights(request))
            await self.load_weights(list(names), list(tensors))
            return
        elif not isinstance(request, NamedTensorsUpdateRequest):
            raise TypeError(
                f"CpuInferenceEngine takes NamedTensorsUpdateRequest (tensors inside) or the host's "
                f"BroadcastWeightUpdateRequest (after init_weight_update_communicator), got {type(request).__name__}"
            )
        await self.load_weights(request.names, request.tensors)

    def _receive_host_broadcast(self, request) -> NamedTensorsUpdateRequest:
        """Every announced tensor is received before any check: the sender broadcasts them regardless."""
        if self._host_group is None:
            raise RuntimeError("broadcast weight update before init_weight_update_communicator")
        tensors = []
        for dtype, shape in zip(request.dtypes, request.shapes):
            tensor = torch.empty(list(shape), dtype=torch_dtype(dtype), device=self.device)
            torch.distributed.broadcast(tensor, 0, group=self._host_group)
            tensors.append(tensor)
        return NamedTensorsUpdateRequest(
            names=list(request.names),
            dtypes=[str(t.dtype) for t in tensors],
            shapes=[list(t.shape) for t in tensors],
            tensors=tensors,
        )

    def tp_size(self) -> int:
        return 1

    def pp_size(self) -> int:
        return 1

    def dp_size(self) -> int:
        return 1


def create_ray_wrapped_cpu_engines(
    num_engines: int,
    model_path: str | Path,
    *,
    dtype: str = "float32",
    seed: int = 0,
    num_cpus: float = 1,
    tokenizer: str | Path | None = None,
    device: str = "cpu",
    colocate_pg=None,
) -> list:
    """Engine actors wrapped as the host holds its own (``RayWrappedInferenceEngine``); seeds seed, seed+1, ...

    On CPU; on a GPU of its own each; or, with `colocate_pg` (``colocate_all``), engine i on a share of
    the GPU of bundle i, which the host's policy and reference workers share too (as it places vLLM).
    """

    def colocated(index: int) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"num_gpus": COLOCATED_GPU_SHARE, "num_cpus": COLOCATED_GPU_SHARE,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=colocate_pg, placement_group_bundle_index=index)}

    actors = start_engine_actors(
        CpuInferenceEngine, num_engines, model_path, dtype=dtype, seed=seed, num_cpus=num_cpus, tokenizer=tokenizer,
        device=device, options_for=colocated if colocate_pg is not None else None,
    )
    return [host_api.ray_wrapped_inference_engine(actor) for actor in actors]


# The share of a GPU a colocated engine asks Ray for (the host asks the same for its vLLM engines).
COLOCATED_GPU_SHARE = 0.2
