"""What Megatron-Core's distributed optimizer works out per parameter tensor at every step, worked out once.

Every step the `DistributedOptimizer` hands each fp32 main shard its gradient (a slice of DDP's gradient buffer),
picks the gradients the norm counts (not shared, not a tensor-parallel or generalized-TP duplicate), and after
the update copies each main shard back into DDP's parameter buffer. It finds the slices and evaluates the
predicates per parameter, per step, in Python: range-map and buffer lookups, quantization checks, process-group
rank queries. A MoE has thousands of parameter tensors (Qwen3-30B-A3B's widths at 8 layers: 2,107, 2,048 of
them the experts' one weight each), and its optimizer step on an H200 ran 358 ms wall for 144 ms of kernels
(2026-11-29).

None of it changes between steps: DDP's buffers keep their tensors for the model's life (our gradient release and
the offloads free and restore their storage in place, so views of them stay valid), the shards keep their order,
and a parameter's sharing and parallel attributes are fixed at build. `install` therefore works them out once
per optimizer and replaces three methods on that instance: the gradients are handed over through prebuilt views,
the parameters copied back with one `torch._foreach_copy_`, and the norm's gradients picked by a membership
remembered per parameter (weakly: a main shard replaced is looked at again) and, where DDP's gradient buffer is fp32,
handed to the norm as the few runs of that buffer they form. After each step's parameter gather,
DDP's bucket groups look through every parameter for quantized (TE fp8/fp4) storage to post-process; a bucket group
whose parameters have none (all of them without TE) has nothing to do there, and is told so once. The main shards themselves are read
from the optimizer at every step (compact master weights rebuild them). Only the plain path is replaced (bf16/fp32
parameters, gradients in `.grad`); the precision-aware optimizer, fp8/fp4 parameter gathers and Megatron-FSDP
keep Megatron's methods. Steps equal Megatron's bitwise (tests/test_optim.py, EP2 x DP2).
"""

from __future__ import annotations

import types
import weakref

import torch


def _replaceable(optimizer) -> str | None:
    """Why this optimizer keeps Megatron's methods; None: it can take ours."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not isinstance(optimizer, DistributedOptimizer):
        return "not a distributed optimizer"
    if getattr(optimizer, "is_stub_optimizer", False):
        return "a stub (no parameters on this rank)"
    ddp, config = optimizer.ddp_config, optimizer.config
    if getattr(ddp, "use_megatron_fsdp", False):
        return "Megatron-FSDP"
    if getattr(config, "use_precision_aware_optimizer", False):
        return "the precision-aware optimizer"
    if getattr(ddp, "fp8_param_gather", False) or getattr(ddp, "fp4_param_gather", False):
        return "fp8/fp4 parameter gather"
    groups = (*optimizer.model_float16_groups, *optimizer.model_fp32_groups)
    if any(optimizer._is_distopt_quantized_param(p) for group in groups for p in group):
        return "quantized parameters"
    return None


class _ShardViews:
    """Each main shard's slice of DDP's gradient buffer and of its parameter buffer, in the optimizer's order
    (its float16 groups, then its fp32 groups)."""

    def __init__(self, optimizer):
        self.grads: list[list[torch.Tensor]] = []
        self.params: list[torch.Tensor] = []
        self.float16_count = sum(len(group) for group in optimizer.model_float16_groups)  # those first in `params`
        for model_group in (*optimizer.model_float16_groups, *optimizer.model_fp32_groups):
            group_grads = []
            for model_param in model_group:
                ranges = optimizer._get_model_param_range_map(model_param)
                shard, world = ranges["param"], ranges["gbuf_world_in_bucket"]
                group_grads.append(model_param.main_grad.view(-1)[shard.start:shard.end])
                buffer_index, _, bucket_id = optimizer.model_param_gbuf_map[model_param]
                param_data = optimizer.buffers[buffer_index].buckets[bucket_id].param_data
                self.params.append(param_data.view(-1)[world.start:world.end])
            self.grads.append(group_grads)
        # an fp32 gradient buffer (grad_reduce_in_fp32): the main shards' gradients are these views themselves
        self.fp32 = all(view.dtype == torch.float32 for group in self.grads for view in group)


def _main_groups(optimizer) -> tuple:
    return (*optimizer.shard_fp32_from_float16_groups, *optimizer.shard_fp32_groups)


def _main_shards(optimizer) -> list[torch.Tensor]:
    """Every main shard, in `_ShardViews.params`' order."""
    return [main for group in _main_groups(optimizer) for main in group]


def _copy_model_grads_to_main_grads(optimizer) -> None:
    for views, main_group in zip(optimizer._skyrl_shard_views.grads, _main_groups(optimizer)):
        for view, main in zip(views, main_group):
            main.grad = view.float()  # (the view itself where the buffer is fp32, as in Megatron's)


@torch.no_grad()
def _copy_main_params_to_model_params(optimizer) -> None:
    views, mains = optimizer._skyrl_shard_views.params, _main_shards(optimizer)
    writer = getattr(optimizer, "_skyrl_write_models", None)
    if writer is not None and writer():  # the float16 parameters' shards are written (`write_models_with`)
        first_fp32 = optimizer._skyrl_shard_views.float16_count
        views, mains = views[first_fp32:], mains[first_fp32:]
    if mains:
        torch._foreach_copy_(views, mains)


def write_models_with(optimizer, writer) -> None:
    """Let `writer()` copy the float16 parameters' main shards into their model shards at the step's copy back;
    it returns False where it did not (the copy is then made here). Compact master weights make that copy as
    they release the masters (`master_weights.CompactMasterWeights.round_into_models`). A no-op on an optimizer
    that keeps Megatron's methods."""
    if hasattr(optimizer, "_skyrl_shard_views"):
        optimizer._skyrl_write_models = writer


def main_grad_views(optimizer) -> dict[int, torch.Tensor] | None:
    """id of each main shard -> its gradient's view of DDP's buffer (what the step hands it as `.grad` where the
    buffer is fp32); None on an optimizer that keeps Megatron's methods."""
    views = getattr(optimizer, "_skyrl_shard_views", None)
    if views is None:
        return None
    grads = [view for group in views.grads for view in group]
    return {id(main): view for main, view in zip(_main_shards(optimizer), grads, strict=True)}


def _in_main_norm(param) -> bool:
    """Megatron's filter for the main norm: not in a separately clipped norm group."""
    from megatron.core.optimizer.optimizer import _get_param_grad_norm_group, _is_separate_grad_norm_group

    return not _is_separate_grad_norm_group(_get_param_grad_norm_group(param))


def _get_grads_for_grad_norm(optimizer, grad_norm_group: str | None = None) -> list[torch.Tensor]:
    """The gradients the norm counts, as Megatron chooses them (each parameter's membership, Megatron's own
    predicates on that parameter alone, remembered by identity), handed over as `contiguous_runs` of them: the
    norm's only reader sums their squares, and a few runs of DDP's buffer cost the host a few launches where a
    MoE's thousands of gradient views cost it a Python call and a list entry each, every step (the device idled
    10 ms under the norm's stack of per-tensor norms in a profiled 4-layer MoE training call on an H100)."""
    if grad_norm_group is not None:  # a separately clipped group: Megatron's own pass
        return type(optimizer).get_grads_for_grad_norm(optimizer, grad_norm_group)
    members: dict[int, tuple[weakref.ref, bool]] = optimizer._skyrl_norm_members
    grads = []
    for param in optimizer.get_parameters():
        if param.grad is None:
            continue
        known = members.get(id(param))
        if known is None or known[0]() is not param:
            known = (weakref.ref(param), bool(optimizer._filter_grads_for_norm([param], param_filter=_in_main_norm)))
            members[id(param)] = known
        if known[1]:
            grads.append(param.grad)
    if not optimizer._skyrl_shard_views.fp32:
        return grads  # fp32 copies of bf16 gradients, each its own allocation: nothing to join
    cached = optimizer._skyrl_norm_runs
    if cached is not None and len(cached[0]) == len(grads) and all(a is b for a, b in zip(cached[0], grads)):
        return cached[1]  # the same prebuilt views as at the last step
    runs = contiguous_runs(grads)
    optimizer._skyrl_norm_runs = (grads, runs)
    return runs


def contiguous_runs(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """`tensors` joined where one begins in memory right where another ends (the same storage and dtype, both
    contiguous): one flat view per run, covering exactly the elements of the tensors it joins, in memory order
    (DDP lays its buffers out in the reverse of the parameters' order). Views of a buffer with gaps between them
    (padding, a parameter left out) stay apart."""
    def address(t: torch.Tensor) -> tuple:
        return t.device.type, t.device.index or 0, t.untyped_storage().data_ptr(), t.data_ptr()

    runs: list[torch.Tensor] = []
    first = length = end = None
    for tensor in sorted(tensors, key=address):
        joins = (first is not None and tensor.is_contiguous() and tensor.dtype == first.dtype
                 and tensor.device == first.device and tensor.data_ptr() == end
                 and tensor.untyped_storage().data_ptr() == first.untyped_storage().data_ptr())
        if joins:
            length += tensor.numel()
        else:
            if first is not None:
                runs.append(first.as_strided((length,), (1,), first.storage_offset()))
            if not tensor.is_contiguous():
                runs.append(tensor)
                first = None
                continue
            first, length = tensor, tensor.numel()
        end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    if first is not None:
        runs.append(first.as_strided((length,), (1,), first.storage_offset()))
    return runs


def _nothing_after_param_sync() -> None:
    """A bucket group's post-gather work where none of its parameters has quantized storage."""


def _skip_empty_post_param_sync(optimizer) -> None:
    """Replace `_post_param_sync` on the DDP bucket groups of `optimizer`'s model chunks that have nothing to post-
    process (no parameter with quantized storage, no MXFP8 reuse of the gradient buffer)."""
    from megatron.core.distributed.param_and_grad_buffer import _param_uses_quantized_storage

    for chunk in optimizer.model_chunks:
        for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            if group.ddp_config.reuse_grad_buf_for_mxfp8_param_ag:
                continue
            if any(_param_uses_quantized_storage(param) for bucket in group.buckets for param in bucket.params):
                continue
            group._post_param_sync = _nothing_after_param_sync


def install(optimizer) -> str | None:
    """Put the prebuilt copies and norm membership on `optimizer` (one distributed optimizer, not a chain);
    returns why it keeps Megatron's methods instead, or None."""
    reason = _replaceable(optimizer)
    if reason is not None:
        return reason
    views = _ShardViews(optimizer)
    sizes = [view.numel() for view in views.params], [main.numel() for main in _main_shards(optimizer)]
    if sizes[0] != sizes[1] or [len(g) for g in views.grads] != [len(g) for g in _main_groups(optimizer)]:
        return "main shards in an order the views do not follow"
    optimizer._skyrl_shard_views = views
    optimizer._skyrl_norm_members = {}
    optimizer._skyrl_norm_runs = None
    optimizer._copy_model_grads_to_main_grads = types.MethodType(_copy_model_grads_to_main_grads, optimizer)
    optimizer._copy_main_params_to_model_params = types.MethodType(_copy_main_params_to_model_params, optimizer)
    optimizer.get_grads_for_grad_norm = types.MethodType(_get_grads_for_grad_norm, optimizer)
    _skip_empty_post_param_sync(optimizer)
    return None
