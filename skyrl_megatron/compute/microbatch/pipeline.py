"""rows -> plan -> model inputs -> context-parallel shard -> targets: a rank's rows as the micro-batches
`ModelRunner` hands to Megatron's schedules, prepared in one pass, in that order."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from skyrl_megatron.compute.microbatch.context_parallel import context_split, shard
from skyrl_megatron.compute.microbatch.inputs import build_model_inputs
from skyrl_megatron.compute.microbatch.model_inputs import MicroBatch
from skyrl_megatron.compute.microbatch.plan import MicroBatching, plan_schedule
from skyrl_megatron.compute.microbatch.rows import RowSpans
from skyrl_megatron.compute.microbatch.targets import logprob_targets, real_tokens, route_targets
from skyrl_megatron.parallel import ParallelConfig


@dataclass
class MicroBatches:
    """A schedule call's micro-batches and the (rows, columns) shape the schedule is told."""

    micro_batches: list[MicroBatch]
    shape: tuple[int, int]


def prepare_micro_batches(
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    batching: MicroBatching,
    parallel: ParallelConfig,
    *,
    device: torch.device,
    pad_token_id: int = 0,
    equal_token_counts: bool = False,
    response: Mapping[str, torch.Tensor] | None = None,
    routes: torch.Tensor | None = None,
    router_order: Callable[[torch.Tensor], torch.Tensor] | None = None,
    with_real_tokens: bool = False,
) -> MicroBatches:
    """This rank's rows `sequences` [B, S] as micro-batches (collective: ranks agree on the count).

    `response` [B, A] tensors are sliced per micro-batch; `with_real_tokens` adds the real-token mask
    (MoE router metrics). With a `router_order` (routing replay), each micro-batch carries `routes`
    [B, S, L, k] (host columns; None: record only) in the order the routers see its tokens.
    """
    # 1. rows
    spans = RowSpans.from_attention_mask(attention_mask)
    # 2. plan
    schedule = plan_schedule(
        spans.length, batching, parallel, equal_token_counts=equal_token_counts, device=device
    )
    cp_rank = 0
    if parallel.context > 1:
        from megatron.core import parallel_state as ps

        cp_rank = ps.get_context_parallel_rank()
    micro_batches = []
    for rows in schedule.plan.groups:
        # 3. model inputs
        inputs = build_model_inputs(
            sequences[rows], attention_mask[rows], schedule.settings, pad_token_id=pad_token_id,
            padded_shape=schedule.padded_shape(rows), spans=RowSpans(spans.start[rows], spans.length[rows]),
        )
        # 4. context-parallel shard
        split = context_split(inputs, cp_rank, parallel.context)
        # 5. targets (and routes)
        targets = logprob_targets(inputs, split, device)
        sliced = {k: v[rows].to(device) for k, v in (response or {}).items() if v is not None}
        if inputs.packed_seq_params is not None:
            inputs.packed_seq_params = _params_on(inputs.packed_seq_params, device)
        mb_routes = None
        if router_order is not None:
            mb_routes = route_targets(inputs, split, None if routes is None else routes[rows], router_order, device)
        micro_batches.append(
            MicroBatch(
                inputs=inputs,
                model_input_ids=shard(split, inputs.input_ids).to(device),
                model_position_ids=shard(split, inputs.position_ids).to(device),
                targets=targets,
                rows=rows,
                response=sliced,
                cp_split=split,
                real_tokens=real_tokens(inputs, split, device) if with_real_tokens else None,
                routes=mb_routes,
            )
        )
    return MicroBatches(micro_batches, schedule.shape)


def _params_on(params, device):
    """PackedSeqParams with its index tensors on `device` (attention kernels read them there).

    Fields that share one tensor (self-attention's query and key boundaries, padded or not) still share
    one after the move: one copy each, and the rotation tables (`model/layers/rope.py`), cached by the
    boundaries' identity, are computed once per micro-batch instead of once per layer and direction."""
    moved_by_id: dict[int, torch.Tensor] = {}
    moved = {}
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if isinstance(value, torch.Tensor):
            if id(value) not in moved_by_id:
                moved_by_id[id(value)] = value.to(device)
            moved[f.name] = moved_by_id[id(value)]
    return dataclasses.replace(params, **moved)
