"""Distributed checkpoints of a Megatron worker's training state, and Hugging Face exports.

A checkpoint directory holds

    skyrl_megatron_checkpoint.json   our metadata: format version, model identity, layout, step,
                                     the caller's `extra`, and the size of every shard file
    dist/                            a Megatron `dist_checkpointing` checkpoint: model chunks,
                                     optimizer, LR scheduler, per-rank RNG states
    huggingface/                     the tokenizer, when one is given

Model and optimizer state are stored in Megatron's global (layout-independent) form, so a
checkpoint saved under one parallel layout loads under another; the distributed optimizer saves
its state `fully_reshardable` for that reason. RNG states belong to ranks and are restored only
under the layout they were saved with. A model carrying LoRA adapters stores only the adapters
(its base is frozen and is rebuilt from the HF checkpoint); the metadata's `model_state` says which.

Saving is atomic: every rank writes into a `.<name>.partial` sibling, the metadata file is written
last, and rank 0 renames the directory into place after all ranks finished. An existing checkpoint
at the same path is replaced only then, so a crash mid-save leaves the previous one loadable.
Loading checks the metadata (model identity, files present with their recorded sizes) before it
reads a tensor, reads everything into fresh buffers, and copies into the model and optimizer only
once every rank has read its part.

Data-parallel (and context-parallel) replicas hold the same shards: each replica writes a share of
them at save, and reads a share at load and hands it to the others, instead of the first replica
writing everything and every replica reading everything. Saving starts no helper process, so a
rank killed mid-save leaves nothing running behind it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from skyrl_megatron.dist_io import replica_group, save_strategy, writer_results_in_process
from skyrl_megatron.model.lora import PEFT_CONFIG_FILE, PeftAdapter, is_adapter_name
from skyrl_megatron.weights import iter_hf_weights

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
METADATA_FILE = "skyrl_megatron_checkpoint.json"
DIST_SUBDIR = "dist"
TOKENIZER_SUBDIR = "huggingface"
# The distributed optimizer's one format in Megatron 0.19.2 that reshards across TP and PP
# ("fully_sharded_model_space" rejects its own flattened tensors; "dp_reshardable" is DP-only).
# It stores the state per model parameter, which costs host memory: saving gathers a model-parallel
# shard's full optimizer state (12 bytes a parameter) on DP rank 0, which alone writes it (the other
# replicas take the model weights); loading has each replica read a share and broadcast it, so
# every rank holds the full state before it keeps its slice.
OPTIMIZER_SHARDING_TYPE = "fully_reshardable"
MODEL_STATE_FULL = "full"
MODEL_STATE_ADAPTERS = "adapters"
_PARTIAL_SUFFIX = ".partial"
_REPLACED_SUFFIX = ".replaced"

# TransformerConfig / GPTModel fields that decide which weights a model has and what they mean.
# Parallel sizes, precision and fusions are deliberately absent: they may differ on resume.
_ARCHITECTURE_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "normalization",
    "layernorm_epsilon",
    "gated_linear_unit",
    "activation_func",
    "add_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "num_moe_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "position_embedding_type",
    "rotary_base",
    "share_embeddings_and_output_weights",
    "vocab_size",
)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint directory at the given path."""


class CorruptCheckpointError(CheckpointError):
    """The checkpoint is incomplete or damaged (missing or truncated files, unreadable metadata)."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint belongs to another model, or holds no state for what the caller asked to load."""


@dataclass(frozen=True)
class ModelIdentity:
    """A hash of the architecture fields (what must match to load the weights) and a readable name."""

    fingerprint: str
    description: str

    @classmethod
    def of(cls, chunks: Sequence[torch.nn.Module]) -> "ModelIdentity":
        model = _unwrap(chunks[0])
        config = model.config
        fields = {name: _plain(getattr(config, name, None)) for name in _ARCHITECTURE_FIELDS}
        # GPTModel keeps the (possibly padded) vocabulary size on the module, not on its config
        fields["vocab_size"] = getattr(model, "vocab_size", fields["vocab_size"])
        value_head = bool(getattr(model, "ends_in_value_head", False))  # set on every stage's chunks
        if value_head:  # a critic (model/value_head.py): never interchangeable with an LM's checkpoint
            fields["value_head"] = True
        canonical = json.dumps(fields, sort_keys=True)
        shape = [
            f"layers={fields['num_layers']}",
            f"hidden={fields['hidden_size']}",
            f"ffn={fields['ffn_hidden_size']}",
            f"heads={fields['num_attention_heads']}",
            f"kv_heads={fields['num_query_groups']}",
            f"vocab={fields['vocab_size']}",
            f"qk_layernorm={fields['qk_layernorm']}",
        ]
        if fields["num_moe_experts"]:
            shape.append(f"experts={fields['num_moe_experts']} top-{fields['moe_router_topk']}")
        if value_head:
            shape.append("value_head")
        return cls(
            fingerprint=hashlib.sha256(canonical.encode()).hexdigest()[:16],
            description=f"{type(model).__name__}({', '.join(shape)})",
        )


@dataclass(frozen=True)
class Layout:
    """How the model was split over the ranks that saved (or are loading) a checkpoint."""

    tensor: int
    pipeline: int
    virtual_pipeline: int
    context: int
    expert: int
    expert_tensor: int
    data: int
    world_size: int

    @classmethod
    def current(cls, chunks: Sequence[torch.nn.Module]) -> "Layout":
        from megatron.core import parallel_state as ps

        return cls(
            tensor=ps.get_tensor_model_parallel_world_size(),
            pipeline=ps.get_pipeline_model_parallel_world_size(),
            virtual_pipeline=len(chunks),
            context=ps.get_context_parallel_world_size(),
            expert=ps.get_expert_model_parallel_world_size(),
            expert_tensor=ps.get_expert_tensor_parallel_world_size(),
            data=ps.get_data_parallel_world_size(),
            world_size=dist.get_world_size(),
        )


@dataclass(frozen=True)
class CheckpointMetadata:
    """Contents of METADATA_FILE."""

    step: int
    extra: dict[str, Any]
    model: ModelIdentity
    layout: Layout
    optimizer: str | None  # "distributed", "plain", or None when no optimizer state was saved
    has_scheduler: bool
    files: dict[str, int]  # shard file (relative to DIST_SUBDIR) -> size in bytes
    model_state: str = MODEL_STATE_FULL  # MODEL_STATE_FULL | MODEL_STATE_ADAPTERS (LoRA: adapters only)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "CheckpointMetadata":
        data = json.loads(text)
        return cls(
            step=data["step"],
            extra=data["extra"],
            model=ModelIdentity(**data["model"]),
            layout=Layout(**data["layout"]),
            optimizer=data["optimizer"],
            has_scheduler=data["has_scheduler"],
            files=data["files"],
            model_state=data.get("model_state", MODEL_STATE_FULL),
            format_version=data["format_version"],
        )


@dataclass(frozen=True)
class CheckpointState:
    """What `load_checkpoint` restored besides the weights."""

    step: int
    extra: dict[str, Any]
    saved_layout: Layout
    rng_restored: bool  # only under the layout the checkpoint was saved with


def save_checkpoint(
    ckpt_dir: str | os.PathLike,
    chunks: Sequence[torch.nn.Module],
    optimizer=None,
    scheduler=None,
    *,
    step: int,
    extra: dict[str, Any] | None = None,
    tokenizer=None,
) -> Path:
    """Save model chunks, optimizer, scheduler and RNG states to `ckpt_dir` (collective, all ranks).

    `extra` must be JSON-serialisable; it is returned by `load_checkpoint`. A `tokenizer` is saved
    to `<ckpt_dir>/huggingface`, where the host's FSDP checkpoints keep it. An existing checkpoint
    at `ckpt_dir` is replaced once the new one is complete; any other non-empty directory there
    is refused. Returns the final path.
    """
    final = Path(ckpt_dir).absolute()
    extra = dict(extra or {})
    try:
        json.dumps(extra)
    except TypeError as exc:
        raise CheckpointError(f"save_checkpoint: `extra` must be JSON-serialisable ({exc})") from None
    _check_replaceable(final, marker=METADATA_FILE, what="a skyrl-megatron checkpoint")
    partial = _sibling(final, _PARTIAL_SUFFIX)
    if dist.get_rank() == 0:
        # a leftover from a save that crashed: never published, safe to discard
        shutil.rmtree(partial, ignore_errors=True)
        (partial / DIST_SUBDIR).mkdir(parents=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(partial / TOKENIZER_SUBDIR)
    dist.barrier()

    from megatron.core import dist_checkpointing

    model_state = _model_state(chunks)  # collective: every rank takes part
    sharded = _sharded_training_state(
        chunks, optimizer, scheduler, is_loading=False, with_rng=True, model_state=model_state
    )
    with writer_results_in_process():
        # returns after a barrier: every rank's shards are on disk
        dist_checkpointing.save(sharded, str(partial / DIST_SUBDIR), sharded_strategy=save_strategy())
    if dist.get_rank() == 0:
        metadata = CheckpointMetadata(
            step=int(step),
            extra=extra,
            model=ModelIdentity.of(chunks),
            layout=Layout.current(chunks),
            optimizer=None if optimizer is None else _optimizer_kind(optimizer),
            has_scheduler=scheduler is not None,
            files=_file_sizes(partial / DIST_SUBDIR),
            model_state=model_state,
        )
        _write_durably(partial / METADATA_FILE, metadata.to_json())
    _commit(partial, final)
    return final


def load_checkpoint(
    ckpt_dir: str | os.PathLike,
    chunks: Sequence[torch.nn.Module],
    optimizer=None,
    scheduler=None,
    *,
    strict: bool = True,
) -> CheckpointState:
    """Load a checkpoint written by `save_checkpoint` into `chunks` (and `optimizer`, `scheduler`
    when given). Collective: all ranks call it. The current layout may differ from the saved one.

    Raises CheckpointNotFoundError, CorruptCheckpointError or CheckpointMismatchError before any
    weight is touched. With strict=False, tensors missing from the checkpoint keep their values.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    path = Path(ckpt_dir).absolute()
    metadata = read_checkpoint_metadata(path)
    _check_same_model(metadata, chunks, path)
    _check_same_model_state(metadata, chunks, path)
    _check_files(metadata, path)
    if optimizer is not None and metadata.optimizer != _optimizer_kind(optimizer):
        raise CheckpointMismatchError(
            f"checkpoint {path} holds {_describe_optimizer(metadata.optimizer)}, but the optimizer to "
            f"restore is {_describe_optimizer(_optimizer_kind(optimizer))}; set "
            f"ddp_config.use_distributed_optimizer as when it was saved, or load without the optimizer"
        )
    if scheduler is not None and not metadata.has_scheduler:
        raise CheckpointMismatchError(f"checkpoint {path} holds no LR scheduler state")

    layout = Layout.current(chunks)
    same_layout = layout == metadata.layout
    sharded = _sharded_training_state(
        chunks, optimizer, scheduler, is_loading=True, with_rng=same_layout, model_state=metadata.model_state
    )
    _use_fresh_buffers(sharded)
    failure = f"cannot read checkpoint {path}"
    loaded = _agree_on_all_ranks(
        lambda: dist_checkpointing.load(
            sharded,
            str(path / DIST_SUBDIR),
            sharded_strategy=_load_strategy(failure),
            strict=StrictHandling.RAISE_UNEXPECTED if strict else StrictHandling.LOG_UNEXPECTED,
        ),
        failure,
    )

    # every rank holds its complete state now: only copies from here on
    for index, chunk in enumerate(chunks):
        _load_model_state(_unwrap(chunk), loaded[f"model{index}"], metadata.model_state, strict=strict)
    if optimizer is not None:
        _load_optimizer_state(optimizer, loaded["optimizer"])
    if scheduler is not None:
        # load_state_dict advances by the saved step count instead of setting it
        scheduler.num_steps = 0
        scheduler.load_state_dict(loaded["scheduler"])
    if same_layout:
        _restore_rng(loaded["rng_state"])
    else:
        logger.warning(
            "checkpoint %s was saved under %s; running under %s: RNG states are per rank and are not "
            "restored (model, optimizer and scheduler state are)",
            path,
            metadata.layout,
            layout,
        )
    return CheckpointState(
        step=metadata.step, extra=metadata.extra, saved_layout=metadata.layout, rng_restored=same_layout
    )


def read_checkpoint_metadata(ckpt_dir: str | os.PathLike) -> CheckpointMetadata:
    """The metadata of the checkpoint at `ckpt_dir`, with clear errors for missing or broken ones."""
    path = Path(ckpt_dir).absolute()
    if not path.is_dir():
        hint = ""
        replaced = _sibling(path, _REPLACED_SUFFIX)
        if replaced.is_dir():
            hint = f" (an interrupted replace left the previous checkpoint at {replaced}: rename it back)"
        raise CheckpointNotFoundError(
            f"no checkpoint at {path}: expected a directory written by save_checkpoint, holding "
            f"{METADATA_FILE} and {DIST_SUBDIR}/{hint}"
        )
    metadata_file = path / METADATA_FILE
    if not metadata_file.is_file():
        raise CorruptCheckpointError(
            f"{path} is not a complete skyrl-megatron checkpoint: {METADATA_FILE} is missing"
        )
    try:
        metadata = CheckpointMetadata.from_json(metadata_file.read_text())
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"cannot parse {metadata_file}: {type(exc).__name__}: {exc}") from None
    if metadata.format_version != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {metadata.format_version}; this skyrl-megatron "
            f"reads version {FORMAT_VERSION}"
        )
    return metadata


def save_hf_model(
    export_dir: str | os.PathLike,
    built_model,
    tokenizer=None,
    *,
    max_shard_bytes: int = 5 * 1024**3,
    adapters_only: bool = False,
    value_head_name: str = "value_head.weight",
) -> Path:
    """Write the model as a Hugging Face checkpoint (config, safetensors shards, tokenizer).

    `built_model` is a `skyrl_megatron.model.build.BuiltModel`. Collective: every rank takes part
    in gathering the weights (the bridge hands each rank full tensors under HF names); rank 0
    writes them shard by shard, so it holds at most one shard in memory. Published atomically
    like `save_checkpoint`; an existing export there is replaced, any other non-empty directory
    refused. A model with LoRA adapters is written merged (base + scale * BA); with
    `adapters_only`, as a PEFT adapter directory instead (adapter_config.json and
    adapter_model.safetensors, for `peft.PeftModel.from_pretrained(base, export_dir)`). A critic's
    value head is written as `value_head_name` (the host's `<value_head_prefix>.weight`), no LM head.
    """
    if adapters_only:
        return _save_peft_adapter(Path(export_dir).absolute(), built_model, tokenizer)
    final = Path(export_dir).absolute()
    _check_replaceable(final, marker="config.json", what="a Hugging Face checkpoint")
    partial = _sibling(final, _PARTIAL_SUFFIX)
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        # config, generation config and the source's tokenizer files
        built_model.bridge.hf_pretrained.save_artifacts(partial)
        if tokenizer is not None:
            tokenizer.save_pretrained(partial)
    weights = iter_hf_weights(built_model, device="cpu", value_head_name=value_head_name)  # LoRA adapters merged in
    if rank == 0:
        _write_safetensors(weights, partial, max_shard_bytes)
    else:
        for _ in weights:  # the gather is collective; only rank 0 keeps the tensors
            pass
    _commit(partial, final)
    return final


def _save_peft_adapter(final: Path, built_model, tokenizer) -> Path:
    _check_replaceable(final, marker=PEFT_CONFIG_FILE, what="a PEFT adapter directory")
    partial = _sibling(final, _PARTIAL_SUFFIX)
    adapter = PeftAdapter.export(built_model)  # collective
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        adapter.save(partial)
        if tokenizer is not None:
            tokenizer.save_pretrained(partial)
    _commit(partial, final)
    return final


def _write_safetensors(named_tensors, out_dir: Path, max_shard_bytes: int) -> None:
    """Stream (name, tensor) pairs into safetensors shards plus the index transformers reads."""
    from safetensors.torch import save_file

    shard_files: list[Path] = []
    weight_map: dict[str, int] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total_bytes = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            path = out_dir / f"model-{len(shard_files) + 1:05d}.safetensors"
            save_file(shard, path, metadata={"format": "pt"})
            shard_files.append(path)
            shard, shard_bytes = {}, 0

    for name, tensor in named_tensors:
        size = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + size > max_shard_bytes:
            flush()
        shard[name] = tensor.contiguous()
        weight_map[name] = len(shard_files)
        shard_bytes += size
        total_bytes += size
    flush()

    if len(shard_files) == 1:
        shard_files[0].rename(out_dir / "model.safetensors")
        return
    # the final names carry the shard count, known only now
    names = [f"model-{i + 1:05d}-of-{len(shard_files):05d}.safetensors" for i in range(len(shard_files))]
    for path, name in zip(shard_files, names):
        path.rename(out_dir / name)
    index = {
        "metadata": {"total_size": total_bytes},
        "weight_map": {tensor_name: names[i] for tensor_name, i in sorted(weight_map.items())},
    }
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


# ----------------------------------------------------------------------------------------------
# How Megatron writes and reads
# ----------------------------------------------------------------------------------------------


def _load_strategy(what: str):
    """Megatron's default load strategy; where ranks replicate shards, each replica reads a share and
    broadcasts it to the others, instead of every replica reading everything (in the distributed
    optimizer's `fully_reshardable` format, every rank reads its model-parallel shard's whole state).

    That exchange is a collective after dist_checkpointing's checks and the reads, where a rank that
    failed in either would leave its peers waiting. So the load, and each read in it, is one step
    of all ranks: entered together, and failing on all when it fails on one (CorruptCheckpointError
    with `what`, as the outer `_agree_on_all_ranks` raises it)."""
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    strategy = get_default_load_sharded_strategy()
    replicas = replica_group()
    if replicas is None:
        return strategy
    parallel = FullyParallelLoadStrategyWrapper(_AllRanksTogether(strategy, what), replicas)
    return _AllRanksTogether(parallel, what)


class _AllRanksTogether:
    """A load strategy whose `load` the ranks enter together and leave together: a rank that failed
    before it (in checks of `dist_checkpointing.load` that may fail on one rank alone) or inside it
    makes every rank raise. Anything else is the wrapped strategy's."""

    def __init__(self, strategy, what: str):
        self._strategy = strategy
        self._what = what

    def load(self, sharded_state_dict, checkpoint_dir, *args, **kwargs):
        # a rank that failed on the way here is waiting for its peers in `_agree_on_all_ranks` already
        _agree_on_all_ranks(lambda: None, self._what)
        return _agree_on_all_ranks(
            lambda: self._strategy.load(sharded_state_dict, checkpoint_dir, *args, **kwargs), self._what
        )

    def __getattr__(self, name: str):
        return getattr(self._strategy, name)


# ----------------------------------------------------------------------------------------------
# The sharded state
# ----------------------------------------------------------------------------------------------


def _sharded_training_state(
    chunks, optimizer, scheduler, *, is_loading: bool, with_rng: bool, model_state: str
) -> dict:
    """Megatron's sharded state dict: model chunks (all weights, or only the LoRA adapters), optimizer,
    scheduler and this rank's RNG."""
    from megatron.core import parallel_state as ps

    metadata = {
        "distrib_optim_sharding_type": OPTIMIZER_SHARDING_TYPE,
        # gather on DP rank 0 over gloo: one full copy per DP group at save, not one per rank
        "distrib_optim_fully_reshardable_mem_efficient": True,
        # no `chained_<i>.` key prefixes: they would tie the optimizer keys to the chain's shape
        "chained_optim_avoid_prefix": True,
        "singleton_local_shards": False,
        "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
    }
    state: dict[str, Any] = {}
    for index, chunk in enumerate(chunks):
        chunk_state = _unwrap(chunk).sharded_state_dict(metadata=metadata)
        if model_state == MODEL_STATE_ADAPTERS:
            chunk_state = {key: value for key, value in chunk_state.items() if is_adapter_name(key)}
        state[f"model{index}"] = chunk_state
    if optimizer is not None:
        _materialise_adam_state(optimizer)
        # the optimizer finds its parameters through the model's sharded tensors
        state["optimizer"] = optimizer.sharded_state_dict(dict(state), is_loading=is_loading, metadata=metadata)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if with_rng:
        state["rng_state"] = _rng_sharded_object(None if is_loading else _capture_rng())
    return state


def _model_state(chunks) -> str:
    """MODEL_STATE_ADAPTERS when the model carries LoRA adapters. Collective: a pipeline stage may hold
    none of the adapted modules, and all ranks must save and load the same kind of state."""
    local = any(is_adapter_name(name) for chunk in chunks for name, _ in chunk.named_parameters())
    flag = torch.tensor([int(local)], dtype=torch.int32, device=_collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return MODEL_STATE_ADAPTERS if flag.item() else MODEL_STATE_FULL


def _load_model_state(model: torch.nn.Module, state: dict, model_state: str, *, strict: bool) -> None:
    if model_state == MODEL_STATE_FULL:
        model.load_state_dict(state, strict=strict)
        return
    # Adapters only: the frozen base stays as built. Megatron-Bridge's adapter wrappers name the base
    # weights differently in state_dict() and in the module tree, so a strict load cannot be used;
    # every adapter tensor was requested from the checkpoint, which dist_checkpointing enforced.
    result = model.load_state_dict(state, strict=False)
    missing_adapters = [key for key in result.missing_keys if is_adapter_name(key)]
    if strict and (missing_adapters or result.unexpected_keys):
        raise CheckpointMismatchError(
            f"adapter state does not fit the model: missing {missing_adapters}, unexpected {result.unexpected_keys}"
        )


def _collective_device() -> torch.device:
    from skyrl_megatron.runtime import current_runtime

    return current_runtime().torch_device


def _materialise_adam_state(optimizer) -> None:
    """Give torch Adam parameters without state (no step taken yet) their initial state.

    torch's Adam creates state lazily at the first step, but Megatron's distributed optimizer,
    when it runs on torch Adam (no TE or Apex), can only describe its state once every parameter
    has a `step`. Zero moments at step 0 are exactly what the first step would create, so an
    optimizer given them behaves as a fresh one.
    """
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = inner.optimizer
        if not isinstance(torch_optimizer, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                if not torch_optimizer.state[param]:
                    torch_optimizer.state[param] = {
                        "step": torch.zeros((), dtype=torch.float32),
                        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                    }


def _load_optimizer_state(optimizer, state) -> None:
    """`optimizer.load_state_dict(state)`, working around two Megatron 0.19.2 bugs in the
    distributed optimizer on torch's Adam (no TE or Apex), whose per-parameter state holds a
    `step` tensor:
    - `_set_main_param_and_optimizer_states` asks the checkpoint for a `step` entry it never
      stores (KeyError), so the steps are set aside while the parameter state is copied in;
    - `load_state_dict` hands every parameter the same step tensor, which Adam then increments
      in place once per parameter (the resumed run's bias corrections drift), so each parameter
      gets its own copy back.
    """
    from megatron.core.optimizer import DistributedOptimizer

    parts = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    # a chain of one is saved as its only member's state; longer chains by position
    states = [state] if len(parts) == 1 else [state[index] for index in range(len(parts))]
    for part, part_state in zip(parts, states):
        if not isinstance(part, DistributedOptimizer):
            part.load_state_dict(part_state)
            continue
        param_state = part_state.pop("param_state")
        sharding_type = part_state.pop("param_state_sharding_type")
        if sharding_type != OPTIMIZER_SHARDING_TYPE:
            raise CheckpointError(f"unexpected distributed optimizer sharding type {sharding_type!r}")
        part.load_state_dict(part_state)  # param groups (lr, step), grad scaler
        adam_state = part.optimizer.state
        steps = {param: state.pop("step") for param, state in adam_state.items() if "step" in state}
        try:
            part.load_parameter_state_from_fully_reshardable(param_state)
        finally:
            for param, step in steps.items():
                adam_state[param]["step"] = step.clone()
    if len(parts) > 1:
        optimizer._synchronize_steps()


def _use_fresh_buffers(sharded: dict) -> None:
    """Point every sharded tensor at a new host buffer, so a failed read leaves the live tensors
    untouched; `load_state_dict` copies the values over afterwards. Host memory, because the
    transient second copy of the model and optimizer shards must not cost device memory."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for value in nested_values(sharded):
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and value.data is not None:
            value.data = torch.empty_like(value.data, device="cpu")


def _rng_sharded_object(rng_state: dict | None):
    """This rank's RNG states as a ShardedObject of a (world_size,) global object."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject("rng_state", rng_state, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


def _capture_rng() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from skyrl_megatron.runtime import current_runtime

    on_gpu = not current_runtime().is_cpu
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if on_gpu else None,
        # Megatron's named states (TP-decorrelated streams); empty in the CPU runtime's tracker
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def _restore_rng(rng_state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(rng_state["python"])
    np.random.set_state(rng_state["numpy"])
    torch.set_rng_state(rng_state["torch"])
    if rng_state["cuda"] is not None:
        torch.cuda.set_rng_state(rng_state["cuda"])
    get_cuda_rng_tracker().set_states(rng_state["tracker"])


def _optimizer_kind(optimizer) -> str:
    return "distributed" if optimizer.config.use_distributed_optimizer else "plain"


def _describe_optimizer(kind: str | None) -> str:
    return {
        "distributed": "distributed-optimizer state",
        "plain": "plain (non-distributed) optimizer state",
        None: "no optimizer state",
    }[kind]


# ----------------------------------------------------------------------------------------------
# Checks before loading
# ----------------------------------------------------------------------------------------------


def _check_same_model(metadata: CheckpointMetadata, chunks, path: Path) -> None:
    current = ModelIdentity.of(chunks)
    if current.fingerprint != metadata.model.fingerprint:
        raise CheckpointMismatchError(
            f"checkpoint {path} is of another model: it holds {metadata.model.description} "
            f"[{metadata.model.fingerprint}], the model to load into is {current.description} "
            f"[{current.fingerprint}]"
        )


def _check_same_model_state(metadata: CheckpointMetadata, chunks, path: Path) -> None:
    current = _model_state(chunks)
    if current != metadata.model_state:
        what = {MODEL_STATE_FULL: "a fully trained model", MODEL_STATE_ADAPTERS: "LoRA adapters only"}
        raise CheckpointMismatchError(
            f"checkpoint {path} holds {what[metadata.model_state]}, but the model to load into "
            f"{'carries' if current == MODEL_STATE_ADAPTERS else 'has no'} LoRA adapters; build it with the "
            f"LoRA settings it was saved with (trainer.policy.model.lora.rank)"
        )


def _check_files(metadata: CheckpointMetadata, path: Path) -> None:
    """Every shard file recorded at save time is there, with its size (catches deleted and
    truncated files without reading them)."""
    problems = []
    for name, size in sorted(metadata.files.items()):
        file = path / DIST_SUBDIR / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size != size:
            problems.append(f"{name} has {file.stat().st_size} bytes, {size} were written")
    if problems:
        raise CorruptCheckpointError(f"checkpoint {path} is damaged: " + "; ".join(problems))


def _agree_on_all_ranks(read, what: str):
    """Run `read` on every rank; if any rank failed, raise on all of them (nobody goes on to copy
    a partial state while a peer bails out). Calls nest: a CorruptCheckpointError out of `read` was
    agreed on inside it, by every rank, and passes on without another collective."""
    from torch.distributed.checkpoint.api import CheckpointException

    error: str | None = None
    result = None
    try:
        result = read()
    except CorruptCheckpointError:
        raise
    # torch.distributed.checkpoint reports read failures as a BaseException subclass
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported below, on every rank
        error = _describe_read_error(exc)
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failures = [f"rank {rank}: {message}" for rank, message in enumerate(errors) if message]
    if failures:
        raise CorruptCheckpointError(f"{what}: " + "; ".join(failures))
    return result


def _describe_read_error(exc: BaseException) -> str:
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException):  # its str() is a traceback per rank: keep the causes
        exc = next(iter(exc.failures.values()))[0]
    return f"{type(exc).__name__}: {exc}"


# ----------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------


def _sibling(path: Path, suffix: str) -> Path:
    """A hidden sibling of `path` on the same filesystem, so that renames between them are atomic."""
    return path.parent / f".{path.name}{suffix}"


def _check_replaceable(final: Path, *, marker: str, what: str) -> None:
    """Saving replaces what is at `final`: only an earlier save of the same kind, or nothing."""
    if final.is_dir() and any(final.iterdir()) and not (final / marker).is_file():
        raise CheckpointError(f"refusing to replace {final}: it is not empty and not {what} (no {marker})")
    if final.exists() and not final.is_dir():
        raise CheckpointError(f"refusing to replace {final}: it is a file, not a directory")


def _file_sizes(directory: Path) -> dict[str, int]:
    return {
        str(file.relative_to(directory)): file.stat().st_size
        for file in sorted(directory.rglob("*"))
        if file.is_file()
    }


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _commit(partial: Path, final: Path) -> None:
    """After every rank finished writing `partial`, rank 0 moves it to `final` (collective)."""
    dist.barrier()
    if dist.get_rank() == 0:
        _publish(partial, final)
    dist.barrier()


def _publish(partial: Path, final: Path) -> None:
    """Move the complete `partial` directory to `final`, replacing an existing one.

    A directory cannot be renamed over a non-empty one, so an existing `final` first moves aside
    to `.<name>.replaced`; it is deleted only after the new one is in place. A crash between the
    two renames leaves it there, and `read_checkpoint_metadata` points at it.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    replaced = _sibling(final, _REPLACED_SUFFIX)
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.rename(final, replaced)
    os.rename(partial, final)
    _fsync_dir(final.parent)
    shutil.rmtree(replaced, ignore_errors=True)


def _fsync_dir(directory: Path) -> None:
    """Make the renames in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    from megatron.core.utils import unwrap_model

    return unwrap_model(chunk)


def _plain(value: Any) -> Any:
    """A JSON-able stand-in for a config value (functions by name, enums by value)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if callable(value):
        return getattr(value, "__name__", type(value).__name__)
    return str(getattr(value, "value", value))


def verify_checkpoint(ckpt_dir: str | os.PathLike) -> CheckpointMetadata:
    """The metadata of a complete checkpoint; CheckpointError if it is missing, partial or truncated.

    Reads only the metadata and file sizes (no tensors, no process group), so tools and tests can vet
    a checkpoint directory before pointing a run at it.
    """
    path = Path(ckpt_dir).absolute()
    metadata = read_checkpoint_metadata(path)
    _check_files(metadata, path)
    return metadata
