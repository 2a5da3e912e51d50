"""Build a Megatron-Core model from a Hugging Face checkpoint through Megatron-Bridge.

One function, :func:`build_model`, turns a :class:`ModelSpec` into model chunks (one per virtual
pipeline stage) for the process groups that :mod:`skyrl_megatron.parallel` created. The layer spec is
chosen in :mod:`skyrl_megatron.model.layer_spec`; device-specific flags come from the runtime.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from skyrl_megatron.model.bridge_import import import_bridge
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

    @property
    def torch_dtype(self) -> torch.dtype:
        try:
            return _DTYPES[self.dtype]
        except KeyError:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(_DTYPES)}") from None


@dataclass
class BuiltModel:
    chunks: list  # one Megatron module per virtual pipeline stage (a single one without VPP)
    bridge: Any  # megatron.bridge.AutoBridge, for weight export
    provider: Any  # the finalised GPTModelProvider (a TransformerConfig)

    @property
    def config(self):
        return self.provider


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
    return AutoBridge.from_hf_pretrained(hf_path, torch_dtype=torch.float32)


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
    settings.update(runtime.transformer_config_overrides())
    settings.update(spec.transformer_overrides)
    for key, value in settings.items():
        setattr(provider, key, value)
    provider.transformer_layer_spec = layer_spec_for(provider, runtime)
    provider.finalize()
    return provider


def build_model(spec: ModelSpec, runtime: Runtime | None = None) -> BuiltModel:
    """Build (and load, unless `spec.load_weights` is false) the model for the current process groups."""
    from megatron.core.distributed import DistributedDataParallelConfig

    runtime = runtime or current_runtime()
    bridge = load_bridge(spec.hf_path)
    provider = make_provider(spec, bridge, runtime)
    ddp_config = DistributedDataParallelConfig(**spec.ddp_config) if spec.wrap_with_ddp else None
    chunks = provider.provide_distributed_model(
        ddp_config=ddp_config,
        wrap_with_ddp=spec.wrap_with_ddp,
        bf16=spec.torch_dtype == torch.bfloat16,
        fp16=False,
        use_cpu_initialization=runtime.is_cpu,
    )
    return BuiltModel(chunks=list(chunks), bridge=bridge, provider=provider)
