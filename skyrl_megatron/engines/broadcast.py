"""A broadcast group of its own between the trainer's rank 0 and the engines (host-free).

Used where the host has no sender for our engines (skyrl 0.4 syncs weights to vLLM servers over
HTTP-driven transfers). The group is a bare c10d backend on its own TCP store: it is not registered
with ``torch.distributed``, so it lives beside the trainer's default world (Megatron's groups) without
touching it, and an engine process needs no default world at all.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class BroadcastRendezvous:
    """Where and how the group meets: rank 0 (the trainer) hosts the store."""

    address: str
    port: int
    world_size: int
    backend: str = "gloo"
    timeout_s: float = 600.0

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"broadcast backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.world_size < 2:
            raise ValueError(f"a broadcast group needs the sender and at least one engine, got world size {self.world_size}")

    @classmethod
    def on_this_host(cls, world_size: int, backend: str = "gloo", timeout_s: float = 600.0) -> BroadcastRendezvous:
        """A rendezvous on this machine's address and a free port (call where rank 0 will run)."""
        import ray

        address = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return cls(address=address, port=port, world_size=world_size, backend=backend, timeout_s=timeout_s)


class BroadcastGroup:
    """One member of the group; rank 0 sends, every other rank receives."""

    def __init__(self, rendezvous: BroadcastRendezvous, rank: int):
        if not 0 <= rank < rendezvous.world_size:
            raise ValueError(f"rank {rank} outside a group of {rendezvous.world_size}")
        timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
        self.rank, self.rendezvous = rank, rendezvous
        self._store = dist.TCPStore(
            rendezvous.address, rendezvous.port, rendezvous.world_size, is_master=rank == 0, timeout=timeout
        )
        if rendezvous.backend == "gloo":
            self._backend = dist.ProcessGroupGloo(self._store, rank, rendezvous.world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._backend = dist.ProcessGroupNCCL(self._store, rank, rendezvous.world_size, options)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self.rendezvous.backend == "gloo" else torch.device("cuda", torch.cuda.current_device())

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """In place from rank 0 to every rank; `tensor` must be on :attr:`device` and contiguous."""
        self._backend.broadcast(tensor, 0).wait()
        return tensor
