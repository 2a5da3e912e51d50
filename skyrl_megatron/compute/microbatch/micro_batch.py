"""Step 5, model inputs and targets: a rank's share of a micro-batch, on the device, as its model call takes it.

The model inputs (token ids, positions, packed boundaries), what the call scores (logprob targets:
next-token labels and their mask) and what its routers follow (the real-token mask that MoE router
metrics count, the routes to replay or record), with the response tensors of its rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from skyrl_megatron.compute.logprobs import LogprobTargets
from skyrl_megatron.compute.microbatch.pack import ModelInputs
from skyrl_megatron.compute.microbatch.rows import IGNORE_LABEL
from skyrl_megatron.compute.microbatch.shard import RankShare, SequenceParallelSlice
from skyrl_megatron.compute.route_replay import RouteTargets
from skyrl_megatron.host_copies import to_device
from skyrl_megatron.model.layers.context_parallel_layout import ContextParallelSplit


@dataclass
class MicroBatch:
    """One micro-batch, ready for the model call."""

    inputs: ModelInputs  # global (all CP ranks' tokens), for mapping outputs back
    model_input_ids: torch.Tensor  # this CP rank's share of the tokens, on the device
    model_position_ids: torch.Tensor
    targets: LogprobTargets  # this CP rank's share, on the device
    rows: torch.Tensor  # indices into the rank's batch
    response: dict[str, torch.Tensor]  # [rows, A] slices of the response tensors
    cp_split: ContextParallelSplit | None = None
    sp_slice: SequenceParallelSlice = SequenceParallelSlice()  # the routers' share of this CP rank's tokens
    real_tokens: torch.Tensor | None = None  # [tokens] bool in the routers' order, for router metrics
    routes: RouteTargets | None = None  # MoE routes to replay or record, in the routers' order
    recorded: dict[int, torch.Tensor] | None = None  # routes recorded by this rank's routers {layer: [tokens, k]}


def micro_batch(
    inputs: ModelInputs,
    share: RankShare,
    rows: torch.Tensor,
    response: Mapping[str, torch.Tensor] | None,
    device: torch.device,
) -> MicroBatch:
    """The micro-batch of `rows` for the model call on `device`: `share` of its `inputs`, and the `response`
    [B, A] tensors' rows. The copies do not wait for the device (`host_copies`): a micro-batch is prepared while
    the one before runs."""
    if inputs.packed_seq_params is not None:
        inputs.packed_seq_params = _params_on(inputs.packed_seq_params, device)
    return MicroBatch(
        inputs=inputs,
        model_input_ids=to_device(share.input_ids, device),
        model_position_ids=to_device(share.position_ids, device),
        targets=LogprobTargets.on_device(share.labels.clamp(min=0), share.labels != IGNORE_LABEL, device),
        rows=rows,
        response={k: to_device(v[rows], device) for k, v in (response or {}).items() if v is not None},
        cp_split=share.cp_split,
        sp_slice=share.sp_slice,
        real_tokens=None if share.real_tokens is None else to_device(share.real_tokens, device),
        routes=None if share.padding is None else RouteTargets.of(share.routes, share.padding, device),
    )


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
                moved_by_id[id(value)] = to_device(value, device)
            moved[f.name] = moved_by_id[id(value)]
    return dataclasses.replace(params, **moved)
