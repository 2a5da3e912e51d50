"""The errors of saving and loading checkpoints (what a caller catches)."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint directory at the given path."""


class CorruptCheckpointError(CheckpointError):
    """The checkpoint is incomplete or damaged (missing or truncated files, unreadable metadata)."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint belongs to another model, or holds no state for what the caller asked to load."""
