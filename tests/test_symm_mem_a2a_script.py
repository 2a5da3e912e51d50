"""The EP>1 all-to-all check (bench/gpu_symm_mem_a2a_check.py) on CPU: its index math against our
on-device regrouping and Megatron's, its permutation inverse against Megatron's permute and the
scatters it replaces, and its smoke mode end to end (2 gloo ranks, torch's NVSHMEM op emulated on
host splits), which must fail when the regrouping is wrong. Checks the script before device time is
spent on it."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from skyrl_megatron.model.moe.token_sort import chunk_order_rows

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_symm_mem_a2a_check.py"


@pytest.fixture(scope="module")
def a2a():
    spec = importlib.util.spec_from_file_location("gpu_symm_mem_a2a_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_symm_mem_a2a_check"] = module
    spec.loader.exec_module(module)
    return module


def _counts(world, local_experts, seed, zero_share=0.3):
    generator = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 9, (world * local_experts,), generator=generator)
    counts[torch.rand(counts.shape, generator=generator) < zero_share] = 0  # empty chunks
    return counts


@pytest.mark.parametrize("world,local_experts", [(2, 4), (2, 64), (4, 3)])
def test_regroup_index_equals_chunk_order_rows_and_megatron(a2a, world, local_experts):
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

    for seed in range(5):
        counts = _counts(world, local_experts, seed)
        total = int(counts.sum())
        capacity = total + 37  # padding past the data, as on the device (worst-case sized)
        order = a2a.expert_major_order(world, local_experts)
        index = a2a.chunk_gather_index(counts, order, capacity)
        assert index.shape == (capacity,)
        assert int(index.min()) >= 0 and int(index.max()) < capacity
        assert torch.equal(index[:total], chunk_order_rows(counts, order, total))
        rows = torch.randn(total, 3)
        expected, _ = sort_chunks_by_idxs(rows, counts, order)
        padded = torch.cat([rows, torch.full((capacity - total, 3), float("nan"))])
        assert torch.equal(padded.index_select(0, index)[:total], expected)
        assert torch.equal(a2a.split_and_concatenate(rows, counts, order), expected)


def test_way_back_inverts_the_regroup(a2a):
    world, local_experts = 2, 5
    counts = _counts(world, local_experts, seed=11)  # [source rank, local expert]
    total = int(counts.sum())
    capacity = 2 * total
    forward = a2a.chunk_gather_index(counts, a2a.expert_major_order(world, local_experts), capacity)
    expert_major_sizes = counts.view(world, local_experts).t().flatten()
    back = a2a.chunk_gather_index(expert_major_sizes, a2a.source_major_order(world, local_experts), capacity)
    assert torch.equal(forward[back[:total]], torch.arange(total))
    order = a2a.expert_major_order(world, local_experts)
    assert torch.equal(order[a2a.source_major_order(world, local_experts)], torch.arange(world * local_experts))


def test_one_chunk_and_all_rows_in_the_last_chunk(a2a):
    counts = torch.tensor([0, 0, 0, 6])
    index = a2a.chunk_gather_index(counts, a2a.expert_major_order(2, 2), 6)
    assert torch.equal(index, torch.arange(6))


def test_permutation_matches_megatron_and_its_inverse_replaces_the_scatters(a2a):
    from megatron.core.transformer.moe.moe_utils import permute

    tokens, topk, experts, hidden = 50, 4, 12, 6
    routing = a2a.draw_routing(tokens, topk, experts, seed=3, device="cpu")
    assert all(len(set(row)) == topk for row in routing.tolist())
    flat_sorted, sorted_indices, counts = a2a.permutation_of(routing, experts)
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, routing, True)
    x = torch.randn(tokens, hidden, dtype=torch.float64)
    permuted, _, megatron_indices, _, _ = permute(x, routing_map, num_out_tokens=tokens * topk)
    assert torch.equal(sorted_indices, megatron_indices)
    assert torch.equal(counts, routing_map.sum(0))

    token_rows = a2a.token_rows_of(flat_sorted, routing, experts)
    assert torch.equal(sorted_indices[token_rows], torch.arange(tokens)[:, None].expand(-1, topk))
    assert torch.equal(flat_sorted[token_rows] // tokens, routing)  # choice j of token t sits at its expert's rows

    grad_rows = torch.randn(tokens * topk, hidden, dtype=torch.float64)
    by_index_add = torch.zeros(tokens, hidden, dtype=torch.float64).index_add_(0, sorted_indices, grad_rows)
    by_scatter_add = torch.zeros(tokens, hidden, dtype=torch.float64).scatter_add_(
        0, sorted_indices.unsqueeze(1).expand(-1, hidden), grad_rows)
    by_gather = a2a.gather_sum(grad_rows, token_rows)
    torch.testing.assert_close(by_gather, by_index_add, rtol=0, atol=1e-12)
    torch.testing.assert_close(by_gather, by_scatter_add, rtol=0, atol=1e-12)


def test_summary_exit_codes(a2a):
    assert a2a.summarize({"ranks": [{"nvshmem_available": False}, {"nvshmem_available": False}]})[0] == 2
    parity = dict.fromkeys(a2a.PARITY_KEYS, True) | {"received_rows": 5, "capacity_rows": 8}
    ok = {"ranks": [{"rank": 0, "parity": parity}, {"rank": 1, "parity": parity}]}
    assert a2a.summarize(ok)[0] == 0
    bad = {"ranks": [{"rank": 0, "parity": parity}, {"rank": 1, "parity": parity | {"combine_equal": False}}]}
    assert a2a.summarize(bad)[0] == 1


@pytest.mark.slow
def test_smoke_mode_on_two_gloo_ranks(tmp_path, bench_smoke):
    out = tmp_path / "a2a.json"
    run = bench_smoke(SCRIPT, out)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    assert "all hold" in run.stdout
    ranks = json.loads(out.read_text())["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert all(r["parity"].values()), r["parity"]
        assert 0 < r["parity"]["received_rows"] < r["parity"]["capacity_rows"]  # padding exercised
    assert sum(r["parity"]["received_rows"] for r in ranks) == 2 * ranks[0]["rows_per_rank"]


@pytest.mark.slow
def test_smoke_mode_catches_a_wrong_regroup(tmp_path, bench_smoke):
    out = tmp_path / "a2a.json"
    # rows left in the order they landed (source rank, then expert): dispatch parity must fail
    run = bench_smoke(SCRIPT, out, patch="script.chunk_gather_index = lambda sizes, order, capacity: script.torch.arange(capacity)")
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-5000:]
    assert "MISMATCH" in run.stdout
    parity = json.loads(out.read_text())["ranks"][0]["parity"]
    assert not parity["dispatch_equal"] and not parity["regroup_index_equals_chunk_order_rows"]
    assert parity["counts_equal"] and parity["op_splits_offsets_equal"]


@pytest.mark.slow
def test_a_failing_rank_exits_3_and_keeps_its_partial_report(tmp_path, bench_smoke):
    out = tmp_path / "a2a.json"
    run = bench_smoke(SCRIPT, out, patch="script.split_and_concatenate = lambda *args: 1 / 0")
    assert run.returncode == 3, run.stdout[-3000:] + run.stderr[-5000:]
    result = json.loads(out.read_text())
    assert "ZeroDivisionError" in result["error"]
    assert all(r is not None and "symmetric_buffers" in r and "parity" not in r for r in result["ranks"])
