"""What a checkpoint says about itself, and the checks made before a tensor is read.

`skyrl_megatron_checkpoint.json` records the format version, the model's identity (a hash of the
architecture fields), the layout that saved it, the step, the caller's `extra`, the kind of model
state (full, or LoRA adapters only) and the size of every shard file. Loading checks the model's
identity and the files (present, with their recorded sizes) first; `verify_checkpoint` runs the file
checks, and checks torch's shard index against the files (`check_shard_index`, also run before a save is
published), without a process group.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from skyrl_megatron.checkpoint.atomic import REPLACED_SUFFIX, sibling
from skyrl_megatron.checkpoint.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)

FORMAT_VERSION = 1
METADATA_FILE = "skyrl_megatron_checkpoint.json"
DIST_SUBDIR = "dist"
MODEL_STATE_FULL = "full"
MODEL_STATE_ADAPTERS = "adapters"

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


@dataclass(frozen=True)
class ModelIdentity:
    """A hash of the architecture fields (what must match to load the weights) and a readable name."""

    fingerprint: str
    description: str

    @classmethod
    def of(cls, chunks: Sequence[torch.nn.Module]) -> "ModelIdentity":
        model = unwrap(chunks[0])
        config = model.config
        fields = {name: _plain(getattr(config, name, None)) for name in _ARCHITECTURE_FIELDS}
        # GPTModel keeps the (possibly padded) vocabulary size on the module, not on its config
        fields["vocab_size"] = getattr(model, "vocab_size", fields["vocab_size"])
        value_head = bool(getattr(model, "ends_in_value_head", False))  # set on every stage's chunks
        if value_head:  # a critic (model/adapters/value_head.py): never interchangeable with an LM's checkpoint
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



def read_checkpoint_metadata(ckpt_dir: str | os.PathLike) -> CheckpointMetadata:
    """The metadata of the checkpoint at `ckpt_dir`, with clear errors for missing or broken ones."""
    path = Path(ckpt_dir).absolute()
    if not path.is_dir():
        hint = ""
        replaced = sibling(path, REPLACED_SUFFIX)
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


def check_same_model(metadata: CheckpointMetadata, chunks, path: Path) -> None:
    current = ModelIdentity.of(chunks)
    if current.fingerprint != metadata.model.fingerprint:
        raise CheckpointMismatchError(
            f"checkpoint {path} is of another model: it holds {metadata.model.description} "
            f"[{metadata.model.fingerprint}], the model to load into is {current.description} "
            f"[{current.fingerprint}]"
        )


def check_model_state(metadata: CheckpointMetadata, current: str, path: Path) -> None:
    """The checkpoint holds the kind of model state (`current`: full or adapters) the model needs."""
    if current != metadata.model_state:
        what = {MODEL_STATE_FULL: "a fully trained model", MODEL_STATE_ADAPTERS: "LoRA adapters only"}
        raise CheckpointMismatchError(
            f"checkpoint {path} holds {what[metadata.model_state]}, but the model to load into "
            f"{'carries' if current == MODEL_STATE_ADAPTERS else 'has no'} LoRA adapters; build it with the "
            f"LoRA settings it was saved with (trainer.policy.model.lora.rank)"
        )


def check_files(metadata: CheckpointMetadata, path: Path) -> None:
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


def check_shard_index(ckpt_dir: Path) -> None:
    """Every byte range that torch.distributed.checkpoint's index (`.metadata`) points at lies inside
    a written shard file: the index and the files agree, so each tensor the index lists can be read.

    Run on a save before it is published (synchronous and background saves alike); reads the index
    only, no tensor."""
    from torch.distributed.checkpoint import FileSystemReader

    dist_dir = ckpt_dir / DIST_SUBDIR
    try:
        index = FileSystemReader(str(dist_dir)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any failure to read it means the save is unusable
        raise CorruptCheckpointError(f"{dist_dir}: cannot read the shard index .metadata ({type(exc).__name__}: {exc})") from None
    ends: dict[str, int] = {}
    for info in (index.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, end in sorted(ends.items()):
        file = dist_dir / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size < end:
            problems.append(f"{name} has {file.stat().st_size} bytes, the index reads up to byte {end}")
    if problems:
        raise CorruptCheckpointError(f"{dist_dir}: shard index and files disagree: " + "; ".join(problems))


def verify_checkpoint(ckpt_dir: str | os.PathLike) -> CheckpointMetadata:
    """The metadata of a complete checkpoint; CheckpointError if it is missing, partial or truncated.

    Reads only the metadata and file sizes (no tensors, no process group), so tools and tests can vet
    a checkpoint directory before pointing a run at it.
    """
    path = Path(ckpt_dir).absolute()
    metadata = read_checkpoint_metadata(path)
    check_files(metadata, path)
    check_shard_index(path)
    return metadata


def file_sizes(directory: Path) -> dict[str, int]:
    return {
        str(file.relative_to(directory)): file.stat().st_size
        for file in sorted(directory.rglob("*"))
        if file.is_file()
    }


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    from megatron.core.utils import unwrap_model

    return unwrap_model(chunk)


def _plain(value: Any) -> Any:
    """A JSON-able stand-in for a config value (functions by name, enums by value)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if callable(value):
        return getattr(value, "__name__", type(value).__name__)
    return str(getattr(value, "value", value))
