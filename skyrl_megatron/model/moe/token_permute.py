"""MoE token permutation by gathers only, for dropless top-k routing: no scatter-add, no atomics.

Megatron's non-fused `permute` copies each token once per chosen expert (`index_select`), so its
backward is an `index_add_` of k rows into each token; its `unpermute` sums the k expert outputs
back with `scatter_add_`. Both are atomic scatters on a GPU (about 0.9 and 0.45 ms per call at the
Qwen3-30B-A3B shape on an H200, profiled 2026-11-27), and their summation order changes from run
to run.

With dropless top-k routing every token appears exactly k times among the permuted rows, so the
inverse of the permutation is a [tokens, k] table of row numbers (one stable argsort of the
permutation's token indices) and both directions become gathers:

    permute:    forward rows = x[token_of_row];          backward dx[t] = sum_j dy[row[t, j]]
    unpermute:  forward y[t] = sum_j x[row[t, j]];        backward dx = dy[token_of_row]

The k rows of a token are summed in expert order in one reduction (fp32 accumulation for bf16),
the same on every run and layout; on GPU in one pass (`row_sum_kernels.py`: no [tokens, k, hidden] copy).

The guarantee comes from the layer's config, not from the tensors, so it is granted per dispatcher:
`route_regularly(dispatcher, topk)` (called by our MoE layer, `model/moe/layer.py`, for the alltoall
dispatcher without token dropping or router padding) makes the dispatcher's permutation steps run
with it; every other call of `permute`/`unpermute` (other dispatchers, dropping, TE's fused kernels,
probabilities merged in `unpermute`) is Megatron's own.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref

import torch
from torch import Tensor

_REGULAR_TOPK: contextvars.ContextVar[int | None] = contextvars.ContextVar("regular_topk", default=None)
_originals: dict[str, object] = {}


# the inverse tables found so far, by their permutation's id: the unpermute's forward and the permutation's
# backward need the same one (a stable argsort of every row). An entry lives as long as its permutation (autograd
# saves it) and holds the permutation's version counter, so that one written in place is sorted again. Not a
# WeakKeyDictionary: its lookups compare keys with `==`, elementwise for tensors (a host read).
_INVERSE_TABLES: dict[int, tuple[weakref.ref, int, Tensor]] = {}


def rows_by_token(token_of_row: Tensor, num_tokens: int) -> Tensor:
    """[num_tokens, k]: the permuted rows of each token, in row (= expert) order; sorted once per permutation."""
    k = token_of_row.numel() // num_tokens if num_tokens else 0  # no tokens (an empty half): no rows
    if token_of_row.is_inference():  # no version counter to tell an in-place write: sorted every time
        return torch.argsort(token_of_row, stable=True).view(num_tokens, k)
    key = id(token_of_row)
    entry = _INVERSE_TABLES.get(key)
    if entry is not None:
        alive, version, table = entry
        if alive() is token_of_row and version == token_of_row._version and table.shape[0] == num_tokens:
            return table
    table = torch.argsort(token_of_row, stable=True).view(num_tokens, k)
    alive = weakref.ref(token_of_row, lambda _, key=key: _INVERSE_TABLES.pop(key, None))
    _INVERSE_TABLES[key] = alive, token_of_row._version, table
    return table


class _GatherRows(torch.autograd.Function):
    """rows = x[token_of_row]; its gradient sums each token's k rows through the inverse table."""

    @staticmethod
    def forward(ctx, x: Tensor, token_of_row: Tensor) -> Tensor:
        ctx.save_for_backward(token_of_row)
        ctx.num_tokens = x.shape[0]
        return x.index_select(0, token_of_row)

    @staticmethod
    def backward(ctx, grad_rows: Tensor):
        (token_of_row,) = ctx.saved_tensors
        return _sum_rows(grad_rows, rows_by_token(token_of_row, ctx.num_tokens)), None


class _SumRows(torch.autograd.Function):
    """y[t] = sum of token t's k rows of x; its gradient hands each row its token's gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, token_of_row: Tensor, num_tokens: int) -> Tensor:
        ctx.save_for_backward(token_of_row)
        return _sum_rows(x, rows_by_token(token_of_row, num_tokens))

    @staticmethod
    def backward(ctx, grad_tokens: Tensor):
        (token_of_row,) = ctx.saved_tensors
        return grad_tokens.index_select(0, token_of_row), None, None


def _kernel_layout(x: Tensor, rows: Tensor) -> bool:
    """Whether x [rows, hidden] and rows [tokens, k] are laid out as the one-pass kernel reads them."""
    return x.dim() == 2 and x.is_contiguous() and rows.is_contiguous() and rows.shape[1] > 0


def _kernel_takes(x: Tensor, rows: Tensor) -> bool:
    """Whether the one-pass Triton kernel (`row_sum_kernels.py`) takes this sum: contiguous CUDA rows."""
    return x.is_cuda and _kernel_layout(x, rows)


def _sum_rows(x: Tensor, rows: Tensor) -> Tensor:
    if not _kernel_takes(x, rows):
        return _chain_sums(x, rows)
    from skyrl_megatron.model.moe import row_sum_kernels

    out = torch.empty((rows.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
    if out.numel():
        row_sum_kernels.sum_rows(x, rows, out)
    return out


def _chain_sums(x: Tensor, rows: Tensor) -> Tensor:
    """The sums as PyTorch's gather into a [tokens, k, ...] copy and a reduction (CPU, and any layout)."""
    num_tokens, k = rows.shape
    gathered = x.index_select(0, rows.reshape(-1)).view(num_tokens, k, *x.shape[1:])
    if x.dtype in (torch.bfloat16, torch.float16):  # accumulate in fp32, round once
        return gathered.sum(dim=1, dtype=torch.float32).to(x.dtype)
    return gathered.sum(dim=1)


def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False, **kwargs):
    """Megatron's `moe_utils.permute` (same arguments and results), by gathers where routing is k-regular."""
    topk = _REGULAR_TOPK.get()
    if topk is None or fused or drop_and_pad or kwargs.get("align_size", 0) or num_out_tokens != tokens.shape[0] * topk:
        return _originals["permute"](tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=fused,
                                     drop_and_pad=drop_and_pad, **kwargs)
    # the same order as Megatron's: rows grouped by expert, tokens ascending within an expert
    flat = routing_map.bool().T.contiguous().reshape(-1).argsort(descending=True, stable=True)[:num_out_tokens]
    token_of_row = flat % tokens.shape[0]
    permuted_probs = probs.T.contiguous().reshape(-1)[flat] if probs is not None else None
    return _GatherRows.apply(tokens, token_of_row), permuted_probs, token_of_row, None, kwargs.get("tokens_per_expert")


def unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None, fused=False,
              drop_and_pad=False, pad_offsets=None):
    """Megatron's `moe_utils.unpermute` (same arguments and results), by gathers where routing is k-regular."""
    topk = _REGULAR_TOPK.get()
    num_tokens = restore_shape[0]
    if topk is None or fused or drop_and_pad or probs is not None or pad_offsets is not None \
            or sorted_indices.numel() != num_tokens * topk:
        return _originals["unpermute"](permuted_tokens, sorted_indices, restore_shape, probs=probs,
                                       routing_map=routing_map, fused=fused, drop_and_pad=drop_and_pad,
                                       pad_offsets=pad_offsets)
    return _SumRows.apply(permuted_tokens, sorted_indices, num_tokens)


@contextlib.contextmanager
def regular_routing(topk: int):
    """Within: every token is routed to exactly `topk` experts, none dropped (the caller's guarantee)."""
    token = _REGULAR_TOPK.set(topk)
    try:
        yield
    finally:
        _REGULAR_TOPK.reset(token)


def route_regularly(dispatcher, topk: int) -> None:
    """Run this dispatcher's permutation and its inverse by gathers (its config guarantees k-regular routing).

    Wraps the two steps that call `permute` and `unpermute` on the instance, so recomputation, which
    calls them again, takes the same path."""
    for name in ("dispatch_preprocess", "combine_postprocess"):
        method = getattr(dispatcher, name)

        @functools.wraps(method)
        def with_regular_routing(*args, _method=method, **kwargs):
            with regular_routing(topk):
                return _method(*args, **kwargs)

        setattr(dispatcher, name, with_regular_routing)


def install() -> None:
    """Use these in Megatron's token dispatchers (idempotent); they defer to Megatron's outside `regular_routing`."""
    from megatron.core.transformer.moe import token_dispatcher

    if _originals:
        return
    _originals["permute"], _originals["unpermute"] = token_dispatcher.permute, token_dispatcher.unpermute
    token_dispatcher.permute, token_dispatcher.unpermute = permute, unpermute
