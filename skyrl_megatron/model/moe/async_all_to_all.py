"""An all-to-all of rows that runs while the caller goes on: started now, waited for where its result is needed.

Megatron's `all_to_all` (tensor_parallel/mappings.py) waits for its collective before it returns,
in the forward and in the backward alike. Here one exchange is two autograd functions around one
in-flight collective (`async_op=True`: on GPUs NCCL's own stream, on CPU gloo's worker threads):

    pending = start_all_to_all(rows, group, sent, received)   # the exchange is queued
    ...                                                        # other work, e.g. another half's experts
    landed = pending.wait()                                   # the result, safe to read from here on

The backward runs the same way in reverse: the gradient of `wait` starts the reverse exchange and
the gradient of `start` waits for it, so whatever autograd runs between the two (the other half's
backward, see `model/moe/split_overlap.py`) overlaps it. The values are those of a blocking
`all_to_all_single` (a copy of rows); only when the caller may read them changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class _Exchange:
    """One exchange's group and split sizes (host lists, as Megatron's dispatcher has them after its
    wait for the counts), and the collectives in flight: the forward's, then the backward's (with the
    tensor it fills)."""

    group: dist.ProcessGroup
    sent: list[int]  # rows this rank sends to each rank of the group
    received: list[int]  # rows it receives from each
    forward_work: dist.Work | None = None
    backward_in_flight: tuple[Tensor, dist.Work] | None = None


def _launch(rows: Tensor, output_rows: int, output_splits: list[int], input_splits: list[int], group) -> tuple[Tensor, dist.Work]:
    rows = rows.contiguous()
    out = rows.new_empty((output_rows, *rows.shape[1:]))
    work = dist.all_to_all_single(out, rows, output_split_sizes=output_splits, input_split_sizes=input_splits,
                                  group=group, async_op=True)
    return out, work


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: Tensor, exchange: _Exchange) -> Tensor:
        ctx.exchange = exchange
        out, exchange.forward_work = _launch(rows, sum(exchange.received), exchange.received, exchange.sent, exchange.group)
        return out

    @staticmethod
    def backward(ctx, grad_landing: Tensor):
        # grad_landing is _Wait's pass-through; the rows' gradient is the reverse exchange it started
        exchange = ctx.exchange
        grad_rows, work = exchange.backward_in_flight
        exchange.backward_in_flight = None
        work.wait()
        return grad_rows, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, landed: Tensor, exchange: _Exchange) -> Tensor:
        ctx.exchange = exchange
        exchange.forward_work.wait()
        exchange.forward_work = None
        return landed

    @staticmethod
    def backward(ctx, grad_landed: Tensor):
        exchange = ctx.exchange
        exchange.backward_in_flight = _launch(grad_landed, sum(exchange.sent), exchange.sent, exchange.received,
                                              exchange.group)
        return grad_landed, None  # read by nobody: _Start's backward returns the exchange's result


class PendingAllToAll:
    """An exchange in flight; `wait()` returns its result (once)."""

    def __init__(self, landing: Tensor, exchange: _Exchange):
        self._landing, self._exchange = landing, exchange

    def wait(self) -> Tensor:
        landed = _Wait.apply(self._landing, self._exchange)
        self._landing = None
        return landed


def start_all_to_all(rows: Tensor, group: dist.ProcessGroup, sent, received) -> PendingAllToAll:
    """Start sending `rows` (grouped by destination rank, `sent[i]` rows to rank i) and receiving
    `received[i]` rows from each rank i of `group`, as `all_to_all_single` would; see the module docstring."""
    exchange = _Exchange(group, [int(n) for n in sent], [int(n) for n in received])
    return PendingAllToAll(_Start.apply(rows, exchange), exchange)
