"""Vectorised packed (THD) RoPE against Megatron-Core's per-sequence implementation it replaces."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from skyrl_megatron.model.layers import rope


class _Group:
    """The two methods RoPE reads from a context-parallel group."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _megatron_thd():
    rope.install()  # what build_model does; Megatron's own function stays reachable for comparison
    return rope._MEGATRON_THD


def _inputs(lengths, cp, heads=3, dim=16, table=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    t = torch.randn(total // cp, heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
    freqs = torch.randn(table or max(lengths), 1, 1, dim, generator=g, dtype=torch.float64)
    return t, cu, freqs


@pytest.mark.parametrize(
    "lengths, cp, rank, interleaved, mscale",
    [
        ([5, 1, 12, 7], 1, 0, False, 1.0),
        ([8, 4, 12], 2, 0, False, 1.0),
        ([8, 4, 12], 2, 1, True, 1.0),
        ([16, 8, 24], 4, 2, False, 0.7),
    ],
)
def test_equals_megatrons_per_sequence_rope_values_and_gradients(lengths, cp, rank, interleaved, mscale):
    megatron_thd = _megatron_thd()
    group = _Group(cp, rank)
    t, cu, freqs = _inputs(lengths, cp)
    ours = rope.apply_thd_rope(t, cu, freqs, rotary_interleaved=interleaved, mscale=mscale, cp_group=group)
    theirs_t = t.detach().clone().requires_grad_(True)
    theirs = megatron_thd(theirs_t, cu, freqs, rotary_interleaved=interleaved, mscale=mscale, cp_group=group)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    upstream = torch.randn_like(ours)
    (ours * upstream).sum().backward()
    (theirs * upstream).sum().backward()
    torch.testing.assert_close(t.grad, theirs_t.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("cp, rank", [(1, 0), (2, 1)])
def test_batch_wide_frequency_table_reads_each_sequence_at_its_offset(cp, rank):
    """A table with one row per packed token (VLM-style positions): Megatron's other THD mode."""
    megatron_thd = _megatron_thd()
    lengths = [4, 8, 12]
    t, cu, freqs = _inputs(lengths, cp, table=sum(lengths))
    group = _Group(cp, rank)
    torch.testing.assert_close(
        rope.apply_thd_rope(t, cu, freqs, cp_group=group), megatron_thd(t, cu, freqs, cp_group=group), rtol=0, atol=1e-12
    )


def test_no_host_sync_and_a_fixed_number_of_kernels_whatever_the_sequence_count():
    counts = {}
    for sequences in (2, 32):
        t, cu, freqs = _inputs([6] * sequences, 1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            rope.apply_thd_rope(t, cu, freqs, cp_group=_Group(1, 0))
        events = {e.key: e.count for e in prof.key_averages()}
        assert "aten::_local_scalar_dense" not in events and "aten::item" not in events
        counts[sequences] = sum(events.values())
    assert counts[2] == counts[32]


def test_megatron_uses_it_after_build_models_install():
    from megatron.core.models.common.embeddings import rope_utils

    rope.install()
    assert rope_utils._apply_rotary_pos_emb_thd is rope.apply_thd_rope


@pytest.mark.parametrize("cp, rank, interleaved", [(1, 0, False), (2, 1, False), (1, 0, True)])
def test_bitwise_equal_to_megatrons_in_bf16(cp, rank, interleaved):
    """The same arithmetic in the same order: bf16 results and gradients are identical, not close."""
    megatron_thd = _megatron_thd()
    group = _Group(cp, rank)
    t, cu, freqs = _inputs([8, 4, 12, 16], cp, heads=4, dim=32, seed=3)
    ours_t = t.detach().to(torch.bfloat16).requires_grad_(True)
    theirs_t = ours_t.detach().clone().requires_grad_(True)
    ours = rope.apply_thd_rope(ours_t, cu, freqs.float(), rotary_interleaved=interleaved, cp_group=group)
    theirs = megatron_thd(theirs_t, cu, freqs.float(), rotary_interleaved=interleaved, cp_group=group)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs)
    upstream = torch.randn(ours.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    (ours * upstream).sum().backward()
    (theirs * upstream).sum().backward()
    assert torch.equal(ours_t.grad, theirs_t.grad)


def test_partial_rotary_keeps_the_unrotated_part():
    megatron_thd = _megatron_thd()
    t, cu, freqs = _inputs([5, 9], 1, dim=16)
    half_table = freqs[..., :8].contiguous()  # RoPE over the first 8 of 16 channels
    ours = rope.apply_thd_rope(t, cu, half_table, cp_group=_Group(1, 0))
    torch.testing.assert_close(ours, megatron_thd(t, cu, half_table, cp_group=_Group(1, 0)), rtol=0, atol=1e-12)
    assert torch.equal(ours[..., 8:], t[..., 8:])


def test_rotation_tables_are_computed_once_per_micro_batch():
    """Query and key of every layer share one micro-batch's cos/sin rows; new boundaries (the next
    micro-batch) compute them again."""
    rope._TABLES.clear()
    t, cu, freqs = _inputs([6, 10], 1)
    group = _Group(1, 0)

    def cos_calls(boundaries) -> int:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            rope.apply_thd_rope(t, boundaries, freqs, cp_group=group)
        return sum(e.count for e in prof.key_averages() if e.key == "aten::cos")

    assert cos_calls(cu) == 1
    assert cos_calls(cu) == 0  # the next layer, or the key after the query
    assert cos_calls(cu.clone()) == 1  # the next micro-batch
