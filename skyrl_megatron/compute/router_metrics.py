"""Per-layer router statistics of MoE training: expert load imbalance and dropped tokens.

A :class:`RouterMetrics` collector puts a forward hook on every router of the model chunks and
tallies, per MoE layer, how many real tokens each expert receives. Over a mini-batch (between
:meth:`RouterMetrics.reset` and :meth:`RouterMetrics.summary`) it reports

* ``moe/layer_{i}/load_imbalance``: max expert load / mean expert load of layer i (0-based, as in
  the HF names), 1.0 for perfect balance and at most E / top-k when every token picks the same experts;
* ``moe/max_load_imbalance``: the largest of those;
* ``moe/layer_{i}/dropped_token_fraction`` and ``moe/dropped_token_fraction`` (all layers): the
  share of the (token, expert) choices of the top-k routing that the capacity factor dropped;
  exactly 0 without ``moe_expert_capacity_factor``.

An expert's load is the number of real tokens routed to it after capacity dropping (what the
dispatcher delivers). Only real tokens count: the runner announces each micro-batch's real-token
mask (prepared with it, in the routers' order: compute/microbatch/shard.py) through :meth:`RouterMetrics.start_forward`
right before the model call. Megatron's own ``padding_mask`` argument is not used for this, because
0.19.2 mishandles it (the expert-bias update broadcasts a [tokens] mask against the [tokens, experts]
routing map, and pipeline stages after the first do not split it for sequence parallelism).

Tallies count only training forwards (routers in train mode), once per micro-batch: activation
recompute runs a router again in the backward pass, and that second call is recognised and skipped.
Every rank routes distinct tokens through its layers (sequence parallelism splits them over TP,
the batch is split over DP and CP, and EP ranks are DP ranks), so sums over the tensor x data x
context group and then over the pipeline stages give the numbers of a single-rank run. Capacity
dropping itself is per rank and micro-batch (Megatron decides it over the local tokens), so the
dropped fraction depends on the layout; load imbalance without dropping does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from skyrl_megatron.compute.pending_metrics import PendingMetrics
from skyrl_megatron.model.moe.settings import routers
from skyrl_megatron.runtime import current_runtime


@dataclass(frozen=True)
class ReductionGroups:
    """Where the tallies are summed: over ranks that route different tokens through the same
    layers, then over ranks that hold different layers."""

    tokens: Any  # torch ProcessGroup: tensor x data x context parallel
    stages: Any  # torch ProcessGroup: pipeline parallel

    @classmethod
    def from_parallel_state(cls) -> "ReductionGroups":
        from megatron.core import parallel_state as ps

        return cls(
            tokens=ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
            stages=ps.get_pipeline_model_parallel_group(),
        )


@dataclass
class _LayerTally:
    layer: int  # 0-based global layer index
    chunk: int  # index of the model chunk that holds the layer
    expert_tokens: torch.Tensor  # [E] int64: real tokens each expert received
    real_tokens: torch.Tensor  # [] int64: real tokens routed
    counted_forward: int = -1  # the chunk's forward pass last counted (recompute runs the router again)


@dataclass
class _ChunkForward:
    number: int = -1  # forward passes announced so far (minus one)
    real_tokens: torch.Tensor | None = None  # [tokens] bool, in the order the chunk's routers see tokens


class RouterMetrics:
    """Load imbalance and dropped tokens per MoE layer; see the module docstring."""

    def __init__(self, chunks: list[torch.nn.Module]):
        from megatron.core.utils import get_model_config

        self.chunks = chunks
        self._chunk_index = {id(chunk): index for index, chunk in enumerate(chunks)}
        self.config = get_model_config(chunks[0])
        self.is_moe = bool(self.config.num_moe_experts)
        self._forwards = [_ChunkForward() for _ in chunks]
        self._tallies: list[_LayerTally] = []
        for index, router in routers(chunks):
            if router.is_mtp_layer:  # multi-token prediction layers share layer numbers with the decoder's
                continue
            tally = _LayerTally(
                layer=router.layer_number - 1,
                chunk=index,
                expert_tokens=torch.zeros(router.num_experts, dtype=torch.long, device=router.weight.device),
                real_tokens=torch.zeros((), dtype=torch.long, device=router.weight.device),
            )
            self._tallies.append(tally)
            router.register_forward_hook(self._hook(tally))

    @classmethod
    def attach(cls, chunks: list[torch.nn.Module]) -> "RouterMetrics":
        """A collector hooked into every router of `chunks` (none for a dense model: summaries are empty)."""
        return cls(chunks)

    def reset(self) -> None:
        for tally in self._tallies:
            tally.expert_tokens.zero_()
            tally.real_tokens.zero_()

    def start_forward(self, chunk: torch.nn.Module, real_tokens: torch.Tensor) -> None:
        """Announce the next forward pass of `chunk`; `real_tokens` [tokens] marks its real tokens in the
        order its routers see them ([s, b] flattened, this TP rank's slice of s under sequence
        parallelism: `compute/microbatch/shard.py`)."""
        forward = self._forwards[self._chunk_index[id(chunk)]]
        forward.number += 1
        if not self.is_moe:
            return
        forward.real_tokens = real_tokens

    def _hook(self, tally: _LayerTally):
        pad_to_capacity = bool(self.config.moe_pad_expert_input_to_capacity)

        def hook(router, args, output) -> None:
            if not router.training:
                return
            forward = self._forwards[tally.chunk]
            if tally.counted_forward == forward.number:
                return  # the same micro-batch again: activation recompute in the backward pass
            if forward.real_tokens is None:
                raise RuntimeError("RouterMetrics: a training forward ran without start_forward (no real-token mask)")
            probs, routing_map = output
            real = forward.real_tokens.to(routing_map.device)
            if real.numel() != routing_map.shape[0]:
                raise RuntimeError(
                    f"RouterMetrics: layer {tally.layer} routed {routing_map.shape[0]} tokens, but the announced "
                    f"mask covers {real.numel()}"
                )
            # padded to capacity, the map also marks empty slots; those carry zero probability
            kept = routing_map & (probs != 0) if pad_to_capacity else routing_map
            tally.expert_tokens += (kept & real.unsqueeze(1)).sum(dim=0)
            tally.real_tokens += real.sum()
            tally.counted_forward = forward.number

        return hook

    def summary(self, groups: ReductionGroups | None = None) -> dict[str, float]:
        """The mini-batch's metrics, the same on every rank. Collective: every rank of the model calls it."""
        return self.pending_summary(groups).read()

    def pending_summary(self, groups: ReductionGroups | None = None) -> PendingMetrics:
        """`summary` with its table's reductions queued, read later (`PendingMetrics`). Collective."""
        if not self.is_moe:
            return PendingMetrics()
        groups = groups or ReductionGroups.from_parallel_state()
        experts = self.config.num_moe_experts
        device = current_runtime().torch_device  # stages without MoE layers join the sum too
        # rows: layers; columns: tokens per expert, real tokens, whether the layer is an MoE layer
        table = torch.zeros(self.config.num_layers, experts + 2, dtype=torch.float64, device=device)
        for tally in self._tallies:
            table[tally.layer, :experts] = tally.expert_tokens.to(torch.float64)
            table[tally.layer, experts] = tally.real_tokens.to(torch.float64)
            table[tally.layer, experts + 1] = 1.0
        for group in (groups.tokens, groups.stages):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(table, group=group)
        topk = self.config.moe_router_topk
        return PendingMetrics(lambda: _metrics(table.cpu(), experts, topk))


def _metrics(table: torch.Tensor, experts: int, topk: int) -> dict[str, float]:
    metrics: dict[str, float] = {}
    imbalances, chosen_total, dropped_total = [], 0.0, 0.0
    for layer, row in enumerate(table):
        if row[experts + 1] == 0 or row[experts] == 0:  # a dense layer, or no tokens seen
            continue
        loads, chosen = row[:experts], float(row[experts]) * topk
        received = float(loads.sum())
        dropped = chosen - received
        metrics[f"moe/layer_{layer}/dropped_token_fraction"] = dropped / chosen
        chosen_total += chosen
        dropped_total += dropped
        if received > 0:
            imbalance = float(loads.max()) / (received / experts)
            metrics[f"moe/layer_{layer}/load_imbalance"] = imbalance
            imbalances.append(imbalance)
    if chosen_total:
        metrics["moe/dropped_token_fraction"] = dropped_total / chosen_total
    if imbalances:
        metrics["moe/max_load_imbalance"] = max(imbalances)
    return metrics
