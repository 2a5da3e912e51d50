"""Room for a checkpoint, checked before a byte of it is written (collective).

A disk that fills during a save fails deep in the writer threads (torch's checkpoint writer, Megatron's
result queue) with a message that names neither the disk nor the fix, after minutes of writing, and, in
the background, only at the next save. The size of a save is known before it starts: the tensors each
rank writes (its main replicas) summed per node, against the free space of the node's checkpoint
directory, where checkpoints set aside for deletion (`retention.py`) count as freed.

Per node, because node-local disks each hold their node's shards; on a file system shared by the nodes,
each node's share is compared with the whole free space, which can miss a shortfall but never reports a
false one.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from skyrl_megatron.checkpoint.errors import CheckpointError
from skyrl_megatron.checkpoint.latest import STEP_PREFIX
from skyrl_megatron.checkpoint.retention import being_removed

# what a save writes besides its tensors (metadata, shard index, objects) is small; the file system keeps a margin
_MARGIN = 1.02


def bytes_to_write(sharded_state: dict) -> int:
    """The bytes of the tensors this rank writes in `sharded_state` (Megatron's sharded state dict): its main
    replicas (the data-parallel copies of a shard are written once)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import is_main_replica

    total = 0
    for value in nested_values(sharded_state):
        data = getattr(value, "data", None)
        if isinstance(data, torch.Tensor) and is_main_replica(getattr(value, "replica_id", 0)):
            total += data.numel() * data.element_size()
    return total


def ensure_room(sharded_state: dict, checkpoint: Path) -> None:
    """Raise CheckpointError on every rank when a node's share of the save of `checkpoint` does not fit on
    its disk (collective; before anything is written)."""
    host = socket.gethostname()
    mine = (host, bytes_to_write(sharded_state), _free_bytes(checkpoint))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    needed: dict[str, int] = {}
    free: dict[str, int] = {}
    for node, nbytes, node_free in everyone:
        needed[node] = needed.get(node, 0) + nbytes
        free.setdefault(node, node_free)  # the node's first rank's view of its disk
    short = {node: (needed[node], free[node]) for node in needed if needed[node] * _MARGIN > free[node]}
    if short:
        node, (need, have) = sorted(short.items())[0]
        where = f" on {node}" if len(needed) > 1 else ""
        raise CheckpointError(
            f"checkpoint {checkpoint}: {need / 2**30:.1f} GiB to write{where}, {have / 2**30:.1f} GiB free "
            f"under {_existing(checkpoint)}; nothing was written and "
            f"the previous checkpoints stay. Keep fewer checkpoints (trainer.max_ckpts_to_keep: each is about "
            f"{need / 2**30:.1f} GiB here, and one more is written before the oldest is deleted), save less "
            f"often (trainer.ckpt_interval), or point trainer.ckpt_path at a larger disk")


def _free_bytes(directory: Path) -> int:
    """Free bytes under `directory` plus the checkpoints set aside for deletion beside it."""
    free = shutil.disk_usage(_existing(directory)).free
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


def _existing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path
