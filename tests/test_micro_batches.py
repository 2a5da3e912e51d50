"""Micro-batch planning: first-fit-decreasing token budgets (rows then spread evenly over the count found),
and no padding between micro-batches
unless the pipeline (or the allgather MoE dispatcher) needs one shape for all of them.

RL batches have long-tailed response lengths. Taking rows in order leaves micro-batches part-empty,
and padding every micro-batch to the largest one spent 18% of the positions of the benchmark batch
on padding at a 16k-token budget. Results must not depend on the grouping.
"""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron.compute.microbatch.plan import plan_micro_batches


def _long_tailed_lengths(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.exp(torch.log(torch.tensor(64.0)) + torch.log(torch.tensor(64.0)) * torch.rand(rows, generator=g)).long()


def _in_order_count(lengths: list[int], budget: int) -> int:
    count, used = 0, None
    for length in lengths:
        if used is None or used + length > budget:
            count, used = count + 1, 0
        used += length
    return count


@pytest.mark.parametrize("budget", [1024, 8192, 16384])
def test_token_budget_plan_is_first_fit_decreasing(budget):
    lengths = _long_tailed_lengths(256)
    plan = plan_micro_batches(lengths, max_tokens=budget)
    rows = torch.cat(plan.groups)
    assert sorted(rows.tolist()) == list(range(256))  # every row exactly once
    for group in plan.groups:
        total = int(lengths[group].sum())
        assert total <= budget or group.numel() == 1  # only a row longer than the budget overflows
        assert group.tolist() == sorted(group.tolist())
    assert len(plan) < _in_order_count(lengths.tolist(), budget)  # 136/169, 28/32, 14/15 here
    # the bound first-fit-decreasing meets: 11/9 of the optimum plus one, the optimum >= total / budget
    assert len(plan) <= 11 / 9 * -(-int(lengths.clamp(max=budget).sum()) // budget) + 1
    again = plan_micro_batches(lengths, max_tokens=budget)
    assert [g.tolist() for g in again.groups] == [g.tolist() for g in plan.groups]
    if budget >= int(lengths.max()):
        # first-fit's count, its rows spread evenly: loads differ by less than the longest row
        totals = [int(lengths[group].sum()) for group in plan.groups]
        assert max(totals) - min(totals) <= int(lengths.max())


def test_token_budget_plan_spreads_the_remainder_and_keeps_first_fit_where_spreading_would_overflow():
    # first-fit: 32,700 + 32,600 + 3,800 tokens; spread: three of about 23k (a short last micro-batch is host-bound)
    lengths = torch.tensor([4000] * 8 + [3700] * 8 + [100] * 12 + [3800])
    plan = plan_micro_batches(lengths, max_tokens=32768)
    totals = sorted(int(lengths[group].sum()) for group in plan.groups)
    assert len(plan) == 3 and totals[-1] - totals[0] <= 4000 and sum(totals) == int(lengths.sum())
    # spread longest-first over two, 5+3+3 would exceed 10: first-fit's 5+5 and 4+3+3 stay
    plan = plan_micro_batches(torch.tensor([5, 5, 4, 3, 3]), max_tokens=10)
    assert [g.tolist() for g in plan.groups] == [[0, 1], [2, 3, 4]]
    # a row longer than the budget keeps a micro-batch of its own either way
    plan = plan_micro_batches(torch.tensor([50, 3, 3, 3]), max_tokens=10)
    assert [g.tolist() for g in plan.groups] == [[0], [1, 2, 3]]


def test_fixed_row_count_plan_keeps_consecutive_rows():
    plan = plan_micro_batches(torch.tensor([5, 1, 7, 3, 2]), micro_batch_size=2)
    assert [g.tolist() for g in plan.groups] == [[0, 1], [2, 3], [4]]


def _shapes_and_logprobs(rank, world_size, hf_dir):
    from skyrl_megatron.compute.runner import MicroBatching, ModelRunner
    from skyrl_megatron.model.build import ModelSpec, build_model
    from skyrl_megatron.parallel import ParallelConfig, init_distributed, initialize_model_parallel
    from skyrl_megatron.testing import make_rl_batch

    init_distributed("cpu")
    parallel = ParallelConfig()
    initialize_model_parallel(parallel, seed=0)
    built = build_model(ModelSpec(hf_dir, parallel=parallel, dtype="fp32"))
    runner = ModelRunner(built.chunks, parallel)
    batch = make_rl_batch(12, 16, 24, seed=3)
    out = {}
    for name, batching in (("budget_48", MicroBatching(max_tokens=48)), ("budget_400", MicroBatching(max_tokens=400)),
                           ("padded_3", MicroBatching(micro_batch_size=3))):
        micro_batches = runner._micro_batches(batch["sequences"], batch["attention_mask"], batching).micro_batches
        out[name] = {
            "shapes": [tuple(mb.model_input_ids.shape) for mb in micro_batches],
            "row_lengths": [batch["attention_mask"][mb.rows].sum(-1).tolist() for mb in micro_batches],
            "logprobs": runner.response_logprobs(batch["sequences"], batch["attention_mask"], 24, batching),
        }
    return out


@pytest.mark.slow
def test_without_pipeline_each_micro_batch_keeps_its_own_shape_and_results_do_not_change(tmp_path):
    from skyrl_megatron.testing import make_tiny_hf_model, run_on_ranks

    hf_dir = str(tmp_path / "qwen3")
    make_tiny_hf_model("qwen3", hf_dir, seed=1)
    (out,) = run_on_ranks(_shapes_and_logprobs, 1, hf_dir, timeout=300)

    budget = out["budget_48"]
    assert len(budget["shapes"]) > 1
    # packed: one row of exactly the micro-batch's real tokens, not the largest micro-batch's
    assert [shape for shape in budget["shapes"]] == [(1, sum(lengths)) for lengths in budget["row_lengths"]]
    assert len({shape for shape in budget["shapes"]}) > 1
    padded = out["padded_3"]
    # padded: each micro-batch as wide as its own longest row
    assert padded["shapes"] == [(len(lengths), max(lengths)) for lengths in padded["row_lengths"]]
    assert len({shape[1] for shape in padded["shapes"]}) > 1
    # grouping changes nothing but float summation order
    for name in ("budget_400", "padded_3"):
        torch.testing.assert_close(out[name]["logprobs"], budget["logprobs"], rtol=0, atol=1e-5)


def test_packed_boundaries_shared_by_query_and_key_stay_one_tensor_on_the_device(monkeypatch):
    """Packing gives query and key (padded or not) one boundary tensor; moving the micro-batch to the GPU must
    keep them one: the rotation tables are cached by the boundaries' identity, and four copies made the cache
    miss at every layer and direction (168 cos and 168 sin kernels in a 1.7B scoring pass instead of 3 each,
    profiled on an H200 2026-11-27). The meta device stands in for the GPU: `.to` makes a new tensor there as on CUDA."""
    from skyrl_megatron.compute.microbatch.micro_batch import _params_on
    from skyrl_megatron.compute.microbatch.pack import pack_padded_batch
    from skyrl_megatron.model.layers import rope

    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    params = pack_padded_batch(torch.arange(8).reshape(2, 4), mask).packed_seq_params
    moved = _params_on(params, torch.device("meta"))
    boundaries = [moved.cu_seqlens_q, moved.cu_seqlens_kv, moved.cu_seqlens_q_padded, moved.cu_seqlens_kv_padded]
    assert all(b.device.type == "meta" and b is boundaries[0] for b in boundaries)
    assert moved.max_seqlen_q == params.max_seqlen_q == 4

    computed = []
    original = rope.frequency_rows
    monkeypatch.setattr(rope, "frequency_rows", lambda *a: computed.append(1) or original(*a))
    rope._TABLES.clear()
    freqs = torch.randn(16, 1, 1, 8, device="meta")
    for _layer in range(3):  # as the layers do: query's boundaries, then key's
        for side in (moved.cu_seqlens_q_padded, moved.cu_seqlens_kv_padded):
            rope.rotation_tables(freqs, side, 7, 1, 0, torch.bfloat16)
    rope._TABLES.clear()
    assert len(computed) == 1


@pytest.mark.parametrize("parallel_kwargs, min_tokens", [({}, 0), ({"context": 2}, 0), ({"tensor": 2, "sequence_parallel": True}, 64)])
def test_other_columns_are_laid_out_as_the_packed_tokens(parallel_kwargs, min_tokens):
    """`pack_like` (how the labels are packed) gives what packing those columns again gives, alignment
    padding and a pipeline's minimum length included."""
    from skyrl_megatron.compute.microbatch.pack import pack_like, pack_padded_batch
    from skyrl_megatron.parallel import ParallelConfig

    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([5, 1, 9, 3])
    mask = (torch.arange(9) < lengths[:, None]).long()
    tokens, labels = torch.randint(1, 50, (4, 9), generator=g), torch.randint(-100, 50, (4, 9), generator=g)
    parallel = ParallelConfig(**parallel_kwargs)
    packed = pack_padded_batch(tokens, mask, parallel, pad_token_id=0, min_tokens=min_tokens)
    again = pack_padded_batch(labels, mask, parallel, pad_token_id=-100, min_tokens=min_tokens).tokens
    if parallel_kwargs or min_tokens:  # alignment padding (CP, SP) or a pipeline's length is there to fill
        assert packed.num_tokens > int(lengths.sum())
    assert torch.equal(pack_like(labels, packed, -100), again)


def test_each_micro_batch_is_prepared_when_the_schedule_first_asks_for_it(monkeypatch, tmp_path):
    """Only the first micro-batch's packing and copies stand before the schedule's first kernel: the others are
    prepared as they are taken (while the device runs the ones before), once each, and equal to what preparing
    them all up front gave."""
    import torch.distributed as dist

    from skyrl_megatron.compute.microbatch import pipeline
    from skyrl_megatron.compute.microbatch.plan import MicroBatching
    from skyrl_megatron.parallel import ParallelConfig
    from skyrl_megatron.testing import make_rl_batch

    batch = make_rl_batch(12, 16, 24, seed=3)
    args = (batch["sequences"], batch["attention_mask"], MicroBatching(max_tokens=48), ParallelConfig())
    # the plan agrees on the count over the world: a world of one, in this process, which agrees with nobody
    # (no collective, so no device round trip before the first micro-batch on a GPU)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: pytest.fail("a world of one ran the plan's collective"))
    try:
        _prepare_on_demand(monkeypatch, pipeline, args)
    finally:
        dist.destroy_process_group()


def _prepare_on_demand(monkeypatch, pipeline, args):
    packed = []
    real_pack = pipeline.pack
    monkeypatch.setattr(pipeline, "pack", lambda *a, **k: packed.append(1) or real_pack(*a, **k))
    prepared = pipeline.prepare_micro_batches(*args, device=torch.device("cpu")).micro_batches
    assert len(prepared) > 2 and prepared.prepared == 0 and not packed
    taken = iter(prepared)
    first = next(taken)
    assert prepared.prepared == len(packed) == 1
    rest = list(taken)
    assert prepared.prepared == len(packed) == len(prepared)
    assert prepared[0] is first and list(prepared) == [first, *rest] and len(packed) == len(prepared)  # kept
    assert prepared[1:3] == rest[:2]
    with pytest.raises(IndexError):
        prepared[len(prepared)]
    up_front = pipeline.prepare_micro_batches(*args, device=torch.device("cpu")).micro_batches
    for mine, theirs in zip(prepared, list(up_front), strict=True):
        assert torch.equal(mine.model_input_ids, theirs.model_input_ids) and torch.equal(mine.rows, theirs.rows)
        assert torch.equal(mine.targets.labels, theirs.targets.labels)


def test_host_tensors_go_to_a_gpu_from_pinned_memory_as_non_blocking_copies(monkeypatch):
    """A copy from pageable memory to a GPU first waits for the device's queued work: `to_device` pins the source
    (made contiguous first, so that `.to` makes no pageable copy of its own) and copies non-blocking; already
    pinned sources are not pinned again; other moves are `Tensor.to`. (The calls only: no GPU here.)"""
    from skyrl_megatron import host_copies

    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory",
                        lambda self: calls.append("pin" if self.is_contiguous() else "pin strided") or self)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)
    real_to = torch.Tensor.to

    def to(self, device, non_blocking=False):
        calls.append(("to", torch.device(device).type, non_blocking))
        return real_to(self, "meta")  # stands in for the GPU's new tensor

    monkeypatch.setattr(torch.Tensor, "to", to)
    host_copies.to_device(torch.arange(4), torch.device("cuda"))
    assert calls == ["pin", ("to", "cuda", True)]
    calls.clear()
    host_copies.to_device(torch.arange(8)[::2], torch.device("cuda"))
    assert calls == ["pin", ("to", "cuda", True)]
    calls.clear()
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    host_copies.to_device(torch.arange(4), "cuda:0")
    assert calls == [("to", "cuda", True)]
    calls.clear()
    host_copies.to_device(torch.arange(4), torch.device("cpu"))
    assert calls == [("to", "cpu", False)]
