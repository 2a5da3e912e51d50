"""MoE settings of a built model: ``megatron_config.moe_config`` mapped onto Megatron's TransformerConfig.

:func:`moe_transformer_settings` turns a :class:`~skyrl_megatron.config.MoeSettings` into
TransformerConfig fields for the provider of an MoE checkpoint (nothing for a dense one);
`make_provider` applies them before the user's ``transformer_config_kwargs``, which therefore win
for any field both set. :func:`freeze_routers` is the pre-wrap hook behind ``freeze_router``.

How the keys map:

=========================== ================================== ==================================
moe_config                  TransformerConfig                  note
=========================== ================================== ==================================
token_dispatcher            moe_token_dispatcher_type          flex also sets
flex_backend                moe_flex_dispatcher_backend        ... the backend (DeepEP / HybridEP)
router_dtype                moe_router_dtype                   null: routing in the model's dtype
load_balancing_type         moe_router_load_balancing_type     null keeps the checkpoint's
aux_loss_coeff              moe_aux_loss_coeff                 0: no load-balancing loss
expert_bias                 moe_router_enable_expert_bias      null keeps the checkpoint's
expert_bias_update_rate     moe_router_bias_update_rate        0: the bias stays as loaded
freeze_router               (requires_grad=False on routers)   before DDP wraps the chunks
device_all_to_all           (DeviceAllToAllDispatcher, EP > 1) before DDP wraps the chunks
overlap_all_to_all          (forward in two halves, EP > 1)    before DDP wraps the chunks
=========================== ================================== ==================================

Frozen router weights never reach Megatron's DDP buffers or optimizer: both take only parameters
with ``requires_grad`` (``DistributedDataParallel.__init__``, ``optimizer._get_param_groups``), so
they get no gradient, no all-reduce, no Adam state and no weight decay, and stay bitwise as loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from skyrl_megatron.config import ConfigError, MoeSettings, Problem, flex_backend_problem
from skyrl_megatron.runtime import quiet_megatron_import

logger = logging.getLogger(__name__)

SECTION = "megatron_config.moe_config"


def moe_transformer_settings(provider, settings: MoeSettings, user_overrides: Mapping[str, Any]) -> dict[str, Any]:
    """TransformerConfig fields for `settings` on the bridge's `provider`; {} for a dense model.

    `user_overrides` are the ``transformer_config_kwargs`` applied after these: a field set there
    wins (and is logged), since it is the more specific request.
    """
    if not getattr(provider, "num_moe_experts", None):
        return {}
    problems = settings.problems(SECTION)
    backend = flex_backend_problem(settings)
    if backend is not None:
        problems.append(backend)
    problems += _expert_bias_problems(provider, settings)
    if problems:
        raise ConfigError(problems)

    fields: dict[str, Any] = {
        "moe_token_dispatcher_type": settings.token_dispatcher,
        "moe_router_dtype": settings.router_dtype,
        "moe_aux_loss_coeff": float(settings.aux_loss_coeff),
        "moe_router_bias_update_rate": float(settings.expert_bias_update_rate),
    }
    if settings.token_dispatcher == "flex":
        fields["moe_flex_dispatcher_backend"] = settings.flex_backend
    if settings.load_balancing_type is not None:
        fields["moe_router_load_balancing_type"] = settings.load_balancing_type
    if settings.expert_bias is not None:
        fields["moe_router_enable_expert_bias"] = settings.expert_bias

    effective = {**fields, **user_overrides}
    for name in sorted(set(fields) & set(user_overrides)):
        if user_overrides[name] != fields[name]:
            logger.info("transformer_config_kwargs.%s=%r wins over moe_config (%r)", name, user_overrides[name], fields[name])
    if effective["moe_aux_loss_coeff"]:
        balancing = effective.get("moe_router_load_balancing_type", provider.moe_router_load_balancing_type)
        logger.info("MoE load-balancing loss on: %s, coeff %s", balancing, effective["moe_aux_loss_coeff"])
    return fields


def _expert_bias_problems(provider, settings: MoeSettings) -> list[Problem]:
    """An expert bias is part of a checkpoint's routing: it can be neither added nor removed."""
    if settings.expert_bias is None or bool(settings.expert_bias) == bool(provider.moe_router_enable_expert_bias):
        return []
    if settings.expert_bias:
        why = "the checkpoint routes without an expert bias (there is no bias to load)"
    else:
        why = "the checkpoint routes with a learned expert bias; without it the model computes something else"
    return [Problem(f"{SECTION}.expert_bias", why, "leave expert_bias null (the checkpoint's own)")]


def routers(chunks: list[torch.nn.Module]) -> Iterator[tuple[int, torch.nn.Module]]:
    """(chunk index, router) for every MoE router of the chunks (multi-token-prediction layers' included)."""
    with quiet_megatron_import():
        from megatron.core.transformer.moe.router import TopKRouter

    for index, chunk in enumerate(chunks):
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                yield index, module


def freeze_routers(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Pre-wrap hook: router weights (and biases) stop training; DDP and the optimizer then skip them."""
    frozen = 0
    for _, router in routers(chunks):
        for param in router.parameters():
            param.requires_grad_(False)
            frozen += param.numel()
    logger.info("MoE routers frozen: %d parameters", frozen)
    return chunks


def dispatch_needs_equal_token_counts(chunks: list[torch.nn.Module]) -> bool:
    """Whether every expert-parallel rank must route the same number of tokens per micro-batch.

    The allgather dispatcher gathers all tokens of the TP x EP group into one buffer without split
    sizes; EP ranks are data-parallel ranks with their own rows, so their micro-batches must share
    one shape. The alltoall and flex dispatchers exchange split sizes and need no such agreement,
    except the alltoall dispatcher with its sizes on the device (``moe_config.device_all_to_all``):
    its receive buffers are sized EP x this rank's rows, and its symmetric buffers are allocated
    collectively by shape (`model/moe/exchange_dispatcher.py`).
    """
    from megatron.core.utils import get_model_config

    config = get_model_config(chunks[0])
    if not config.num_moe_experts or config.expert_model_parallel_size == 1:
        return False
    if config.moe_token_dispatcher_type == "allgather":
        return True
    return any(getattr(getattr(module, "token_dispatcher", None), "needs_equal_token_counts", False)
               for chunk in chunks for module in chunk.modules())
