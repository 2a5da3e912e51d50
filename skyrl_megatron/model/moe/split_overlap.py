"""An MoE layer's forward in two halves of its tokens, so that all-to-alls overlap expert compute
(opt-in: ``megatron_config.moe_config.overlap_all_to_all``; EP > 1).

Megatron's alltoall dispatcher runs route -> permute -> all-to-all -> experts -> all-to-all ->
unpermute, each exchange waited for before the next step starts: at EP2 the exchanges are 16% of an
H200's time in a Qwen3-30B-A3B step, idle for the compute units. Here the router runs once on all
tokens (its choices, load-balancing losses and recorded routes are those of the whole micro-batch),
then the tokens are cut into two halves, each with its own dispatcher (their split sizes and
permutations are per half):

    forward   permute A, permute B | send A, send B | wait A: experts A   (B's exchange runs under them)
              | return A | wait B: experts B (A's return runs under them) | return B | unpermute A, B
    backward  the same in reverse (`model/moe/async_all_to_all.py`): A's return gradient travels
              under B's expert backward, B's dispatch gradient under A's

so about half of the exchange time hides under expert GEMMs, in scoring and training alike, without
another micro-batch in flight (no schedule change: PP, VPP and forward-only passes run as they are).
Expert tensor parallelism keeps Megatron's all-gather and reduce-scatter per half, blocking.

Every token's output is computed as before (its k expert rows, summed by the same unpermutation), but
the experts' GEMMs run on half the rows each: a kernel may pick another algorithm for fewer rows (on
CPU a single row takes a matrix-vector product), and each expert weight gradient is the sum of two
halves' GEMMs. Results agree to rounding, not bitwise (tests/test_moe_overlap.py states the bound).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from skyrl_megatron.model.moe.async_all_to_all import PendingAllToAll, start_all_to_all


def split_overlap_can_apply(config, dispatcher) -> str | None:
    """Why this layer's forward cannot run in halves, or None if it can."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if type(dispatcher) is not MoEAlltoAllTokenDispatcher:
        return (f"it runs Megatron's alltoall exchange in two halves, and this layer's dispatcher is "
                f"{type(dispatcher).__name__} (token_dispatcher must be alltoall, device_all_to_all false)")
    if config.moe_expert_capacity_factor is not None or config.moe_pad_expert_input_to_capacity \
            or config.moe_router_padding_for_quantization:
        return "a capacity or padding computed per half would drop or pad other tokens: it needs dropless routing"
    if config.moe_shared_expert_overlap:
        return "moe_shared_expert_overlap runs the shared experts inside the exchange it replaces"
    if config.moe_latent_size:
        return "latent MoE projections are not split"
    if config.overlap_moe_expert_parallel_comm:
        return "Megatron's own overlap_moe_expert_parallel_comm calls the layer's steps one by one, not its forward"
    if config.cuda_graph_impl != "none" or config.transformer_impl == "inference_optimized":
        return "it does not run under CUDA graphs or inference-optimised layers"
    return None


def half_sizes(tokens: int) -> list[int]:
    """The two halves' token counts (the first takes the odd one: a one-token micro-batch leaves the
    second half empty, which still joins its exchanges, so every EP rank runs the same collectives)."""
    return [tokens - tokens // 2, tokens // 2]


def forward_in_halves(layer, dispatchers: list, hidden_states: Tensor, padding_mask: Tensor | None = None):
    """`MoELayer.forward` (same arguments and result) with the two halves' exchanges and experts interleaved."""
    from megatron.core import tensor_parallel

    if layer.training and layer.attn_tp_group.size() > 1 and not layer.config.sequence_parallel:
        raise ValueError("MoE with tensor parallelism trains with sequence parallelism (Megatron's rule)")
    if padding_mask is not None:
        padding_mask = padding_mask.transpose(0, 1).bool()  # [b, s] -> [s, b], as MoELayer.forward
    run = functools.partial(_in_halves, layer, dispatchers)
    if layer.moe_layer_recompute and layer.training:
        return tensor_parallel.checkpoint(run, False, hidden_states, padding_mask)
    return run(hidden_states, padding_mask)


def _in_halves(layer, dispatchers: list, hidden_states: Tensor, padding_mask: Tensor | None):
    shared_output = layer.shared_experts_compute(hidden_states)
    probs, routing_map = layer.route(hidden_states, padding_mask)
    tokens = hidden_states.view(-1, hidden_states.shape[-1])
    sizes = half_sizes(tokens.shape[0])
    permuted = [dispatcher.dispatch_preprocess(x, m, p) for dispatcher, x, m, p
                in zip(dispatchers, tokens.split(sizes), routing_map.split(sizes), probs.split(sizes))]
    sent = [_send(dispatcher, x, p) for dispatcher, (x, p) in zip(dispatchers, permuted)]
    returned = []
    for dispatcher, (rows, row_probs) in zip(dispatchers, sent):
        out = _experts(layer, dispatcher, rows.wait(), row_probs.wait())
        # back along the way it came: what was received is sent, and the other way round
        returned.append(start_all_to_all(out, dispatcher.ep_group, dispatcher.output_splits, dispatcher.input_splits))
    halves = [dispatcher.combine_postprocess(back.wait()) for dispatcher, back in zip(dispatchers, returned)]
    output = torch.cat(halves).view(hidden_states.shape)
    if shared_output is not None:
        output = output + shared_output
    return output, None


def _send(dispatcher, rows: Tensor, probs: Tensor) -> tuple[PendingAllToAll, PendingAllToAll]:
    """The dispatcher's `token_dispatch` without its waits: the split sizes on the host (its own wait for
    them, as Megatron's), then the tokens' and probabilities' exchanges started."""
    dispatcher.tokens_per_expert = dispatcher._maybe_dtoh_and_synchronize("before_ep_alltoall", dispatcher.tokens_per_expert)
    group, sent, received = dispatcher.ep_group, dispatcher.input_splits, dispatcher.output_splits
    return start_all_to_all(rows, group, sent, received), start_all_to_all(probs, group, sent, received)


def _experts(layer, dispatcher, rows: Tensor, probs: Tensor) -> Tensor:
    """`MoELayer.routed_experts_compute` with this half's dispatcher."""
    expert_input, tokens_per_expert, expert_probs = dispatcher.dispatch_postprocess(rows, probs)
    expert_output, bias = layer.experts(expert_input, tokens_per_expert, expert_probs)
    assert bias is None, "the alltoall dispatcher takes no expert bias"
    return dispatcher.combine_preprocess(expert_output)
