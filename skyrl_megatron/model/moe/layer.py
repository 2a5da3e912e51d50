"""The MoE layer of our local (TE-free) spec: token counts stay on the device where nothing needs them on the host.

Megatron-Core's alltoall dispatcher copies the tokens-per-expert counts (and the all-to-all split
sizes) to the host on a side stream and waits for that copy in every MoE layer and pass
(`_maybe_dtoh_and_synchronize`): the all-to-all needs host split sizes, and TE's grouped linears
and `SequentialMLP` need host counts. With one expert-parallel rank and no expert tensor
parallelism there is no all-to-all or all-gather, and in the dropless case every size is static
(tokens x top-k); our grouped experts (`model/moe/experts.py`) take the counts as a device tensor, and
the chunk regrouping between dispatch and experts is the identity (`model/moe/token_sort.py` returns
its input). The wait is then only a stall: the host cannot queue the next layers' kernels until
the device has caught up.

`GroupedMoELayer` is Megatron's `MoELayer` whose alltoall dispatcher, in that case only, keeps
the counts on the device (`DeviceCountsDispatcher`). Every other case (EP > 1, expert TP > 1, token
dropping or padding to capacity, router padding, another dispatcher, other experts, inference-
optimised layers, CUDA graphs) keeps Megatron's dispatcher as it is. Megatron's non-fused `permute`
is already free of data-dependent sizes for dropless routing (an argsort, not masked_select), and
its `unpermute` is a scatter-add: neither reads the host (their scatters are replaced for speed, below).

`set_counts_on_device(model, False)` restores the copy-and-wait (the previous path) for
comparisons and benchmarks.

Where routing is dropless top-k with the alltoall dispatcher (any EP size), the layer also permutes
and unpermutes its tokens by gathers (`model/moe/token_permute.py`) instead of Megatron's scatter-adds.
Its router's fp32 gating GEMM takes bf16 operands with an fp32 output (`model/moe/router_gating.py`).

At EP > 1, `use_device_all_to_all(chunks)` (a pre-wrap hook, on with
``moe_config.device_all_to_all``) gives every such layer `DeviceAllToAllDispatcher`
(`model/moe/exchange_dispatcher.py`): the all-to-alls take their sizes on the device as well.
`use_split_overlap(chunks)` (``moe_config.overlap_all_to_all``) makes every such layer run its forward
in two halves of its tokens whose all-to-alls overlap the other half's experts
(`model/moe/split_overlap.py`); `set_split_overlap` switches it for comparisons.
"""

from __future__ import annotations

from torch import nn

from skyrl_megatron.config import ConfigError, Problem
from skyrl_megatron.model.moe import router_gating, token_permute, token_sort
from skyrl_megatron.model.moe.exchange_dispatcher import device_all_to_all_dispatcher_class, exchange_can_apply
from skyrl_megatron.model.moe.split_overlap import forward_in_halves, split_overlap_can_apply

_classes: dict[str, type] = {}


def _dispatcher_class() -> type:
    """DeviceCountsDispatcher, built on first use (Megatron is imported late)."""
    if "dispatcher" not in _classes:
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

        class DeviceCountsDispatcher(MoEAlltoAllTokenDispatcher):
            """Megatron's alltoall dispatcher without the device-to-host copy and wait at EP1.

            Overrides `_maybe_dtoh_and_synchronize`, the one place the dispatcher moves its counts
            to the host and waits: with `counts_on_device` it hands `tokens_per_expert` on as the
            device tensor it is. Only built where no collective needs host sizes (see
            `GroupedMoELayer`); the split sizes it would also copy are None there.
            """

            counts_on_device = True

            def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
                if self.counts_on_device:
                    return tokens_per_expert
                return super()._maybe_dtoh_and_synchronize(point, tokens_per_expert)

        DeviceCountsDispatcher.__module__ = __name__
        _classes["dispatcher"] = DeviceCountsDispatcher
    return _classes["dispatcher"]


def counts_can_stay_on_device(config, dispatcher, experts) -> bool:
    """Whether no step of this MoE layer needs the token counts on the host (see the module docstring)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from skyrl_megatron.model.moe.experts import grouped_experts_class

    return (
        type(dispatcher) is MoEAlltoAllTokenDispatcher
        and dispatcher.ep_size == 1
        and dispatcher.tp_size == 1  # expert tensor parallelism all-gathers by host split sizes
        and not config.moe_pad_expert_input_to_capacity
        and config.moe_expert_capacity_factor is None  # dropping: the output size is data-dependent
        and not config.moe_router_padding_for_quantization
        and config.cuda_graph_impl == "none"
        and config.transformer_impl != "inference_optimized"
        and isinstance(experts, grouped_experts_class())
    )


def routing_is_regular(config, dispatcher) -> bool:
    """Whether every token reaches exactly top-k experts' rows (`model/moe/token_permute.py` relies on it):
    the alltoall dispatcher, dropless, no padding of any kind."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    return (
        isinstance(dispatcher, MoEAlltoAllTokenDispatcher)
        and config.moe_expert_capacity_factor is None
        and not config.moe_pad_expert_input_to_capacity
        and not config.moe_router_padding_for_quantization
        and config.cuda_graph_impl == "none"
    )


def grouped_moe_layer_class() -> type:
    """`GroupedMoELayer`: Megatron's MoELayer, its dispatcher swapped for `DeviceCountsDispatcher` where it can be."""
    if "layer" not in _classes:
        from megatron.core.transformer.moe.moe_layer import MoELayer, get_default_pg_collection

        class GroupedMoELayer(MoELayer):
            # set by `use_split_overlap`: the forward in two halves, the second half's dispatcher
            split_overlap = False
            _second_half_dispatcher = None

            def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, **kwargs):
                if pg_collection is None:
                    pg_collection = get_default_pg_collection()
                super().__init__(config, submodules, layer_number, pg_collection, **kwargs)
                router_gating.install()  # the fp32 gating GEMM without upcast operands (router_gating.py)
                self.dispatcher_pg_collection = pg_collection  # to build another dispatcher later
                # MoELayer builds its dispatcher inline (no spec entry), so the choice is made here,
                # after the experts exist: the device-resident counts are only for experts that read them.
                if counts_can_stay_on_device(config, self.token_dispatcher, self.experts):
                    token_sort.install()  # Megatron's own regrouping would read the counts on the host
                    self.token_dispatcher = _dispatcher_class()(
                        self.num_local_experts, self.local_expert_indices, config=config, pg_collection=pg_collection
                    )
                    if self.use_shared_expert and self.shared_expert_overlap:
                        self.token_dispatcher.set_shared_experts(self.shared_experts)
                self._route_regularly_if_possible()

            def _route_regularly_if_possible(self, dispatcher=None):
                dispatcher = dispatcher or self.token_dispatcher
                if routing_is_regular(self.config, dispatcher):
                    token_permute.install()
                    token_permute.route_regularly(dispatcher, self.config.moe_router_topk)

            def forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
                if self.split_overlap and intermediate_tensors is None:
                    dispatchers = [self.token_dispatcher, self._second_half_dispatcher]
                    return forward_in_halves(self, dispatchers, hidden_states, padding_mask)
                return super().forward(hidden_states, intermediate_tensors, padding_mask)

            def use_split_overlap(self) -> str | None:
                """Run the forward in two overlapped halves (EP > 1); why it cannot, or None once it does."""
                why = split_overlap_can_apply(self.config, self.token_dispatcher)
                if why is not None:
                    return why
                if self._second_half_dispatcher is None:
                    self._second_half_dispatcher = type(self.token_dispatcher)(
                        self.num_local_experts, self.local_expert_indices, config=self.config,
                        pg_collection=self.dispatcher_pg_collection,
                    )
                    self._route_regularly_if_possible(self._second_half_dispatcher)
                self.split_overlap = True
                return None

            def use_device_all_to_all(self) -> str | None:
                """Swap in `DeviceAllToAllDispatcher` (EP > 1); why it cannot apply, or None once it has."""
                why = exchange_can_apply(self.config, self.token_dispatcher, self.experts)
                if why is not None:
                    return why
                self.token_dispatcher = device_all_to_all_dispatcher_class()(
                    self.num_local_experts, self.local_expert_indices, config=self.config,
                    pg_collection=self.dispatcher_pg_collection,
                )
                if self.use_shared_expert and self.shared_expert_overlap:
                    self.token_dispatcher.set_shared_experts(self.shared_experts)
                self._route_regularly_if_possible()
                return None

        GroupedMoELayer.__module__ = __name__
        _classes["layer"] = GroupedMoELayer
    return _classes["layer"]


def set_counts_on_device(model: nn.Module | list, on: bool) -> int:
    """Switch every `DeviceCountsDispatcher` under `model` (a module or chunks); returns how many there are.

    Off, each waits for the counts on the host as Megatron's dispatcher does (the previous path).
    """
    chunks = model if isinstance(model, list) else [model]
    switched = 0
    for chunk in chunks:
        for module in chunk.modules():
            if "dispatcher" in _classes and isinstance(getattr(module, "token_dispatcher", None), _classes["dispatcher"]):
                module.token_dispatcher.counts_on_device = on
                switched += 1
    return switched


def _ep_moe_layers(chunks: list):
    """(name, layer) for every MoE layer of the chunks with more than one expert-parallel rank."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    for chunk in chunks:
        for name, module in chunk.named_modules():
            if isinstance(module, MoELayer) and getattr(module.token_dispatcher, "ep_size", 1) > 1:
                yield name, module


def _apply_to_ep_layers(chunks: list, key: str, apply) -> list:
    """`apply(layer)` (why it cannot, or None once it has) on every MoE layer of the chunks at EP > 1; the
    first that cannot is a configuration error naming ``megatron_config.moe_config.<key>`` (every layer has
    the same reason; the config checks catch these cases before any worker starts)."""
    for name, module in _ep_moe_layers(chunks):
        if isinstance(module, grouped_moe_layer_class()):
            why = apply(module)
        else:
            why = f"{type(module).__name__} is not our grouped MoE layer (Transformer Engine's spec, or moe_grouped_gemm=false)"
        if why is not None:
            raise ConfigError([Problem(f"megatron_config.moe_config.{key}", f"{name}: {why}", f"meet that, or set {key}=false")])
    return chunks


def use_split_overlap(chunks: list) -> list:
    """Pre-wrap hook of ``moe_config.overlap_all_to_all``: every MoE layer at EP > 1 runs its forward in
    two halves whose all-to-alls overlap expert compute (`model/moe/split_overlap.py`). At EP1 there is no
    all-to-all and nothing changes. A layer it cannot apply to is a configuration error naming the key."""
    return _apply_to_ep_layers(chunks, "overlap_all_to_all", lambda layer: layer.use_split_overlap())


def set_split_overlap(model: nn.Module | list, on: bool) -> int:
    """Switch the halves of every MoE layer that `use_split_overlap` prepared (a module or chunks);
    returns how many there are. Off, each runs Megatron's forward (the previous path)."""
    chunks = model if isinstance(model, list) else [model]
    switched = 0
    for _, module in _ep_moe_layers(chunks):
        if getattr(module, "_second_half_dispatcher", None) is not None:
            module.split_overlap = on
            switched += 1
    return switched


def use_device_all_to_all(chunks: list) -> list:
    """Pre-wrap hook of ``moe_config.device_all_to_all``: every MoE layer at EP > 1 exchanges its tokens
    with the sizes on the device (`model/moe/exchange_dispatcher.py`). At EP1 there is no all-to-all
    (`DeviceCountsDispatcher` already reads nothing on the host). A layer it cannot apply to is a
    configuration error naming the key."""
    return _apply_to_ep_layers(chunks, "device_all_to_all", lambda layer: layer.use_device_all_to_all())
