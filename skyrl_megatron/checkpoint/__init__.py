"""Checkpoints: a worker's distributed training state (`training`), and Hugging Face exports (`hf_export`).

One job per module, imports only downward::

    async_save      AsyncCheckpointSaver: the same save written in the background, published by `finalize`
    latest          the host's pointer to its latest checkpoint: published once complete, repaired on resume
    training        save_checkpoint / load_checkpoint: the steps of a save and of a load
    hf_export       save_hf_model: safetensors shards or a PEFT adapter directory
    megatron_state  Megatron's sharded state dict and load strategy; its distributed-optimizer workarounds
    integrity       the metadata file (model identity, layout, file sizes) and the checks before a load
    atomic          publishing a directory by rename (a crash leaves the previous one in place)
    errors          what callers catch

The low-level Megatron write strategy is `skyrl_megatron.dist_io`, shared with the conversion cache.
"""

from skyrl_megatron.checkpoint.async_save import AsyncCheckpointSaver, SaveTimings
from skyrl_megatron.checkpoint.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from skyrl_megatron.checkpoint.hf_export import save_hf_model
from skyrl_megatron.checkpoint.integrity import (
    DIST_SUBDIR,
    METADATA_FILE,
    CheckpointMetadata,
    Layout,
    ModelIdentity,
    read_checkpoint_metadata,
    verify_checkpoint,
)
from skyrl_megatron.checkpoint.training import TOKENIZER_SUBDIR, CheckpointState, load_checkpoint, save_checkpoint

__all__ = [
    "AsyncCheckpointSaver",
    "DIST_SUBDIR",
    "METADATA_FILE",
    "SaveTimings",
    "TOKENIZER_SUBDIR",
    "CheckpointError",
    "CheckpointMetadata",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointState",
    "CorruptCheckpointError",
    "Layout",
    "ModelIdentity",
    "load_checkpoint",
    "read_checkpoint_metadata",
    "save_checkpoint",
    "save_hf_model",
    "verify_checkpoint",
]
