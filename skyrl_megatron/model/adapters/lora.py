"""LoRA adapters on a frozen Megatron base, through Megatron-Bridge's PEFT.

:class:`LoraSpec` is the one description of the adapters: the host's `trainer.<role>.model.lora.*`
keys (rank, alpha, dropout, targets, A's init) plus `megatron_config.lora_config` (the bridge's
adapter flavour and how weight sync ships them). :func:`adapter_hook` turns it into the pre-wrap hook
that :mod:`skyrl_megatron.model.build` runs after the base weights are in place and before Megatron's
DDP wraps the chunks, so that DDP's grad buffers and the optimizer only ever see adapter parameters.

Two things differ from applying the bridge's `LoRA` as is:

* Targets may be given in Hugging Face names (`q_proj`, `gate_proj`, ...; what FSDP users of the host
  write) or Megatron names (`linear_qkv`, `linear_fc1_up`, ...). "all-linear" means the attention and
  MLP projections, never the LM head (as in HF PEFT).
* Adapter weights are initialised per *global* tensor: each logical adapter matrix is drawn whole from a
  generator seeded by (seed, its checkpoint key) and every rank copies out its own shard. The bridge's
  initialisation draws from the process RNG, whose state depends on which layers and experts a rank
  built, so the same seed gave different adapters under PP or EP. Here the adapters, and with them
  the whole training run, are the same under every layout.

:class:`LoraFootprint` reports what freezing the base saves (trainable vs total parameters, optimizer
bytes) for the worker to log.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from skyrl_megatron.lora_spec import LoraConfigError, LoraSpec
from skyrl_megatron.model.conversion.bridge_import import import_bridge
from skyrl_megatron.peft_support import PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE

_ADAM_MOMENT_BYTES = 8
_FP32_MAIN_PARAM_BYTES = 4


def make_peft(spec: LoraSpec):
    """The bridge's PEFT object (LoRA or CanonicalLoRA) for `spec`."""
    import_bridge()
    from megatron.bridge.peft.canonical_lora import CanonicalLoRA
    from megatron.bridge.peft.lora import LoRA

    peft_cls = LoRA if spec.lora_type == "lora" else CanonicalLoRA
    return peft_cls(
        target_modules=spec.megatron_targets(),
        dim=spec.rank,
        alpha=spec.alpha,
        dropout=spec.dropout,
        lora_A_init_method=spec.init_method,
        lora_B_init_method="zero",
    )


def adapter_hook(spec: LoraSpec) -> Callable[[list], list]:
    """A provider pre-wrap hook: freeze the chunks, add adapters, initialise them layout-independently."""

    def add_adapters(chunks: list) -> list:
        chunks = make_peft(spec)(chunks, training=True)
        _require_whole_expert_adapters(chunks)
        initialise_adapters(chunks, spec)
        return chunks

    return add_adapters


def _require_whole_expert_adapters(chunks: Sequence[torch.nn.Module]) -> None:
    """Megatron-Bridge's adapters on Megatron's per-expert linears inherit the experts' "explicit
    communication" mode, in which the expert layer leaves the tensor-parallel reductions to the token
    dispatcher; the adapters' own reductions (B's input, fc2's low-rank activation) are then never
    made, and their gradients come out wrong once experts are split over expert-TP ranks."""
    from megatron.bridge.peft.utils import ParallelLinearAdapter
    from megatron.core import parallel_state as ps

    if ps.get_expert_tensor_parallel_world_size() == 1:
        return
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if isinstance(module, ParallelLinearAdapter) and module.is_expert:
                raise LoraConfigError(
                    f"LoRA on MoE expert layers ({name}) needs expert_tensor_parallel_size=1 (experts split "
                    f"over EP only; TP still splits attention), got {ps.get_expert_tensor_parallel_world_size()}; "
                    "or target only attention modules"
                )


def is_adapter_name(name: str) -> bool:
    """Whether a parameter or state-dict key belongs to an adapter (the bridge nests them under `.adapter.`)."""
    return ".adapter." in name


def initialise_adapters(chunks: Sequence[torch.nn.Module], spec: LoraSpec) -> None:
    """Draw every adapter matrix whole from its own seeded generator and copy out this rank's shard.

    A (`linear_in`) follows `spec.init_method`, B (`linear_out`) starts at zero. The sharded state dict
    names each tensor by its global key and places the local shard in the global matrix, whatever the
    TP / PP / EP layout; tensors stored with leading axes (e.g. an expert index) are one matrix per
    index, with the index in the seed.
    """
    for shard in _adapter_shards(chunks):
        prepend = shard.prepend_axis_num
        matrix_shape = tuple(shard.global_shape[prepend:])
        method = spec.init_method if shard.key.endswith("linear_in.weight") else "zero"
        full = _initialised(matrix_shape, method, _seed_for(spec.seed, shard.key, shard.global_offset[:prepend]))
        window = tuple(
            slice(offset, offset + size) for offset, size in zip(shard.global_offset[prepend:], shard.local_shape)
        )
        with torch.no_grad():
            shard.data.copy_(full[window])


def _adapter_shards(chunks: Sequence[torch.nn.Module]):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.utils import unwrap_model

    for chunk in unwrap_model(list(chunks)):
        for key, value in chunk.sharded_state_dict().items():
            if not is_adapter_name(key):
                continue
            # factories (e.g. the gate/up halves of fc1's B) expand into shards that are views of the param
            built = value.build() if isinstance(value, ShardedTensorFactory) else value
            for shard in built if isinstance(built, list) else [built]:
                if isinstance(shard, ShardedTensor):
                    yield shard


def _seed_for(seed: int, key: str, leading_index: Sequence[int]) -> int:
    digest = hashlib.sha256(f"{seed}|{key}|{tuple(leading_index)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _initialised(shape: tuple[int, ...], method: str, seed: int) -> torch.Tensor:
    """A full adapter matrix, initialised as Megatron-Bridge initialises its adapters' master weights."""
    generator = torch.Generator().manual_seed(seed)
    full = torch.empty(shape, dtype=torch.float32)
    if method == "xavier":
        return torch.nn.init.xavier_normal_(full, generator=generator)
    if method == "normal":
        return torch.nn.init.normal_(full, std=0.2, generator=generator)
    if method == "kaiming":
        return torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
    return full.zero_()


# ----------------------------------------------------------------------------------------------
# What freezing the base saves
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoraFootprint:
    """Parameters of the whole model, and this rank's optimizer state, with and without LoRA.

    `optimizer_bytes` is Adam's state for the trainable elements this rank's optimizer holds (two fp32
    moments, plus an fp32 main copy when the parameters are bf16; split over the data-parallel ranks by
    the distributed optimizer); `full_finetune_optimizer_bytes` is the same for every parameter.
    """

    trainable_params: int
    total_params: int
    optimizer_bytes: int
    full_finetune_optimizer_bytes: int

    @property
    def trainable_fraction(self) -> float:
        return self.trainable_params / self.total_params if self.total_params else 0.0

    @property
    def optimizer_bytes_saved(self) -> int:
        return self.full_finetune_optimizer_bytes - self.optimizer_bytes

    def as_metrics(self, prefix: str = "lora/") -> dict[str, float]:
        return {
            f"{prefix}trainable_params": float(self.trainable_params),
            f"{prefix}total_params": float(self.total_params),
            f"{prefix}trainable_fraction": self.trainable_fraction,
            f"{prefix}optimizer_gib": self.optimizer_bytes / 2**30,
            f"{prefix}optimizer_gib_saved": self.optimizer_bytes_saved / 2**30,
        }


def measure_footprint(
    chunks: Sequence[torch.nn.Module], *, bf16: bool, distributed_optimizer: bool
) -> LoraFootprint:
    """Count the model's parameters (each shard once over all ranks) and this rank's optimizer bytes.

    Collective over the default process group (one all-reduce of two integers).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from skyrl_megatron.runtime import current_runtime

    # Megatron marks expert parameters allreduce=False: they are replicated over the expert-DP group
    # and split over expert-TP, the others over DP (x CP) and TP. The distributed optimizer shards
    # each kind over its own data-parallel group.
    first_replica = {False: ps.get_data_parallel_rank() == 0, True: ps.get_expert_data_parallel_rank() == 0}
    tp_rank = {False: ps.get_tensor_model_parallel_rank(), True: ps.get_expert_tensor_parallel_rank()}
    optimizer_shards = {
        False: ps.get_data_parallel_world_size(with_context_parallel=True) if distributed_optimizer else 1,
        True: ps.get_expert_data_parallel_world_size() if distributed_optimizer else 1,
    }
    counted = torch.zeros(2, dtype=torch.int64)  # trainable, total: this rank's share of the global count
    local = {(is_expert, trains): 0 for is_expert in (False, True) for trains in (False, True)}
    for param in _unique_parameters(chunks):
        is_expert = not getattr(param, "allreduce", True)
        local[(is_expert, param.requires_grad)] += param.numel()
        split = getattr(param, "tensor_model_parallel", False)
        # a tied output layer on the last stage shares the first stage's embedding
        tied_copy = getattr(param, "shared_embedding", False) and not ps.is_pipeline_first_stage(ignore_virtual=True)
        if first_replica[is_expert] and (split or tp_rank[is_expert] == 0) and not tied_copy:
            counted += torch.tensor([param.numel() if param.requires_grad else 0, param.numel()])
    counts = counted.to(current_runtime().torch_device)
    dist.all_reduce(counts)

    per_element = _ADAM_MOMENT_BYTES + (_FP32_MAIN_PARAM_BYTES if bf16 else 0)

    def optimizer_bytes(with_frozen: bool) -> int:
        elements = 0
        for is_expert in (False, True):
            held = local[(is_expert, True)] + (local[(is_expert, False)] if with_frozen else 0)
            elements += math.ceil(held / optimizer_shards[is_expert])
        return elements * per_element

    return LoraFootprint(
        trainable_params=int(counts[0]),
        total_params=int(counts[1]),
        optimizer_bytes=optimizer_bytes(with_frozen=False),
        full_finetune_optimizer_bytes=optimizer_bytes(with_frozen=True),
    )


def _unique_parameters(chunks: Sequence[torch.nn.Module]):
    seen: set[int] = set()
    for chunk in chunks:
        for param in chunk.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                yield param


# ----------------------------------------------------------------------------------------------
# The adapters under HF names: gathered, merged, or in HF `peft`'s layout
# ----------------------------------------------------------------------------------------------

_LORA_A, _LORA_B = ".lora_A.weight", ".lora_B.weight"
_BASE_LAYER = ".base_layer"
_EXPERT_INDEX = re.compile(r"(\.experts\.)(\d+)(\.)")


def gather_hf_adapter_weights(built) -> dict[str, torch.Tensor]:
    """Every adapter of `built` as full tensors on every rank, under the bridge's HF names
    (`<HF module>.lora_A.weight` / `.lora_B.weight`; fused q/k/v and gate/up adapters come out per
    HF projection). Collective over all ranks of the model.
    """
    if built.lora is None:
        raise LoraConfigError("the model carries no LoRA adapters (build it with ModelSpec.lora)")
    # cloned: a replicated adapter may come out as the parameter itself, which the next step changes
    weights = {
        item.param_name: item.weight.detach().clone()
        for item in built.bridge.export_adapter_weights(built.chunks, cpu=False, show_progress=False)
    }
    return _with_every_expert(weights, built.config.num_moe_experts)


def _with_every_expert(weights: dict[str, torch.Tensor], num_experts: int | None) -> dict[str, torch.Tensor]:
    """Megatron-Bridge 0.6.2 exports the adapters of per-expert (SequentialMLP) layers only for this
    rank's experts, numbered by their local index: renumber them globally and share them over the
    expert-parallel group, so that every rank holds every expert's adapters, as for the base weights."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    ep_size = ps.get_expert_model_parallel_world_size()
    experts = {name: tensor for name, tensor in weights.items() if _EXPERT_INDEX.search(name)}
    if ep_size == 1 or not experts:
        return weights
    local_count = num_experts // ep_size
    offset = ps.get_expert_model_parallel_rank() * local_count

    def global_name(name: str) -> str:
        return _EXPERT_INDEX.sub(lambda m: f"{m[1]}{int(m[2]) + offset}{m[3]}", name, count=1)

    mine = [(global_name(name), tensor.cpu()) for name, tensor in experts.items()]
    everyone: list[list[tuple[str, torch.Tensor]] | None] = [None] * ep_size
    dist.all_gather_object(everyone, mine, group=ps.get_expert_model_parallel_group())
    device = next(iter(experts.values())).device
    gathered = {name: tensor.to(device) for part in everyone for name, tensor in part}
    indices = {int(_EXPERT_INDEX.search(name)[2]) for name in gathered}
    if len(gathered) != ep_size * len(experts) or indices != set(range(num_experts)):
        raise RuntimeError(
            f"expert adapters did not come out as {local_count} local experts per rank (found expert "
            f"indices {sorted(indices)}); the bridge's adapter export changed: revisit _with_every_expert"
        )
    return {name: tensor for name, tensor in weights.items() if name not in experts} | gathered


class AdapterMerger:
    """Folds the adapters into the base weights they belong to: W + scale * B @ A, matched by HF name.

    The bridge can merge while exporting, but under expert parallelism it merges the other ranks'
    experts with this rank's adapters; merging from :func:`gather_hf_adapter_weights` is right under
    every layout. Takes the bridge's unmerged export, which names adapted weights the PEFT way
    (`<module>.base_layer.weight`), and gives back plain HF names. The sum is formed in fp32 and cast
    back to the base weight's dtype.
    """

    def __init__(self, adapters: dict[str, torch.Tensor], scale: float):
        self.scale = scale
        self._pairs = {
            name[: -len(_LORA_A)] + ".weight": (tensor, adapters[name[: -len(_LORA_A)] + _LORA_B])
            for name, tensor in adapters.items()
            if name.endswith(_LORA_A)
        }
        self._unused = set(self._pairs)

    @classmethod
    def for_model(cls, built) -> AdapterMerger:
        """Collective (gathers the adapters)."""
        return cls(gather_hf_adapter_weights(built), built.lora.scale)

    def __call__(self, name: str, base: torch.Tensor) -> tuple[str, torch.Tensor]:
        module, _, leaf = name.rpartition(".")
        if not module.endswith(_BASE_LAYER):
            return name, base
        name = f"{module[: -len(_BASE_LAYER)]}.{leaf}"
        pair = self._pairs.get(name)
        if pair is None:  # e.g. the bias of an adapted projection
            return name, base
        self._unused.discard(name)
        lora_a, lora_b = pair
        if lora_a.ndim != 2:
            raise NotImplementedError(f"merging packed (3-D) expert adapters is not supported ({name})")
        delta = self.scale * (lora_b.float() @ lora_a.float())
        return name, (base.float() + delta.to(base.device)).to(base.dtype)

    def check_all_merged(self) -> None:
        """Every adapter found its base weight (a naming mismatch would otherwise drop adapters silently)."""
        if self._unused:
            raise RuntimeError(f"adapters without a base weight in the export: {sorted(self._unused)[:5]}")


@dataclass(frozen=True)
class PeftAdapter:
    """LoRA adapters as HF `peft` stores them: `PeftModel.from_pretrained(base, directory)` reads :meth:`save`.

    MoE expert adapters keep per-expert names (the bridge's, vLLM's); on transformers 5's fused experts only
    a peft that converts them (0.21 on) loads them; our HF engine merges them itself (`engines/lora_merge.py`).
    """

    config: dict[str, Any]  # adapter_config.json
    state: dict[str, torch.Tensor]  # adapter_model.safetensors: full tensors under peft's names

    @classmethod
    def export(cls, built) -> PeftAdapter:
        """Gather the adapters of `built` (a BuiltModel with LoRA) on every rank. Collective.

        The bridge's PEFT helpers rename (and, for 3-D expert tensors, pack) the HF-named adapters and
        write the matching config.
        """
        from megatron.bridge.models.conversion.model_bridge import HFWeightTuple
        from megatron.bridge.models.conversion.peft_bridge import (
            build_adapter_config_dict,
            convert_adapter_weights_to_peft_state,
            infer_rank_pattern_from_adapter_weights,
            infer_target_modules_from_adapter_weights,
        )

        spec: LoraSpec = built.lora
        weights = [HFWeightTuple(name, tensor) for name, tensor in gather_hf_adapter_weights(built).items()]
        state, module_names, target_parameters = convert_adapter_weights_to_peft_state(weights)
        config = build_adapter_config_dict(
            make_peft(spec),
            target_modules=infer_target_modules_from_adapter_weights(module_names),
            target_parameters=target_parameters,
            base_model_name_or_path=str(built.bridge.hf_pretrained.model_name_or_path or ""),
            rank_pattern=infer_rank_pattern_from_adapter_weights(weights, default_rank=spec.rank),
        )
        return cls(config=config, state={name: tensor.contiguous() for name, tensor in state.items()})

    def save(self, directory: Path) -> None:
        """Write the two files `peft` reads into an existing `directory`."""
        from safetensors.torch import save_file

        (directory / PEFT_CONFIG_FILE).write_text(json.dumps(self.config, indent=2))
        save_file({name: tensor.cpu() for name, tensor in self.state.items()}, directory / PEFT_WEIGHTS_FILE)
