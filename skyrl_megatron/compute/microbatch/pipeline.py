"""rows -> plan -> pack -> shard -> model inputs and targets: a rank's rows as the micro-batches
`ModelRunner` hands to Megatron's schedules, prepared in one pass, each step called once per micro-batch
and in that order."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from skyrl_megatron.compute.microbatch.micro_batch import MicroBatch, micro_batch
from skyrl_megatron.compute.microbatch.pack import pack
from skyrl_megatron.compute.microbatch.plan import MicroBatching, plan_schedule
from skyrl_megatron.compute.microbatch.rows import HostRows
from skyrl_megatron.compute.microbatch.shard import shard
from skyrl_megatron.parallel import ParallelConfig


@dataclass
class MicroBatches:
    """A schedule call's micro-batches and the (rows, columns) shape the schedule is told."""

    micro_batches: list[MicroBatch]
    shape: tuple[int, int]


def prepare_micro_batches(
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    batching: MicroBatching,
    parallel: ParallelConfig,
    *,
    device: torch.device,
    pad_token_id: int = 0,
    equal_token_counts: bool = False,
    response: Mapping[str, torch.Tensor] | None = None,
    routes: torch.Tensor | None = None,
    with_routes: bool = False,
    with_real_tokens: bool = False,
) -> MicroBatches:
    """This rank's rows `sequences` [B, S] as micro-batches (collective: ranks agree on the count).

    `response` [B, A] tensors are sliced per micro-batch; `with_real_tokens` adds the real-token mask
    (MoE router metrics). With `with_routes` (routing replay), each micro-batch carries `routes`
    [B, S, L, k] (host columns; None: record only) in the order the routers see its tokens.
    """
    # 1. rows: where each row's real tokens are, and their labels
    rows = HostRows.from_batch(sequences, attention_mask)
    # 2. plan: which rows go together, how many micro-batches, where each one's tokens go
    schedule = plan_schedule(rows.spans.length, batching, parallel, equal_token_counts=equal_token_counts, device=device)
    micro_batches = []
    for layout in schedule.micro_batches:
        # 3. pack: the model layout of every per-token tensor
        packed = pack(
            rows, layout, pad_token_id=pad_token_id, routes=routes, with_routes=with_routes,
            with_real_tokens=with_real_tokens,
        )
        # 4. shard: this rank's share under CP (and the routers' under SP)
        share = shard(packed, parallel)
        # 5. model inputs and targets, on the device
        micro_batches.append(micro_batch(packed.inputs, share, layout.rows, response, device))
    return MicroBatches(micro_batches, schedule.shape)
