"""Whether a collective write of a Megatron sharded state fits the disks it goes to, known before a byte is written.

A disk that fills during `dist_checkpointing.save` fails deep in the writer threads (torch's checkpoint writer,
Megatron's result queue: `AssertionError: <class 'RuntimeError'>`), naming neither the disk nor the fix. The size
is known up front: the tensors each rank writes (its main replicas), summed per node, against the free space the
node's first rank sees. Per node, because node-local disks each hold their node's shards; on a file system the
nodes share, each node's share is compared with the whole free space, which can miss a shortfall but never
reports a false one. Used by checkpoint saves (`checkpoint/space.py`), the HF export (`checkpoint/hf_export.py`:
all of it on rank 0's node) and the conversion cache's entries.
"""

from __future__ import annotations

import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

# what a save writes besides its tensors (metadata, shard index, objects) is small; the file system keeps a margin
MARGIN = 1.02


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


@dataclass(frozen=True)
class Shortfall:
    node: str
    needed: int  # bytes the node's ranks write
    free: int  # bytes free where they write
    nodes: int  # how many nodes write

    def describe(self, directory: Path) -> str:
        """'<n> GiB to write[ on <node>], <m> GiB free under <the part of `directory` that exists>'; the node is
        named where more than one node writes."""
        where = f" on {self.node}" if self.nodes > 1 else ""
        return (f"{self.needed / 2**30:.1f} GiB to write{where}, {self.free / 2**30:.1f} GiB free under "
                f"{existing(directory)}")


def node_shortfall(nbytes: int, room: int) -> Shortfall | None:
    """Collective (every rank, the same answer): the first node, by name, whose ranks' `nbytes` do not fit in the
    `room` (free bytes) its first rank reported; None where every node's share fits."""
    mine = (socket.gethostname(), nbytes, room)
    everyone: list = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    needed: dict[str, int] = {}
    free: dict[str, int] = {}
    for node, node_bytes, node_free in everyone:
        needed[node] = needed.get(node, 0) + node_bytes
        free.setdefault(node, node_free)  # the node's first rank's view of its disk
    short = sorted(node for node in needed if needed[node] * MARGIN > free[node])
    if not short:
        return None
    return Shortfall(short[0], needed[short[0]], free[short[0]], len(needed))


def existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (whose file system a new `path` would be on)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path


def free_bytes(path: Path) -> int:
    """Free bytes on the file system that `path` is (or, not there yet, would be) on."""
    return shutil.disk_usage(existing(path)).free
