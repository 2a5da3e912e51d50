"""Which transformer block spec a model is built with (Megatron-Core's ModuleSpec mechanism).

Transformer Engine's layer spec when TE is importable on GPU; otherwise Megatron's local (TE-free)
layer spec with our sequence-parallel-capable torch norms in place of Megatron's wrapped ones
(including the block's final norm) and our core attention (SDPA, a packed segment kernel chosen by
`megatron_config.attention_kernel`, context parallelism) in place of Megatron's `DotProductAttention`.
The choice is logged once per process.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

from skyrl_megatron.attention_kernels import AUTO, KEY
from skyrl_megatron.model.conversion.bridge_import import have_transformer_engine
from skyrl_megatron.model.layers.norm import FusedTorchNorm, TorchNorm
from skyrl_megatron.runtime import Runtime

logger = logging.getLogger(__name__)
_REPORTED: set[str] = set()


def _report(choice: str) -> None:
    if choice not in _REPORTED:
        _REPORTED.add(choice)
        logger.info("skyrl-megatron layer spec: %s", choice)


def _replace_modules(spec, old, new):
    """A copy of a ModuleSpec tree with every reference to module `old` replaced by `new`."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if spec is old:
        return new
    if isinstance(spec, ModuleSpec):
        return dataclasses.replace(
            spec,
            module=new if spec.module is old else spec.module,
            submodules=_replace_modules(spec.submodules, old, new),
        )
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {f.name: _replace_modules(getattr(spec, f.name), old, new) for f in dataclasses.fields(spec)}
        return dataclasses.replace(spec, **changes)
    return spec


def _with_core_attention(layer, core_attention):
    """A copy of a TransformerLayer spec whose self-attention uses `core_attention`."""
    self_attention = layer.submodules.self_attention
    self_attention = dataclasses.replace(
        self_attention, submodules=dataclasses.replace(self_attention.submodules, core_attention=core_attention)
    )
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=self_attention))


def _with_grouped_experts(layer, swiglu_gemm: bool):
    """A copy of an MoE TransformerLayer spec whose experts run as grouped GEMMs (model/moe/experts.py), in
    an MoE layer that keeps the experts' token counts on the device where it can (model/moe/layer.py); with
    `swiglu_gemm` the experts' forward-only passes take fc1 and the SwiGLU from one GEMM."""
    import functools

    from skyrl_megatron.model.moe.experts import grouped_experts_builder
    from skyrl_megatron.model.moe.layer import grouped_moe_layer_class

    moe = layer.submodules.mlp  # functools.partial(MoELayer, submodules=MoESubmodules(...))
    submodules = dataclasses.replace(moe.keywords["submodules"], experts=grouped_experts_builder(swiglu_in_gemm=swiglu_gemm))
    mlp = functools.partial(grouped_moe_layer_class(), *moe.args, **{**moe.keywords, "submodules": submodules})
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, mlp=mlp))


def _with_qk_norm_rope(layer):
    """A copy of a TransformerLayer spec whose self-attention applies its query/key norms inside the
    rotation (model/layers/qk_norm_rope.py); other attention modules (e.g. MLA) are left as they are."""
    from megatron.core.transformer.attention import SelfAttention

    from skyrl_megatron.model.layers.norm import DeferrableNorm
    from skyrl_megatron.model.layers.qk_norm_rope import QKNormRopeSelfAttention

    attention = layer.submodules.self_attention
    if attention.module is not SelfAttention:
        return layer
    submodules = dataclasses.replace(attention.submodules, q_layernorm=DeferrableNorm, k_layernorm=DeferrableNorm)
    attention = dataclasses.replace(attention, module=QKNormRopeSelfAttention, submodules=submodules)
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=attention))


def _with_swiglu_gemm(layer, in_training: bool):
    """A copy of a dense TransformerLayer spec whose MLP takes fc1 and the SwiGLU from one GEMM in forward-only passes
    (model/layers/mlp.py), `in_training`: in every pass; MoE layers are left as they are."""
    from megatron.core.transformer.mlp import MLP

    from skyrl_megatron.model.layers.mlp import SwiGLUGemmFc1, SwiGLUGemmMLP, SwiGLUGemmTrainingMLP

    mlp = layer.submodules.mlp  # functools.partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(...))
    if not isinstance(mlp, functools.partial) or getattr(mlp.func, "__self__", None) is not MLP:
        return layer
    submodules = dataclasses.replace(mlp.keywords["submodules"], linear_fc1=SwiGLUGemmFc1)
    module = SwiGLUGemmTrainingMLP if in_training else SwiGLUGemmMLP
    mlp = functools.partial(module.as_mlp_submodule, *mlp.args, **{**mlp.keywords, "submodules": submodules})
    return dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, mlp=mlp))


def local_block_spec(config, vp_stage: int | None = None, fused_norms: bool = False, attention_kernel: str = AUTO,
                     qk_norm_rope: bool = False, swiglu_gemm: bool = False, swiglu_gemm_training: bool = False,
                     swiglu_gemm_experts: bool = False):
    """TransformerBlockSubmodules for this PP/VPP stage: local layers, our torch norms and core attention
    (its segment kernel from `attention_kernel`, `megatron_config.attention_kernel`); with `qk_norm_rope`
    (and query/key norms in the model) the norms run inside the rotation; with `swiglu_gemm` the dense MLP's
    forward-only passes take fc1 and the SwiGLU from one GEMM, with `swiglu_gemm_training` its training passes too,
    with `swiglu_gemm_experts` the grouped experts' forward-only passes.

    MoE layers with `moe_grouped_gemm` run their experts as grouped GEMMs (Megatron's local spec
    would run them one by one, whatever the flag says).
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    from skyrl_megatron.model.layers.attention import CoreAttention

    layer = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=config.qk_layernorm,
        normalization=config.normalization,
    )
    norm = FusedTorchNorm if fused_norms else TorchNorm
    layer = _replace_modules(layer, WrappedTorchNorm, norm)
    # Megatron calls the core-attention builder with keywords; the partial adds the setting
    layer = _with_core_attention(layer, functools.partial(CoreAttention, attention_kernel=attention_kernel))
    if qk_norm_rope and config.qk_layernorm:
        layer = _with_qk_norm_rope(layer)
    if swiglu_gemm or swiglu_gemm_training:
        layer = _with_swiglu_gemm(layer, in_training=swiglu_gemm_training)
    if config.num_moe_experts and config.moe_grouped_gemm:
        layer = _with_grouped_experts(layer, swiglu_gemm_experts)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=norm)


def layer_spec_for(provider, runtime: Runtime, fused_norms: bool = False, attention_kernel: str = AUTO,
                   qk_norm_rope: bool = False, swiglu_gemm: bool = False, swiglu_gemm_training: bool = False,
                   swiglu_gemm_experts: bool = False):
    """The spec (or spec factory) to set as `provider.transformer_layer_spec`.

    `fused_norms`: RMSNorm as a generated kernel in the local spec (TE brings its own).
    `qk_norm_rope`: the query/key norms inside the rotation's kernel (local spec).
    `swiglu_gemm`: the dense MLP's fc1 and SwiGLU as one GEMM in forward-only passes (local spec; the caller decides
    that quack runs here); `swiglu_gemm_training`: in training passes too; `swiglu_gemm_experts`: the grouped MoE
    experts' in forward-only passes.
    `attention_kernel`: the packed segment kernel of our core attention; refused here, at model build,
    where it cannot run (e.g. flash4 on a GPU older than Hopper).
    """
    if have_transformer_engine() and not runtime.is_cpu:
        from megatron.bridge.models.gpt_provider import transformer_engine_layer_spec

        if attention_kernel != AUTO:
            logger.warning("%s=%s is ignored: Transformer Engine's attention runs", KEY, attention_kernel)
        _report("transformer_engine")
        return transformer_engine_layer_spec
    from skyrl_megatron.model.layers.attention import describe_core_attention

    experts = ""
    if getattr(provider, "num_moe_experts", None):
        experts = "; experts: " + ("grouped GEMM" if provider.moe_grouped_gemm else "sequential")
    _report(
        f"local (Megatron-Core layers, {'fused' if fused_norms else 'torch'} norms; TE not installed); "
        f"core attention: {describe_core_attention(runtime, provider.params_dtype, attention_kernel)}{experts}"
    )
    return functools.partial(local_block_spec, fused_norms=fused_norms, attention_kernel=attention_kernel,
                             qk_norm_rope=qk_norm_rope, swiglu_gemm=swiglu_gemm,
                             swiglu_gemm_training=swiglu_gemm_training, swiglu_gemm_experts=swiglu_gemm_experts)
