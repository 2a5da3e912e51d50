"""Build a Megatron-Core model from a Hugging Face checkpoint through Megatron-Bridge.

One function, :func:`build_model`, turns a :class:`ModelSpec` into model chunks (one per virtual
pipeline stage) for the process groups that :mod:`skyrl_megatron.parallel` created. The layer spec is
chosen in :mod:`skyrl_megatron.model.layer_spec`; device-specific flags come from the runtime. With
`ModelSpec.cache` set, the weights come from the conversion cache (:mod:`skyrl_megatron.model.conversion.cache`)
when it holds this checkpoint, and the bridge converts (and fills the cache) only when it does not.
With `ModelSpec.lora` set, LoRA adapters (:mod:`skyrl_megatron.model.adapters.lora`) are added to the frozen base
once its weights are in place and before DDP wraps the chunks; the cache only ever holds the base.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from skyrl_megatron.attention_kernels import AUTO
from skyrl_megatron.config import MoeSettings
from skyrl_megatron.model.adapters.lora import LoraSpec, adapter_hook
from skyrl_megatron.model.adapters.value_head import ValueHeadInit, value_head_hook
from skyrl_megatron.model.conversion import hf_tensors
from skyrl_megatron.model.conversion.bridge_import import have_transformer_engine, import_bridge
from skyrl_megatron.model.conversion.cache import ConversionCacheSettings, LoadReport, claim_entry, local_checkpoint_dir
from skyrl_megatron.model.layers import rope, swiglu, wgrad
from skyrl_megatron.model.layers.fusions import DEFAULT_FUSED_KERNELS
from skyrl_megatron.model.moe import experts, token_sort
from skyrl_megatron.model.moe.layer import use_device_all_to_all, use_split_overlap
from skyrl_megatron.model.moe.settings import freeze_routers, moe_transformer_settings
from skyrl_megatron.parallel import ParallelConfig
from skyrl_megatron.runtime import Runtime, current_runtime

logger = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}


class UnsupportedModelError(ValueError):
    """The checkpoint's model type has no Megatron-Bridge conversion."""


@dataclass
class ModelSpec:
    """What to build: the checkpoint, the layout, precision and pass-through settings."""

    hf_path: str
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    dtype: str = "bf16"
    transformer_overrides: dict[str, Any] = field(default_factory=dict)
    wrap_with_ddp: bool = False
    ddp_config: dict[str, Any] = field(default_factory=dict)
    load_weights: bool = True
    cache: ConversionCacheSettings | None = None  # None: convert through the bridge on every build
    lora: LoraSpec | None = None  # None: every parameter trains; else only LoRA adapters on a frozen base
    moe: MoeSettings = field(default_factory=MoeSettings)  # routing/dispatch of MoE models; ignored for dense
    # fused kernels for the TE-free layers on GPU (model/layers/fusions.py); ignored on CPU
    fused_kernels: tuple[str, ...] = DEFAULT_FUSED_KERNELS
    # the packed segment kernel of our core attention (model/layers/attention.py): auto | flash4 | varlen | sdpa
    attention_kernel: str = AUTO
    # None: the LM head (logprobs); else the critic's scalar value head (model/adapters/value_head.py)
    value_head: ValueHeadInit | None = None

    def fused(self, kernel: str, runtime: Runtime) -> bool:
        return kernel in self.fused_kernels and not runtime.is_cpu

    @property
    def torch_dtype(self) -> torch.dtype:
        try:
            return _DTYPES[self.dtype]
        except KeyError:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(_DTYPES)}") from None

    @property
    def conversion_settings(self) -> dict[str, Any]:
        """The settings besides the checkpoint that decide the converted weights (part of the cache key).

        The parallel layout is not one of them: cache entries are layout-independent.
        """
        return {"dtype": str(self.torch_dtype)}


@dataclass
class BuiltModel:
    chunks: list  # one Megatron module per virtual pipeline stage (a single one without VPP)
    bridge: Any  # megatron.bridge.AutoBridge, for weight export
    provider: Any  # the finalised GPTModelProvider (a TransformerConfig)
    load_report: LoadReport  # cache hit or miss, conversion and load times
    lora: LoraSpec | None = None  # the adapters the chunks carry, if any
    # the logprob head's fused kernels (compute/logprobs.py), for the runner that scores with it
    fused_logprobs: bool = False
    # the head's log-sum-exp and label logit in its GEMM's epilogue (compute/logprob_gemm.py): every pass of a run
    logprobs_in_gemm: bool = False
    value_head: bool = False  # the last stage ends in a ValueHead (a critic), not the LM head

    @property
    def config(self):
        return self.provider

    @property
    def fused_kernels(self) -> tuple[str, ...]:
        """The fused kernels this model runs with (`model/layers/fusions.py`), as built."""
        from skyrl_megatron.model.layers import mlp
        from skyrl_megatron.model.layers.norm import FusedRMSNorm
        from skyrl_megatron.model.layers.qk_norm_rope import QKNormRopeSelfAttention

        modules = [module for chunk in self.chunks for module in chunk.modules()]
        present = {
            "rms_norm": any(isinstance(module, FusedRMSNorm) for module in modules),
            "rope": rope.is_fused() and self.provider.position_embedding_type in ("rope", "yarn"),
            "qk_norm_rope": any(isinstance(module, QKNormRopeSelfAttention) for module in modules),
            "swiglu": bool(self.provider.bias_activation_fusion) and _is_swiglu(self.provider),
            "swiglu_gemm": mlp.has_swiglu_gemm(modules),
            "swiglu_gemm_training": mlp.has_swiglu_gemm(modules, in_training=True),
            "swiglu_gemm_experts": experts.has_swiglu_gemm(modules),
            "logprobs": self.fused_logprobs,
            "lse_gemm": self.logprobs_in_gemm,
        }
        return tuple(name for name, used in present.items() if used)

    @property
    def expert_gemms(self) -> str | None:
        """What runs the grouped MoE experts' GEMMs, as built (`moe_config.expert_gemms`); None for a dense model."""
        linears = experts.grouped_linears(self.chunks)
        if not linears:
            return None
        if not any(linear.gemm_on_quack for linear in linears):
            return "torch"
        return "quack" if any(linear.wgrad_in_gemm for linear in linears) else "quack (weight gradients: torch)"

    @property
    def segment_kernel(self) -> str | None:
        """The packed-attention kernel our core attention runs in the model's dtype (`attention_kernel`'s
        value: flash4, varlen, sdpa); None where Transformer Engine's attention runs."""
        from skyrl_megatron.model.layers.attention import CoreAttention

        for chunk in self.chunks:
            for module in chunk.modules():
                if isinstance(module, CoreAttention):
                    return module.segment_kernel.value
        return None


def _hf_model_type(hf_path: str) -> str:
    config_file = Path(hf_path) / "config.json"
    if config_file.is_file():
        data = json.loads(config_file.read_text())
        return f"{data.get('model_type', '?')} ({', '.join(data.get('architectures') or ['?'])})"
    return "?"


def load_bridge(hf_path: str):
    """An AutoBridge for the checkpoint, or a clear error naming the model type."""
    import_bridge()
    from megatron.bridge import AutoBridge

    if not AutoBridge.can_handle(hf_path):
        raise UnsupportedModelError(
            f"Megatron-Bridge cannot convert the model at {hf_path!r} (model type {_hf_model_type(hf_path)}). "
            "Use a supported architecture (e.g. Llama, Qwen2/2.5, Qwen3, Qwen3-MoE) or the fsdp2 strategy."
        )
    bridge = AutoBridge.from_hf_pretrained(hf_path, torch_dtype=torch.float32)
    hf_tensors.read_shards_once(bridge)  # Bridge's own reads are quadratic in tensors per shard
    return bridge


def make_provider(spec: ModelSpec, bridge, runtime: Runtime | None = None):
    """The bridge's GPTModelProvider with our layout, precision, layer spec and overrides applied."""
    from skyrl_megatron.model.layer_spec import layer_spec_for

    runtime = runtime or current_runtime()
    provider = bridge.to_megatron_provider(load_weights=spec.load_weights)
    p = spec.parallel
    settings: dict[str, Any] = dict(
        tensor_model_parallel_size=p.tensor,
        pipeline_model_parallel_size=p.pipeline,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline,
        context_parallel_size=p.context,
        expert_model_parallel_size=p.expert,
        expert_tensor_parallel_size=p.expert_tensor if p.expert_tensor is not None else p.tensor,
        sequence_parallel=p.sequence_parallel,
        params_dtype=spec.torch_dtype,
        pipeline_dtype=spec.torch_dtype,
        bf16=spec.torch_dtype == torch.bfloat16,
        fp16=False,
        autocast_dtype=spec.torch_dtype,
        # RL fine-tuning runs without dropout; logprobs must be deterministic functions of the weights
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    if _is_swiglu(provider):
        # Megatron's own SwiGLU fusion (torch.compile'd, TE or not); transformer_config_kwargs win
        settings["bias_activation_fusion"] = spec.fused("swiglu", runtime)
    # MoE routing and dispatch (model/moe/settings.py; {} for a dense model). The load-balancing loss is off
    # by default: in RL it pulls the router away from the policy and makes the update depend on
    # padding and micro-batch composition. transformer_config_kwargs, applied below, still win.
    settings.update(moe_transformer_settings(provider, spec.moe, spec.transformer_overrides))
    if spec.moe.freeze_router and getattr(provider, "num_moe_experts", None):
        provider.register_pre_wrap_hook(freeze_routers)  # after the bridge's weight loading
    if spec.moe.device_all_to_all and getattr(provider, "num_moe_experts", None):
        provider.register_pre_wrap_hook(use_device_all_to_all)  # EP > 1: model/moe/exchange_dispatcher.py
    if spec.moe.overlap_all_to_all and getattr(provider, "num_moe_experts", None):
        provider.register_pre_wrap_hook(use_split_overlap)  # EP > 1: model/moe/split_overlap.py
    settings.update(runtime.transformer_config_overrides())
    if not have_transformer_engine():
        # Bridge providers turn on fused MoE token permutation (Qwen3-MoE does), which Megatron-Core
        # implements only through TE and refuses at config time without it, on GPU too.
        settings["moe_permute_fusion"] = False
    if spec.lora is not None and getattr(provider, "num_moe_experts", None):
        # Megatron-Bridge's LoRA adapts TE's grouped linears or per-expert linears; without TE the
        # experts stay per-expert modules (SequentialMLP) so their adapters attach
        settings["moe_grouped_gemm"] = False
    settings.update(spec.transformer_overrides)
    if not spec.wrap_with_ddp:
        # fused weight-gradient GEMMs accumulate into DDP's `main_grad` buffers; without DDP there
        # are none, and weight gradients go to `.grad` as usual
        settings["gradient_accumulation_fusion"] = False
    for key, value in settings.items():
        setattr(provider, key, value)
    provider.transformer_layer_spec = layer_spec_for(
        provider, runtime, fused_norms=spec.fused("rms_norm", runtime), attention_kernel=spec.attention_kernel,
        qk_norm_rope=spec.fused("qk_norm_rope", runtime), swiglu_gemm=_swiglu_in_gemm(spec, runtime),
        swiglu_gemm_training=_quack_kernel_runs(spec, runtime, "swiglu_gemm_training",
                                                otherwise="dense MLP training: fc1, the SwiGLU kernel, fc2"),
        swiglu_gemm_experts=_quack_kernel_runs(spec, runtime, "swiglu_gemm_experts",
                                               otherwise="MoE experts: fc1, then the weighted SwiGLU"),
    )
    provider.finalize()
    return provider


def _is_swiglu(provider) -> bool:
    return bool(provider.gated_linear_unit) and provider.activation_func is torch.nn.functional.silu


def _instantiate(
    spec: ModelSpec, bridge, runtime: Runtime, with_base_weights: Callable[[list], None] | None = None
) -> tuple[Any, list]:
    """The provider and the model chunks; the bridge loads the HF weights when `spec.load_weights`.

    `with_base_weights` sees the bare chunks once the base weights are loaded (cache load or store),
    before adapters are added and before DDP wraps them.
    """
    from megatron.core.distributed import DistributedDataParallelConfig

    provider = make_provider(spec, bridge, runtime)
    # the bridge's own hook (HF weight loading) was registered first and runs first
    if with_base_weights is not None:
        provider.register_pre_wrap_hook(_returning_chunks(with_base_weights))
    if spec.value_head is not None:
        # after the base weights (the cache holds the LM, shared with the policy), before DDP
        provider.register_pre_wrap_hook(value_head_hook(spec.value_head, spec.torch_dtype))
    if spec.lora is not None:
        provider.register_pre_wrap_hook(adapter_hook(spec.lora))
    ddp_config = DistributedDataParallelConfig(**spec.ddp_config) if spec.wrap_with_ddp else None
    chunks = provider.provide_distributed_model(
        ddp_config=ddp_config,
        wrap_with_ddp=spec.wrap_with_ddp,
        bf16=spec.torch_dtype == torch.bfloat16,
        fp16=False,
        use_cpu_initialization=runtime.is_cpu,
    )
    if ddp_config is not None and not ddp_config.overlap_grad_reduce:
        experts.keep_expert_weights_out_of_autograd(chunks)
    _choose_expert_gemms(spec, runtime, chunks)
    return provider, list(chunks)


def _check_kernels_can_run(spec: ModelSpec, runtime: Runtime) -> None:
    """`moe_config.expert_gemms: quack` where quack cannot run fails here, before any weights move."""
    if spec.moe.expert_gemms != "quack" or runtime.is_cpu:
        return
    from skyrl_megatron.model import quack_support

    reason = quack_support.missing_reason(torch.cuda.current_device())
    if reason is not None:
        raise ValueError(f"megatron_config.moe_config.expert_gemms: quack cannot run here: {reason}; set auto (quack "
                         "where it runs, else torch._grouped_mm) or torch")


def _logprobs_in_gemm(spec: ModelSpec, runtime: Runtime) -> bool:
    """`fused_kernels: [lse_gemm]`: the logprob head's statistics in quack's GEMM epilogue where quack runs on this GPU,
    else the two-kernel head (logged). Every role on the machine decides alike (the config check makes the policy and
    the reference ask alike), so the logprobs the KL term compares come from the same head."""
    return spec.value_head is None and _quack_kernel_runs(spec, runtime, "lse_gemm",
                                                          otherwise="logprob head: GEMM, then the statistics kernel")


def _swiglu_in_gemm(spec: ModelSpec, runtime: Runtime) -> bool:
    """`fused_kernels: [swiglu_gemm]`: the dense MLP's fc1 and SwiGLU as one quack GEMM in forward-only passes where
    quack runs on this GPU, else fc1, then the SwiGLU kernel (logged)."""
    return _quack_kernel_runs(spec, runtime, "swiglu_gemm", otherwise="dense MLP: fc1, then the SwiGLU kernel")


def _quack_kernel_runs(spec: ModelSpec, runtime: Runtime, kernel: str, otherwise: str) -> bool:
    """Whether `kernel`, a quack GEMM of `fused_kernels`, is asked for and quack runs on this process's GPU; where it
    is asked for and cannot run, the log says what runs `otherwise` and why."""
    if not spec.fused(kernel, runtime):
        return False
    from skyrl_megatron.model import quack_support

    reason = quack_support.current_device_missing_reason()
    if reason is not None:
        logger.info("%s (%s: %s)", otherwise, kernel, reason)
        return False
    return True


def _choose_expert_gemms(spec: ModelSpec, runtime: Runtime, chunks: list) -> None:
    """`moe_config.expert_gemms` on the built chunks: quack's varlen GEMMs for the grouped experts' forward and input
    gradients (`expert_gemm.py`), and for their weight gradients into fp32 `main_grad` (`expert_wgrad.py`) where the
    weights bypass autograd (`ddp_config.overlap_grad_reduce: false`) and the main grads are fp32
    (`grad_reduce_in_fp32`); elsewhere `torch._grouped_mm`. Dense models have no grouped experts: nothing to choose."""
    if not experts.grouped_linears(chunks):
        return
    from skyrl_megatron.model import quack_support

    on_quack, why = quack_support.experts_on_quack(spec.moe.expert_gemms, on_gpu=not runtime.is_cpu)
    if not on_quack:
        logger.info("MoE experts' GEMMs: torch._grouped_mm (%s)", why)
        return
    experts.run_gemms_on_quack(chunks)
    with_wgrad = experts.add_weight_gradients_in_gemm(chunks) > 0
    logger.info("MoE experts' GEMMs: quack-kernels (%s), weight gradients %s", why,
                "into main_grad by quack" if with_wgrad else "through torch._grouped_mm (no fp32 main_grad to add into)")


def _returning_chunks(step: Callable[[list], Any]) -> Callable[[list], list]:
    """A pre-wrap hook running `step` for its effect (the provider replaces the chunks by what a hook returns)."""

    def hook(chunks: list) -> list:
        step(chunks)
        return chunks

    return hook


def _skeleton(spec: ModelSpec) -> ModelSpec:
    """The spec for chunks whose weights will be read from the cache: random init would be wasted work."""
    overrides = {**spec.transformer_overrides, "perform_initialization": False}
    return dataclasses.replace(spec, load_weights=False, transformer_overrides=overrides)


def install_patches(spec: ModelSpec, runtime: Runtime) -> None:
    """What `build_model` puts into Megatron-Core before a provider exists; also for models made straight from
    `make_provider` (the bench's config-only checks), so they run what the workers run."""
    rope.install(fused=spec.fused("rope", runtime))
    wgrad.install()  # before the bridge's provider reads whether wgrad fusion is available
    token_sort.install()  # MoE token regrouping without host syncs (model/moe/token_sort.py)
    swiglu.install()  # the dense MLP's fused SwiGLU as Triton kernels on GPU (model/layers/swiglu.py)


def build_model(spec: ModelSpec, runtime: Runtime | None = None) -> BuiltModel:
    """Build (and load, unless `spec.load_weights` is false) the model for the current process groups.

    Collective over the default process group when `spec.cache` is set (rank 0 decides, all load or save).
    """
    runtime = runtime or current_runtime()
    _check_kernels_can_run(spec, runtime)
    install_patches(spec, runtime)
    bridge = load_bridge(spec.hf_path)
    if spec.cache is not None and spec.load_weights:
        hf_dir = local_checkpoint_dir(spec.hf_path)
        if hf_dir is not None:
            provider, chunks, report = _build_through_cache(spec, hf_dir, bridge, runtime)
        else:
            logger.warning("conversion cache skipped: %r is not a local checkpoint directory", spec.hf_path)
            provider, chunks, report = _build_uncached(spec, bridge, runtime, reason="not a local checkpoint")
    else:
        reason = "no cache configured" if spec.load_weights else "random initialisation"
        provider, chunks, report = _build_uncached(spec, bridge, runtime, reason=reason)
    built = BuiltModel(
        chunks=chunks,
        bridge=bridge,
        provider=provider,
        load_report=report,
        lora=spec.lora,
        fused_logprobs=spec.fused("logprobs", runtime) and spec.value_head is None,
        logprobs_in_gemm=_logprobs_in_gemm(spec, runtime),
        value_head=spec.value_head is not None,
    )
    if torch.distributed.get_rank() == 0:
        logger.info("model weights: %s", report.summary())
        logger.info("fused kernels: %s", ", ".join(built.fused_kernels) or "none (eager PyTorch kernels)")
        if "rms_norm" in built.fused_kernels:
            from skyrl_megatron.model.layers.norm import rms_norm_implementation

            logger.info("rms_norm runs on %s", rms_norm_implementation(torch.cuda.current_device()))
    return built


def _build_uncached(spec: ModelSpec, bridge, runtime: Runtime, reason: str) -> tuple[Any, list, LoadReport]:
    started = time.perf_counter()
    provider, chunks = _instantiate(spec, bridge, runtime)
    report = LoadReport(hit=None, entry=None, reason=reason, conversion_seconds=time.perf_counter() - started)
    return provider, chunks, report


def _build_through_cache(spec: ModelSpec, hf_dir: Path, bridge, runtime: Runtime) -> tuple[Any, list, LoadReport]:
    # The cache is read and written on the bare chunks (inside `_instantiate`), so it holds the base
    # model only, whatever adapters are added afterwards.
    with claim_entry(hf_dir, spec.cache, spec.conversion_settings) as claim:
        started = time.perf_counter()
        if claim.hit:
            provider, chunks = _instantiate(_skeleton(spec), bridge, runtime, with_base_weights=claim.load)
            return provider, chunks, claim.report(load_seconds=time.perf_counter() - started)
        timings: dict[str, float] = {}

        def store(bare_chunks: list) -> None:
            timings["conversion_seconds"] = time.perf_counter() - started
            details = {
                "hf_source": str(hf_dir),
                "conversion_seconds": round(timings["conversion_seconds"], 3),
                "writer_layout": dataclasses.asdict(spec.parallel),
                "writer_world_size": torch.distributed.get_world_size(),
            }
            timings["save_seconds"] = claim.store(bare_chunks, details)

        provider, chunks = _instantiate(spec, bridge, runtime, with_base_weights=store)
        return provider, chunks, claim.report(**timings)
