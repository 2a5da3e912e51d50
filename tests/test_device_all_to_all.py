"""The device-side MoE exchange (model/moe/device_all_to_all.py, model/moe/row_exchange.py) against Megatron's path.

On 2 gloo ranks with the NVSHMEM op's stand-in (`EmulatedExchange`): dispatch and combine, forward
and gradients, bitwise equal to host split sizes + a differentiable `all_to_all_single` (as Megatron's) +
`moe_utils.sort_chunks_by_idxs`, for uneven routing with an expert that gets no row and padding rows
(NaN) that must never travel. `NvshmemExchange`'s own work (rows moved as bf16 words, padding
to 32-byte rows, the gather into its send buffer, buffer reuse, the barrier, growth) with the op's
contract played on gloo, bitwise as the stand-in. On one process, with an exchange that reads
nothing on the host, the layer-side work of both directions (index math, gathers, backward) makes
no host read.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from skyrl_megatron.model.moe.row_exchange import EmulatedExchange, NvshmemExchange
from skyrl_megatron.testing import run_on_ranks
from skyrl_megatron.testing.host_syncs import HostSyncProbe
from skyrl_megatron.testing.reference_exchange import host_splits_all_to_all

WORLD, LOCAL_EXPERTS, ROWS, HIDDEN = 2, 3, 40, 5
IDLE_EXPERT = 4  # no rank routes a row to it (rank 1's second local expert)


def _counts(rank: int) -> torch.Tensor:
    """This rank's rows per global expert: uneven, summing to ROWS, none for IDLE_EXPERT."""
    g = torch.Generator().manual_seed(7 + rank)
    weights = torch.rand(WORLD * LOCAL_EXPERTS, generator=g) ** 3 + 0.01
    weights[IDLE_EXPERT] = 0
    choices = torch.multinomial(weights, ROWS, replacement=True, generator=g)
    return torch.bincount(choices, minlength=WORLD * LOCAL_EXPERTS)


def _plan(rank: int, counts: torch.Tensor):
    import torch.distributed as dist

    from skyrl_megatron.model.moe.device_all_to_all import ExchangePlan
    from skyrl_megatron.model.moe.row_exchange import EmulatedExchange

    gathered = counts.new_empty(WORLD * counts.numel())
    dist.all_gather_into_tensor(gathered, counts)
    mine = slice(rank * LOCAL_EXPERTS, (rank + 1) * LOCAL_EXPERTS)
    received = gathered.view(WORLD, -1)[:, mine].contiguous()
    plan = ExchangePlan(EmulatedExchange(dist.group.WORLD), counts.view(WORLD, LOCAL_EXPERTS).sum(1), received,
                        rows=ROWS, capacity=WORLD * ROWS)
    return plan, received


def all_to_all(group, rows, receive, send):
    return host_splits_all_to_all(rows, receive, send)


def _reference_dispatch(rows, counts, received):
    """Megatron's path: host split sizes, a differentiable all_to_all, split-and-concatenate regrouping."""
    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

    from skyrl_megatron.model.moe.token_sort import expert_major_order

    send = counts.view(WORLD, LOCAL_EXPERTS).sum(1).tolist()
    receive = received.sum(1).tolist()
    landed = all_to_all(dist.group.WORLD, rows, receive, send)
    grouped, _ = sort_chunks_by_idxs(landed, received.flatten(), expert_major_order(WORLD, LOCAL_EXPERTS))
    return grouped


def _reference_combine(expert_rows, counts, received):
    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

    from skyrl_megatron.model.moe.token_sort import source_major_order

    send = counts.view(WORLD, LOCAL_EXPERTS).sum(1).tolist()
    receive = received.sum(1).tolist()
    by_source, _ = sort_chunks_by_idxs(expert_rows, received.t().flatten(), source_major_order(WORLD, LOCAL_EXPERTS))
    return all_to_all(dist.group.WORLD, by_source, send, receive)


def _exchange_on_rank(rank: int, world: int) -> dict:
    from skyrl_megatron.model.moe.device_all_to_all import combine, dispatch

    counts = _counts(rank)
    plan, received = _plan(rank, counts)
    total = int(received.sum())
    g = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randn(ROWS, HIDDEN, generator=g)
    grad_grouped = torch.randn(total, HIDDEN, generator=g)
    grad_back = torch.randn(ROWS, HIDDEN, generator=g)
    expert_rows = torch.randn(total, HIDDEN, generator=g)

    # dispatch: forward on the leading rows, gradient back to the tokens
    x_dev, x_ref = tokens.clone().requires_grad_(), tokens.clone().requires_grad_()
    grouped = dispatch(x_dev, plan)
    grouped_ref = _reference_dispatch(x_ref, counts, received)
    (grouped[:total] * grad_grouped).sum().backward()
    (grouped_ref * grad_grouped).sum().backward()

    # combine: padding rows are NaN, so any that travelled would show
    padded = torch.cat([expert_rows, torch.full((WORLD * ROWS - total, HIDDEN), float("nan"))])
    e_dev, e_ref = padded.clone().requires_grad_(), expert_rows.clone().requires_grad_()
    back = combine(e_dev, plan)
    back_ref = _reference_combine(e_ref, counts, received)
    (back * grad_back).sum().backward()
    (back_ref * grad_back).sum().backward()

    # round trip through a stand-in expert (exact: a doubling)
    x_trip = tokens.clone().requires_grad_()
    trip = combine(dispatch(x_trip, plan) * 2, plan)
    (trip * grad_back).sum().backward()
    return {
        "counts": counts, "received": received, "total": total, "capacity": plan.capacity,
        "dispatch": torch.equal(grouped[:total], grouped_ref),
        "dispatch_grad": torch.equal(x_dev.grad, x_ref.grad),
        "combine": torch.equal(back, back_ref),
        "combine_grad": torch.equal(e_dev.grad[:total], e_ref.grad),
        "round_trip": torch.equal(trip, tokens * 2),
        "round_trip_grad": torch.equal(x_trip.grad, grad_back * 2),
    }


@pytest.mark.slow
def test_dispatch_and_combine_equal_megatrons_path_bitwise_on_two_ranks():
    results = run_on_ranks(_exchange_on_rank, WORLD)
    for rank, r in enumerate(results):
        assert int(r["counts"][IDLE_EXPERT]) == 0 and int(r["counts"].sum()) == ROWS
        assert 0 < r["total"] < r["capacity"], "padding rows must be exercised"
        for key in ("dispatch", "dispatch_grad", "combine", "combine_grad", "round_trip", "round_trip_grad"):
            assert r[key], (rank, key)
    assert int(results[1]["received"][:, IDLE_EXPERT - LOCAL_EXPERTS].sum()) == 0  # the idle expert's chunk is empty
    assert results[0]["received"].sum(1).tolist() != results[1]["received"].sum(1).tolist()  # uneven


class _LoopbackExchange:
    """One rank's exchange without a host read: its rows land where they were (the leading ones: the
    sizes are static here), padded or cut to `out_rows`."""

    def exchange(self, send, send_splits, out_rows, take=None):
        if take is not None:
            send = send.index_select(0, take)
        out = send.new_zeros(out_rows, *send.shape[1:])
        kept = min(out_rows, send.shape[0])
        out[:kept] = send[:kept]
        return out


def test_the_layer_side_of_both_directions_makes_no_host_read():
    from skyrl_megatron.model.moe.device_all_to_all import ExchangePlan, combine, dispatch

    counts = torch.tensor([5, 0, 3, 4])
    rows = int(counts.sum())
    plan = ExchangePlan(_LoopbackExchange(), counts.sum().view(1), counts.view(1, -1), rows=rows, capacity=rows + 6)
    x = torch.randn(rows, 3, requires_grad=True)
    with HostSyncProbe() as probe:
        out = combine(dispatch(x, plan) * 3, plan)
        out.sum().backward()
    assert not probe.found, probe.report()
    assert torch.equal(out, x.detach() * 3) and torch.equal(x.grad, torch.full_like(x, 3.0))


def test_narrow_rows_are_padded_to_the_nvshmem_ops_32_bytes():
    from skyrl_megatron.model.moe.row_exchange import padded_width

    assert padded_width(2048, 2) == 2048  # bf16 hidden: as is
    assert padded_width(1, 4) == 8  # one fp32 probability per row
    assert padded_width(5, 2) == 16


class _NvshmemOnGloo(NvshmemExchange):
    """`NvshmemExchange` with plain buffers and the op's contract played on gloo (host splits: the op's
    reads of its splits happen on the device; what is checked is everything around the op)."""

    def __init__(self, group):
        self.group, self.group_name, self.world = group, group.group_name, group.size()
        self._buffers, self._last = {}, None
        self.allocations, self.barriers = [], 0

    def _new_buffers(self, send_rows, out_rows, width, device):
        self.allocations.append((send_rows, out_rows, width))
        nan = float("nan")  # stale rows cannot pass unseen
        return SimpleNamespace(send_rows=send_rows, out_rows=out_rows,
                               input=torch.full((send_rows, width), nan, dtype=torch.bfloat16),
                               out=torch.full((out_rows, width), nan, dtype=torch.bfloat16),
                               in_splits=torch.zeros(self.world, dtype=torch.int64),
                               out_splits_offsets=torch.zeros(2, self.world, dtype=torch.int64))

    def _wait_for_peers(self, device):
        self.barriers += 1
        super()._wait_for_peers(device)

    def _run_op(self, b):
        received = torch.empty_like(b.in_splits)
        dist.all_to_all_single(received, b.in_splits)
        send, receive = b.in_splits.tolist(), received.tolist()
        # whole rows of bf16 words, moved as float16 (gloo has no bf16; a copy keeps the bits)
        dist.all_to_all_single(b.out.view(torch.float16)[: sum(receive)], b.input.view(torch.float16)[: sum(send)], receive, send)
        b.out_splits_offsets[0].copy_(received)
        b.out_splits_offsets[1].copy_(torch.cumsum(received, 0) - received)


def _transport_on_rank(rank: int, world: int) -> dict:
    from skyrl_megatron.model.moe.device_all_to_all import ExchangePlan, combine, dispatch

    counts = _counts(rank)
    _, received = _plan(rank, counts)
    nvshmem = _NvshmemOnGloo(dist.group.WORLD)
    results = {}
    g = torch.Generator().manual_seed(300 + rank)
    cases = {"fp32_rows_padded": torch.randn(ROWS, HIDDEN, generator=g),
             "fp32_probs": torch.rand(ROWS, generator=g),
             "bf16_rows_unpadded": torch.randn(ROWS, 16, generator=g).to(torch.bfloat16)}
    for name, rows in cases.items():
        outputs = []
        for exchange in (nvshmem, EmulatedExchange(dist.group.WORLD)):
            plan = ExchangePlan(exchange, counts.view(WORLD, LOCAL_EXPERTS).sum(1), received, rows=ROWS, capacity=WORLD * ROWS)
            x = rows.clone().requires_grad_()
            grouped = dispatch(x, plan)
            back = combine(grouped * 2, plan)
            (back.float() * torch.arange(back.numel()).view_as(back)).sum().backward()
            outputs.append((grouped[: int(received.sum())].detach(), back.detach(), x.grad))
        results[name] = all(torch.equal(a, b) for a, b in zip(*outputs))
    # two dispatches in a row use the same buffers: the second waits for the peers first
    plan = ExchangePlan(nvshmem, counts.view(WORLD, LOCAL_EXPERTS).sum(1), received, rows=ROWS, capacity=WORLD * ROWS)
    before = nvshmem.barriers
    first, second = dispatch(cases["bf16_rows_unpadded"], plan).clone(), dispatch(cases["bf16_rows_unpadded"], plan)
    results["back_to_back_barriers"] = nvshmem.barriers - before
    total = int(received.sum())
    results["back_to_back_equal"] = torch.equal(first[:total], second[:total])
    # a larger micro-batch: the buffers grow (collectively, after a barrier)
    big = torch.cat([cases["bf16_rows_unpadded"]] * 40)
    big_plan = ExchangePlan(nvshmem, counts.view(WORLD, LOCAL_EXPERTS).sum(1) * 40, received * 40, rows=ROWS * 40,
                            capacity=WORLD * ROWS * 40)
    emulated_plan = ExchangePlan(EmulatedExchange(dist.group.WORLD), big_plan.send_splits, big_plan.received_counts,
                                 rows=big_plan.rows, capacity=big_plan.capacity)
    results["grown_equal"] = torch.equal(combine(dispatch(big, big_plan), big_plan), combine(dispatch(big, emulated_plan), emulated_plan))
    results["allocations"] = nvshmem.allocations
    return results


@pytest.mark.slow
def test_the_nvshmem_transports_own_work_matches_the_stand_in_bitwise():
    for r in run_on_ranks(_transport_on_rank, WORLD):
        assert r["fp32_rows_padded"] and r["fp32_probs"] and r["bf16_rows_unpadded"]
        assert r["back_to_back_barriers"] == 1 and r["back_to_back_equal"]
        assert r["grown_equal"]
        # one set per direction and width (words: 5 fp32 -> 10 -> 16; 1 fp32 -> 2 -> 16; 16 bf16), rows in
        # steps of 1024; width 16 is shared by all three cases, so 2 sets, then the 2 grown ones
        assert r["allocations"] == [(1024, 1024, 16), (1024, 1024, 16), (2048, 4096, 16), (4096, 2048, 16)], r["allocations"]
