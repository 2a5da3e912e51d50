"""`model/moe/token_permute.py`: MoE permutation by gathers for dropless top-k routing, against Megatron's own."""

from __future__ import annotations

import pytest
import torch

from skyrl_megatron.model.moe import token_permute
from skyrl_megatron.testing.host_syncs import HostSyncProbe


@pytest.fixture(autouse=True, scope="module")
def installed():
    token_permute.install()


def _routing(tokens: int, experts: int, topk: int, seed: int, idle: int = 0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g)
    scores[:, torch.randperm(experts, generator=g)[:idle]] = -1.0  # experts that get no token
    chosen = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, chosen, True)
    return routing_map, torch.rand(tokens, experts, generator=g) * routing_map


def _megatron():
    from megatron.core.transformer.moe import moe_utils

    return moe_utils.permute, moe_utils.unpermute


def _round_trip(permute, unpermute, hidden, routing_map, probs, topk, upstream):
    x = hidden.clone().requires_grad_()
    p = probs.clone().requires_grad_()
    rows, row_probs, token_of_row, _, _ = permute(x, routing_map, probs=p, num_out_tokens=x.shape[0] * topk)
    expert_out = rows * 3.0 + row_probs.unsqueeze(-1).to(rows.dtype)  # stands in for the experts
    back = unpermute(expert_out, token_of_row, x.shape, routing_map=routing_map)
    back.backward(upstream)
    return dict(rows=rows.detach(), probs=row_probs.detach(), order=token_of_row, out=back.detach(),
                grad=x.grad, probs_grad=p.grad)


@pytest.mark.parametrize("tokens", [1, 7, 64])
@pytest.mark.parametrize("topk,experts,idle", [(1, 4, 2), (2, 8, 3), (8, 16, 0)])
def test_gathers_give_megatrons_permutation_and_sums_without_host_reads(tokens, topk, experts, idle):
    routing_map, probs = _routing(tokens, experts, topk, seed=tokens + 10 * topk, idle=idle)
    g = torch.Generator().manual_seed(tokens)
    hidden, upstream = torch.randn(tokens, 6, generator=g), torch.randn(tokens, 6, generator=g)
    want = _round_trip(*_megatron(), hidden, routing_map, probs, topk, upstream)
    with HostSyncProbe() as probe, token_permute.regular_routing(topk):
        got = _round_trip(token_permute.permute, token_permute.unpermute, hidden, routing_map, probs, topk, upstream)
    assert not probe.found, probe.report()
    for key in ("rows", "probs", "order", "probs_grad"):  # the same rows in the same order: bitwise
        assert torch.equal(got[key], want[key]), key
    # sums of k rows: the same terms, added in one reduction instead of one at a time
    torch.testing.assert_close(got["out"], want["out"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got["grad"], want["grad"], rtol=1e-6, atol=1e-6)


def test_bf16_sums_accumulate_in_fp32_and_come_out_no_worse_than_megatrons():
    topk, tokens = 8, 256
    routing_map, probs = _routing(tokens, 32, topk, seed=1)
    g = torch.Generator().manual_seed(2)
    hidden, upstream = torch.randn(tokens, 64, generator=g), torch.randn(tokens, 64, generator=g)
    exact = _round_trip(*_megatron(), hidden.double(), routing_map, probs.double(), topk, upstream.double())
    theirs = _round_trip(*_megatron(), hidden.bfloat16(), routing_map, probs, topk, upstream.bfloat16())
    with token_permute.regular_routing(topk):
        ours = _round_trip(token_permute.permute, token_permute.unpermute, hidden.bfloat16(), routing_map, probs,
                           topk, upstream.bfloat16())
    for key in ("out", "grad"):
        error = lambda r: (r[key].double() - exact[key]).abs().max().item()  # noqa: E731
        assert error(ours) <= error(theirs), key


def test_outside_a_regular_routing_grant_megatrons_functions_run():
    routing_map, probs = _routing(5, 8, 2, seed=3)
    hidden = torch.randn(5, 4, requires_grad=True)
    rows, _, order, _, _ = token_permute.permute(hidden, routing_map, probs=probs, num_out_tokens=10)
    assert type(rows.grad_fn).__name__ == "IndexSelectBackward0"  # Megatron's index_select, not our gather
    with token_permute.regular_routing(3):  # a grant that does not match the sizes is not used either
        rows, _, _, _, _ = token_permute.permute(hidden, routing_map, probs=probs, num_out_tokens=10)
        out = token_permute.unpermute(rows.detach(), order, hidden.shape, routing_map=routing_map)
    assert type(rows.grad_fn).__name__ == "IndexSelectBackward0" and out.grad_fn is None
    with token_permute.regular_routing(2):
        rows, _, _, _, _ = token_permute.permute(hidden, routing_map, probs=probs, num_out_tokens=10)
    assert type(rows.grad_fn).__name__ == "_GatherRowsBackward"


def test_route_regularly_grants_only_that_dispatchers_two_steps():
    seen = []

    class FakeDispatcher:
        def dispatch_preprocess(self, x):
            seen.append(("dispatch", token_permute._REGULAR_TOPK.get()))
            return x

        def combine_postprocess(self, x):
            seen.append(("combine", token_permute._REGULAR_TOPK.get()))
            return x

        def token_dispatch(self, x):
            seen.append(("a2a", token_permute._REGULAR_TOPK.get()))
            return x

    granted, other = FakeDispatcher(), FakeDispatcher()
    token_permute.route_regularly(granted, 8)
    for dispatcher in (granted, other):
        dispatcher.dispatch_preprocess(1), dispatcher.token_dispatch(1), dispatcher.combine_postprocess(1)
    assert seen == [("dispatch", 8), ("a2a", None), ("combine", 8), ("dispatch", None), ("a2a", None), ("combine", None)]


_ROW_SUM_CHECK = """
import torch
from skyrl_megatron.model.moe import row_sum_kernels

cases = 0
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    # k of 1, 2 and 8; hidden below, at and past one program's columns (a masked tail)
    for tokens, k, hidden in ((3, 1, 6), (5, 2, 2048), (4, 8, 2 * 2048 + 37)):
        generator = torch.Generator().manual_seed(tokens * k + hidden)
        x = (torch.randn(tokens * k, hidden, generator=generator) * 8).to(dtype)
        rows = torch.randperm(tokens * k, generator=generator).view(tokens, k)
        want = torch.zeros(tokens, hidden)
        for j in range(k):  # in fp32, in expert order, rounded once
            want += x[rows[:, j]].float()
        # the fp32 sums bitwise (an fp32 output); then the rounding into x's dtype, which the interpreter does
        # by truncation where the GPU rounds to nearest: within one unit in the last place
        sums = torch.full((tokens, hidden), float("nan"))
        row_sum_kernels.sum_rows(x, rows, sums)
        assert torch.equal(sums, want), (dtype, tokens, k, hidden, (sums - want).abs().max())
        out = torch.full((tokens, hidden), float("nan"), dtype=dtype)
        row_sum_kernels.sum_rows(x, rows, out)
        torch.testing.assert_close(out.float(), want, rtol=torch.finfo(dtype).eps, atol=0)
        cases += 1

# the kernel in its place: the unpermute's forward and the permutation's backward through it, fp32, against the
# PyTorch chain's round trip (the kernel's test on a GPU, with CPU tensors standing in for CUDA ones)
from skyrl_megatron.model.moe import token_permute

token_permute.install()
tokens, experts, topk = 9, 8, 2
generator = torch.Generator().manual_seed(5)
chosen = torch.rand(tokens, experts, generator=generator).topk(topk, dim=1).indices
routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, chosen, True)
hidden, upstream = torch.randn(tokens, 6, generator=generator), torch.randn(tokens, 6, generator=generator)


def round_trip():
    x = hidden.clone().requires_grad_()
    with token_permute.regular_routing(topk):
        rows, _, order, _, _ = token_permute.permute(x, routing_map, num_out_tokens=tokens * topk)
        out = token_permute.unpermute(rows * 3.0, order, x.shape, routing_map=routing_map)
    out.backward(upstream)
    return out.detach(), x.grad


want_out, want_grad = round_trip()
token_permute._kernel_takes = token_permute._kernel_layout  # CPU tensors in the kernel's layout take it
launches, launch = [], row_sum_kernels.sum_rows
row_sum_kernels.sum_rows = lambda *args: launches.append(1) or launch(*args)
got_out, got_grad = round_trip()
assert len(launches) == 2, launches  # the unpermute's forward and the permutation's backward
assert torch.equal(got_out, want_out) and torch.equal(got_grad, want_grad), (got_out - want_out, got_grad - want_grad)
cases += 1
print("checked", cases)
"""


def test_the_row_sum_kernel_adds_each_tokens_rows_in_fp32_in_expert_order_bitwise():
    from skyrl_megatron.testing import last_word_under_triton_interpreter

    assert last_word_under_triton_interpreter(_ROW_SUM_CHECK, timeout=300) == "10"


def test_the_row_sum_kernel_takes_contiguous_cuda_rows_only():
    class OnGpu(torch.Tensor):  # reports CUDA without a GPU, for the predicate alone
        @property
        def is_cuda(self):
            return True

    x, rows = torch.zeros(8, 6).as_subclass(OnGpu), torch.arange(8).view(4, 2)
    assert token_permute._kernel_takes(x, rows)
    assert not token_permute._kernel_takes(torch.zeros(8, 6), rows)  # a CPU tensor: PyTorch's chain
    assert not token_permute._kernel_takes(x.t(), rows)  # not contiguous
    assert not token_permute._kernel_takes(x.view(8, 2, 3), rows)  # not [rows, hidden]
    assert not token_permute._kernel_takes(x, rows.t())
    assert not token_permute._kernel_takes(x[:0], torch.zeros(0, 0, dtype=torch.long))  # no tokens



def test_the_inverse_table_is_sorted_once_per_permutation(monkeypatch):
    """The unpermute's forward and the permutation's backward share one argsort of the rows; a new permutation,
    or one written in place, is sorted again."""
    token_permute.install()
    tokens, experts, topk = 9, 8, 2
    generator = torch.Generator().manual_seed(5)
    chosen = torch.rand(tokens, experts, generator=generator).topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, chosen, True)
    sorts, real_argsort = [], torch.argsort
    monkeypatch.setattr(torch, "argsort", lambda *a, **k: sorts.append(1) or real_argsort(*a, **k))

    def round_trip():
        x = torch.randn(tokens, 6, generator=generator, requires_grad=True)
        with token_permute.regular_routing(topk):
            rows, _, order, _, _ = token_permute.permute(x, routing_map, num_out_tokens=tokens * topk)
            out = token_permute.unpermute(rows * 3.0, order, x.shape, routing_map=routing_map)
        out.sum().backward()
        return order, x.grad

    sorts.clear()
    order, grad = round_trip()
    assert len(sorts) == 1  # the inverse table, once for the unpermute's forward and the permutation's backward
    torch.testing.assert_close(grad, torch.full_like(grad, 3.0 * topk))  # each token's k rows, 3 x each
    table = token_permute.rows_by_token(order, tokens)
    assert len(sorts) == 1 and torch.equal(order[table], torch.arange(tokens).repeat_interleave(topk).view(tokens, topk))
    order[:2] = order[:2].flip(0)  # written in place: sorted again
    token_permute.rows_by_token(order, tokens)
    assert len(sorts) == 2
    key = id(order)
    assert key in token_permute._INVERSE_TABLES
    del order, table  # the entry goes with its permutation
    import gc

    gc.collect()
    assert key not in token_permute._INVERSE_TABLES
    with torch.inference_mode():  # inference tensors have no version counter: sorted, never kept
        order = torch.tensor([3, 0, 2, 1])
        sorts.clear()
        assert torch.equal(token_permute.rows_by_token(order, 2), torch.tensor([[1, 3], [2, 0]]))
        assert len(sorts) == 1 and id(order) not in token_permute._INVERSE_TABLES
