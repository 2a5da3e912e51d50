"""A count of the changes to this process's training state: optimizer steps and checkpoint loads.

A host copy of the state is only as good as the moment it was taken. Whoever keeps one for later use (the
offloader parking tensors from a background checkpoint's staging, `workers/offload.py`) notes the count when
the copy is made and uses the copy only while the count has not moved. Every path that writes model weights or
optimizer state after start-up goes through `optim.optimizer_step` or `checkpoint.load_checkpoint`, and both
record here.
"""

from __future__ import annotations

_changes = 0


def record() -> None:
    """The training state is about to change (or may have: callers record before they write)."""
    global _changes
    _changes += 1


def count() -> int:
    return _changes
