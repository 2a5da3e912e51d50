"""Publishing a directory atomically: write into a hidden `.<name>.partial` sibling, then rename it into place.

An existing directory at the final path is replaced only once the new one is complete (moved aside to
`.<name>.replaced`, deleted after the rename), so a crash mid-save leaves the previous one in place.
Used by the training checkpoints and the Hugging Face exports alike.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch.distributed as dist

from skyrl_megatron.checkpoint.errors import CheckpointError

PARTIAL_SUFFIX = ".partial"
REPLACED_SUFFIX = ".replaced"


def sibling(path: Path, suffix: str) -> Path:
    """A hidden sibling of `path` on the same filesystem, so that renames between them are atomic."""
    return path.parent / f".{path.name}{suffix}"


def check_replaceable(final: Path, *, marker: str, what: str) -> None:
    """Saving replaces what is at `final`: only an earlier save of the same kind, or nothing."""
    if final.is_dir() and any(final.iterdir()) and not (final / marker).is_file():
        raise CheckpointError(f"refusing to replace {final}: it is not empty and not {what} (no {marker})")
    if final.exists() and not final.is_dir():
        raise CheckpointError(f"refusing to replace {final}: it is a file, not a directory")


def write_durably(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def commit(partial: Path, final: Path) -> None:
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
    replaced = sibling(final, REPLACED_SUFFIX)
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
