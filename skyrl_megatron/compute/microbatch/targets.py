"""Step 5, targets: what one micro-batch's model call scores and follows, in this CP rank's share.

Logprob targets (next-token labels and their mask), the real-token mask that MoE router metrics
count, and the MoE routes to replay or record (routing replay), in the order the routers see tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from skyrl_megatron.compute.logprobs import LogprobTargets
from skyrl_megatron.compute.microbatch.context_parallel import shard
from skyrl_megatron.compute.microbatch.model_inputs import ModelInputs
from skyrl_megatron.compute.microbatch.rows import IGNORE_LABEL
from skyrl_megatron.compute.route_replay import NO_ROUTE, RouteTargets
from skyrl_megatron.model.layers.context_parallel_layout import ContextParallelSplit


def logprob_targets(inputs: ModelInputs, split: ContextParallelSplit | None, device) -> LogprobTargets:
    labels = shard(split, inputs.labels)
    return LogprobTargets.on_device(labels.clamp(min=0), labels != IGNORE_LABEL, device)


def real_tokens(inputs: ModelInputs, split: ContextParallelSplit | None, device) -> torch.Tensor:
    """This rank's [b, s] real-token mask (router metrics count only real tokens)."""
    return shard(split, inputs.real_token_mask()).to(device)


def route_targets(
    inputs: ModelInputs,
    split: ContextParallelSplit | None,
    routes: torch.Tensor | None,
    router_order: Callable[[torch.Tensor], torch.Tensor],
    device,
) -> RouteTargets:
    """`routes` [b, S, L, k] in the host's columns (None: record only) -> this rank's tokens, in the
    order its routers see them (`router_order`), with the padding marked."""
    own = None if routes is None else router_order(shard(split, inputs.from_host_layout(routes, NO_ROUTE)))
    return RouteTargets.of(own, router_order(shard(split, ~inputs.real_token_mask())), device)
