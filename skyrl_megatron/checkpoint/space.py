"""Room for a checkpoint, checked before a byte of it is written (collective).

A disk that fills during a save fails deep in the writer threads after minutes of writing, and, in the
background, only at the next save. The size of a save is known before it starts (`disk_room.py`: each
rank's main replicas, summed per node, against the free space of the node's checkpoint directory); here
checkpoints set aside for deletion (`retention.py`) count as freed.
"""

from __future__ import annotations

import os
from pathlib import Path

from skyrl_megatron.checkpoint.errors import CheckpointError
from skyrl_megatron.checkpoint.latest import STEP_PREFIX
from skyrl_megatron.checkpoint.retention import being_removed
from skyrl_megatron.disk_room import bytes_to_write, free_bytes, node_shortfall


def ensure_room(sharded_state: dict, checkpoint: Path) -> None:
    """Raise CheckpointError on every rank when a node's share of the save of `checkpoint` does not fit on
    its disk (collective; before anything is written)."""
    short = node_shortfall(bytes_to_write(sharded_state), _free_bytes(checkpoint))
    if short is not None:
        raise CheckpointError(
            f"checkpoint {checkpoint}: {short.describe(checkpoint)}; nothing was written and "
            f"the previous checkpoints stay. Keep fewer checkpoints (trainer.max_ckpts_to_keep: each is about "
            f"{short.needed / 2**30:.1f} GiB here, and one more is written before the oldest is deleted), save less "
            f"often (trainer.ckpt_interval), or point trainer.ckpt_path at a larger disk")


def _free_bytes(directory: Path) -> int:
    """Free bytes under `directory` plus the checkpoints set aside for deletion beside it."""
    free = free_bytes(directory)
    # <ckpt_path>/global_step_<N>/<role>/...: the set-aside checkpoints are under <ckpt_path>
    for parent in Path(directory).absolute().parents:
        if parent.name.startswith(STEP_PREFIX):
            free += sum(_tree_bytes(path) for path in being_removed(parent.parent))
            break
    return free


def _tree_bytes(path: Path) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except FileNotFoundError:  # deleted meanwhile
                pass
    return total
