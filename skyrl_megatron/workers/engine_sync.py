"""Weight sync to our HF engines over our own broadcast group (where the host has no sender for them).

skyrl 0.4 sends weights to vLLM servers through HTTP-driven transfer engines; our HF engines sit behind
``engines.client.EngineClient`` instead. The policy's rank 0 meets the engines once
(:meth:`EngineBroadcastSender.connect`); each sync then streams the exported HF tensors in buckets:
rank 0 announces a bucket (names, dtypes, shapes), the engines start receiving, rank 0 broadcasts the
tensors, and each engine checks the whole bucket before it writes any of it.
"""

from __future__ import annotations

import asyncio

import torch

from skyrl_megatron.engines.broadcast import BroadcastGroup, BroadcastRendezvous
from skyrl_megatron.engines.weight_updates import TensorAnnouncement
from skyrl_megatron.weights import WeightBucket

# Bounds what an engine holds besides its model while a bucket arrives.
BUCKET_BYTES = 512 * 2**20


def is_engine_client(client) -> bool:
    """Whether the host handed the workers our engine client (else: the host's own, e.g. vLLM's)."""
    return callable(getattr(client, "join_weight_broadcast", None))


class EngineBroadcastSender:
    """The policy's side of the sync. Every rank holds one (the export is collective); rank 0 sends."""

    def __init__(self, client, group: BroadcastGroup | None):
        self.client = client
        self.group = group

    @classmethod
    async def connect(cls, client, *, on_gpu: bool, timeout_s: float = 600.0) -> EngineBroadcastSender:
        """Collective over the policy's ranks: rank 0 and the engines form the broadcast group, whose
        broadcasts give up on an engine after `timeout_s` (the policy's collective timeout)."""
        group = None
        if torch.distributed.get_rank() == 0:
            rendezvous = BroadcastRendezvous.on_this_host(client.num_engines + 1, backend="nccl" if on_gpu else "gloo",
                                                          timeout_s=timeout_s)
            joined = client.join_weight_broadcast(rendezvous)
            group = await asyncio.to_thread(BroadcastGroup, rendezvous, 0)
            await asyncio.gather(*joined)
        torch.distributed.barrier()
        return cls(client, group)

    async def send(self, buckets) -> int:
        """Broadcast every bucket of `buckets` (iterated on every rank); the tensor count sent."""
        sent = 0
        for bucket in buckets:
            if self.group is not None:
                await self._send_bucket(bucket)
            sent += len(bucket.names)
        return sent

    async def _send_bucket(self, bucket: WeightBucket) -> None:
        announcement = TensorAnnouncement(
            names=tuple(bucket.names), dtypes=tuple(bucket.dtypes), shapes=tuple(tuple(s) for s in bucket.shapes)
        )
        received = self.client.receive_broadcast(announcement)
        device = self.group.device
        try:
            for tensor in bucket.tensors:
                self.group.broadcast(tensor.to(device).contiguous())
            await asyncio.gather(*received)
        except Exception as error:  # noqa: BLE001 - an engine that died (or failed its check): named
            raise await self.client.engine_failure("a weight sync", error) from error
