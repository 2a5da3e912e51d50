"""`model/token_sort.py`'s chunk index for the device all-to-all: the gather that regroups received rows
expert-major equals Megatron's split-and-concatenate regrouping, stays inside a worst-case-sized buffer, and its
way back inverts it."""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron.model.moe.token_sort import chunk_gather_index, chunk_order_rows, expert_major_order, source_major_order
from skyrl_megatron.testing.reference_exchange import split_and_concatenate


def _counts(world, local_experts, seed, zero_share=0.3):
    generator = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 9, (world * local_experts,), generator=generator)
    counts[torch.rand(counts.shape, generator=generator) < zero_share] = 0  # empty chunks
    return counts


@pytest.mark.parametrize("world,local_experts", [(2, 4), (2, 64), (4, 3)])
def test_regroup_index_equals_chunk_order_rows_and_megatron(world, local_experts):
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

    for seed in range(5):
        counts = _counts(world, local_experts, seed)
        total = int(counts.sum())
        capacity = total + 37  # padding past the data, as on the device (worst-case sized)
        order = expert_major_order(world, local_experts)
        index = chunk_gather_index(counts, order, capacity)
        assert index.shape == (capacity,)
        assert int(index.min()) >= 0 and int(index.max()) < capacity
        assert torch.equal(index[:total], chunk_order_rows(counts, order, total))
        rows = torch.randn(total, 3)
        expected, _ = sort_chunks_by_idxs(rows, counts, order)
        padded = torch.cat([rows, torch.full((capacity - total, 3), float("nan"))])
        assert torch.equal(padded.index_select(0, index)[:total], expected)
        assert torch.equal(split_and_concatenate(rows, counts, order), expected)


def test_way_back_inverts_the_regroup():
    world, local_experts = 2, 5
    counts = _counts(world, local_experts, seed=11)  # [source rank, local expert]
    total = int(counts.sum())
    capacity = 2 * total
    forward = chunk_gather_index(counts, expert_major_order(world, local_experts), capacity)
    expert_major_sizes = counts.view(world, local_experts).t().flatten()
    back = chunk_gather_index(expert_major_sizes, source_major_order(world, local_experts), capacity)
    assert torch.equal(forward[back[:total]], torch.arange(total))
    order = expert_major_order(world, local_experts)
    assert torch.equal(order[source_major_order(world, local_experts)], torch.arange(world * local_experts))


def test_one_chunk_and_all_rows_in_the_last_chunk():
    counts = torch.tensor([0, 0, 0, 6])
    index = chunk_gather_index(counts, expert_major_order(2, 2), 6)
    assert torch.equal(index, torch.arange(6))
