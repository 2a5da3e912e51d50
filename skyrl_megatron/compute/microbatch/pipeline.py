"""rows -> plan -> pack -> shard -> model inputs and targets: a rank's rows as the micro-batches
`ModelRunner` hands to Megatron's schedules. Rows and plan are done for all micro-batches at once (the plan is
collective: ranks agree on the count); pack, shard and the copy to the device per micro-batch, each step called
once per micro-batch and in that order, when the schedule first asks for it: only the first micro-batch's
preparation stands before the first kernel, the others run on the host while the device computes (their copies
are pinned and non-blocking, `micro_batch.py`, so that they do not wait for the device). Before, the whole
preparation preceded the schedule with the device idle: about 30 ms of a Qwen3-4B training call (profiled
2026-12-03 on an H200) and 15-22 ms of one at the Qwen3-30B-A3B widths (2026-12-04)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from skyrl_megatron.compute.microbatch.micro_batch import MicroBatch, micro_batch
from skyrl_megatron.compute.microbatch.pack import pack
from skyrl_megatron.compute.microbatch.plan import MicroBatchLayout, MicroBatching, plan_schedule
from skyrl_megatron.compute.microbatch.rows import HostRows
from skyrl_megatron.compute.microbatch.shard import shard
from skyrl_megatron.parallel import ParallelConfig


class PreparedOnDemand(Sequence[MicroBatch]):
    """Micro-batches, each prepared from its layout the first time it is asked for and kept after (the
    schedule asks in order; the results' way back asks again)."""

    def __init__(self, layouts: Sequence[MicroBatchLayout], prepare: Callable[[MicroBatchLayout], MicroBatch]):
        self._layouts, self._prepare = list(layouts), prepare
        self._prepared: list[MicroBatch | None] = [None] * len(self._layouts)

    def __len__(self) -> int:
        return len(self._layouts)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if self._prepared[index] is None:  # IndexError past the end, as a list (and iteration) expects
            with torch.profiler.record_function("skyrl_megatron.prepare_micro_batch"):
                self._prepared[index] = self._prepare(self._layouts[index])
        return self._prepared[index]

    @property
    def prepared(self) -> int:
        """How many micro-batches are prepared so far."""
        return sum(mb is not None for mb in self._prepared)


@dataclass
class MicroBatches:
    """A schedule call's micro-batches and the (rows, columns) shape the schedule is told."""

    micro_batches: Sequence[MicroBatch]
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

    def prepare(layout: MicroBatchLayout) -> MicroBatch:
        # 3. pack: the model layout of every per-token tensor
        packed = pack(
            rows, layout, pad_token_id=pad_token_id, routes=routes, with_routes=with_routes,
            with_real_tokens=with_real_tokens,
        )
        # 4. shard: this rank's share under CP (and the routers' under SP)
        share = shard(packed, parallel)
        # 5. model inputs and targets, on the device
        return micro_batch(packed.inputs, share, layout.rows, response, device)

    return MicroBatches(PreparedOnDemand(schedule.micro_batches, prepare), schedule.shape)
