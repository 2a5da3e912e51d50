"""The device-side MoE exchange (model/device_all_to_all.py, model/row_exchange.py) against Megatron's path.

On 2 gloo ranks with the NVSHMEM op's stand-in (`EmulatedExchange`): dispatch and combine, forward
and gradients, bitwise equal to host split sizes + a differentiable `all_to_all_single` (as Megatron's) +
`moe_utils.sort_chunks_by_idxs`, for uneven routing with an expert that gets no row and padding rows
(NaN) that must never travel. On one process, with an exchange that reads nothing on the host, the
layer-side work of both directions (index math, gathers, backward) makes no host read.
"""

from __future__ import annotations

import torch

from skyrl_megatron.testing import run_on_ranks
from skyrl_megatron.testing.host_syncs import HostSyncProbe

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

    from skyrl_megatron.model.device_all_to_all import ExchangePlan
    from skyrl_megatron.model.row_exchange import EmulatedExchange

    gathered = counts.new_empty(WORLD * counts.numel())
    dist.all_gather_into_tensor(gathered, counts)
    mine = slice(rank * LOCAL_EXPERTS, (rank + 1) * LOCAL_EXPERTS)
    received = gathered.view(WORLD, -1)[:, mine].contiguous()
    plan = ExchangePlan(EmulatedExchange(dist.group.WORLD), counts.view(WORLD, LOCAL_EXPERTS).sum(1), received,
                        rows=ROWS, capacity=WORLD * ROWS)
    return plan, received


class _HostSplitsAllToAll(torch.autograd.Function):
    """Megatron's `tensor_parallel.all_to_all` (host split sizes; the backward swaps them), which
    allocates on a CUDA device and so cannot run here."""

    @staticmethod
    def forward(ctx, rows, receive, send):
        import torch.distributed as dist

        ctx.receive, ctx.send = receive, send
        out = rows.new_empty(sum(receive), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), receive, send)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _HostSplitsAllToAll.apply(grad, ctx.send, ctx.receive), None, None


def all_to_all(group, rows, receive, send):
    return _HostSplitsAllToAll.apply(rows, receive, send)


def _reference_dispatch(rows, counts, received):
    """Megatron's path: host split sizes, a differentiable all_to_all, split-and-concatenate regrouping."""
    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

    from skyrl_megatron.model.token_sort import expert_major_order

    send = counts.view(WORLD, LOCAL_EXPERTS).sum(1).tolist()
    receive = received.sum(1).tolist()
    landed = all_to_all(dist.group.WORLD, rows, receive, send)
    grouped, _ = sort_chunks_by_idxs(landed, received.flatten(), expert_major_order(WORLD, LOCAL_EXPERTS))
    return grouped


def _reference_combine(expert_rows, counts, received):
    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

    from skyrl_megatron.model.token_sort import source_major_order

    send = counts.view(WORLD, LOCAL_EXPERTS).sum(1).tolist()
    receive = received.sum(1).tolist()
    by_source, _ = sort_chunks_by_idxs(expert_rows, received.t().flatten(), source_major_order(WORLD, LOCAL_EXPERTS))
    return all_to_all(dist.group.WORLD, by_source, send, receive)


def _exchange_on_rank(rank: int, world: int) -> dict:
    from skyrl_megatron.model.device_all_to_all import combine, dispatch

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

    def exchange(self, send, send_splits, out_rows):
        out = send.new_zeros(out_rows, *send.shape[1:])
        kept = min(out_rows, send.shape[0])
        out[:kept] = send[:kept]
        return out


def test_the_layer_side_of_both_directions_makes_no_host_read():
    from skyrl_megatron.model.device_all_to_all import ExchangePlan, combine, dispatch

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
    from skyrl_megatron.model.row_exchange import padded_width

    assert padded_width(2048, 2) == 2048  # bf16 hidden: as is
    assert padded_width(1, 4) == 8  # one fp32 probability per row
    assert padded_width(5, 2) == 16
