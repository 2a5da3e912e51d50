"""Megatron's alltoall token dispatcher at EP > 1 with every size on the device (opt-in:
``megatron_config.moe_config.device_all_to_all``).

Megatron's `MoEAlltoAllTokenDispatcher` computes its split sizes and counts on the device
(`preprocess`: an all-gather of the counts over the EP group), then copies them to the host and
waits (`_maybe_dtoh_and_synchronize`) because `all_to_all_single` and its chunk regrouping take host
sizes. `DeviceAllToAllDispatcher` keeps Megatron's preprocessing and its permutation (our gathers,
`model/moe/token_permute.py`), skips the copy, and moves tokens and probabilities with
`model/moe/device_all_to_all.py`: the experts' input is then sized for the worst case (every EP rank
sends all its rows here), its first `sum(tokens_per_expert)` rows grouped by local expert, then
source rank, as Megatron's. The rows past them are padding: the grouped GEMMs' offsets end at the
real total (`model/moe/experts.py`), everything between them is row-wise, and `combine` sends only the
real rows back, so no padding row reaches the layer's output or a weight gradient.

Overridden: `_maybe_dtoh_and_synchronize` (no copy), `token_dispatch` / `token_combine` (the device
exchange), `dispatch_postprocess` / `combine_preprocess` (the regrouping is part of the exchange;
expert TP, whose all-gather needs host sizes, is refused before this is built). Everything else,
shared-expert overlap included, is Megatron's.

The cost of static shapes: the experts' activations (fc1 output, activation, fc2 output, and what
autograd saves of them) are allocated for the worst case, EP x this rank's rows, about EP times what
the real rows need; a memory figure to measure on GPUs alongside the speed.

Every rank of the EP group must route as many tokens per micro-batch (the worst case is `EP x` this
rank's rows): `needs_equal_token_counts` makes the micro-batch planner give them one shape.
"""

from __future__ import annotations

from skyrl_megatron.model.moe.device_all_to_all import ExchangePlan, combine, dispatch
from skyrl_megatron.model.moe.row_exchange import exchange_unavailable, row_exchange_for

_classes: dict[str, type] = {}


def device_all_to_all_dispatcher_class() -> type:
    """`DeviceAllToAllDispatcher`, built on first use (Megatron is imported late)."""
    if "dispatcher" not in _classes:
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

        class DeviceAllToAllDispatcher(MoEAlltoAllTokenDispatcher):
            """Megatron's alltoall dispatcher whose all-to-alls take their sizes on the device (module docstring)."""

            _plan: ExchangePlan | None = None
            # the worst case is EP x this rank's rows, and the symmetric buffers are allocated by
            # shape on every rank together: micro-batches share one shape across the EP group
            # (read by model/moe/settings.py dispatch_needs_equal_token_counts)
            needs_equal_token_counts = True

            def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
                return tokens_per_expert  # splits and counts stay where preprocess computed them

            def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
                if self.shared_experts is not None:
                    self.shared_experts.wait_current_stream()
                rows = permutated_local_input_tokens.shape[0]
                if self.num_local_experts > 1:
                    received = self.num_global_tokens_per_local_expert.view(self.ep_size, self.num_local_experts)
                else:  # preprocess keeps the per-expert counts only for several local experts
                    received = self.output_splits.view(self.ep_size, 1)
                self._plan = ExchangePlan(row_exchange_for(self.ep_group), send_splits=self.input_splits,
                                          received_counts=received, rows=rows, capacity=rows * self.ep_size)
                global_input_tokens = dispatch(permutated_local_input_tokens, self._plan)
                if self.shared_experts is not None:
                    self.shared_experts.linear_fc1_forward_and_act(global_input_tokens)
                return global_input_tokens, dispatch(permuted_probs, self._plan)

            def dispatch_postprocess(self, global_input_tokens, global_probs):
                tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
                return global_input_tokens, tokens_per_expert, global_probs

            def combine_preprocess(self, hidden_states):
                return hidden_states

            def token_combine(self, hidden_states, async_finish=True, allocate_on_comm_stream=True):
                if self.shared_experts is not None:
                    self.shared_experts.wait_current_stream()
                output = combine(hidden_states, self._plan)
                self._plan = None
                if self.shared_experts is not None:
                    self.shared_experts.linear_fc2_forward(output)
                    self.shared_experts.post_forward_comm()
                return output

        DeviceAllToAllDispatcher.__module__ = __name__
        _classes["dispatcher"] = DeviceAllToAllDispatcher
    return _classes["dispatcher"]


def exchange_can_apply(config, dispatcher, experts) -> str | None:
    """Why `DeviceAllToAllDispatcher` cannot replace this layer's dispatcher, or None if it can."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from skyrl_megatron.model.moe.experts import grouped_experts_class

    if not isinstance(dispatcher, MoEAlltoAllTokenDispatcher):
        return f"it needs the alltoall token dispatcher, not {type(dispatcher).__name__}"
    if dispatcher.tp_size != 1:
        return "expert tensor parallelism gathers tokens by host split sizes: it needs expert_tensor_parallel_size=1"
    if config.moe_expert_capacity_factor is not None or config.moe_pad_expert_input_to_capacity \
            or config.moe_router_padding_for_quantization:
        return "it needs dropless top-k routing (no capacity factor, no padding to capacity or for quantization)"
    if config.cuda_graph_impl != "none" or config.transformer_impl == "inference_optimized":
        return "it does not run under CUDA graphs or inference-optimised layers"
    if not isinstance(experts, grouped_experts_class()):
        return "it needs grouped experts (moe_grouped_gemm=true, no LoRA on the experts)"
    return exchange_unavailable(dispatcher.ep_group)
