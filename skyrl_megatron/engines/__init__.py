"""Inference engines for the host's generators: a CPU engine for machines without vLLM or GPUs."""

from skyrl_megatron.engines.cpu_engine import (
    CpuInferenceEngine,
    NamedTensorsUpdateRequest,
    SamplingSettings,
    cpu_engine_actor_class,
    create_ray_wrapped_cpu_engines,
)

__all__ = [
    "CpuInferenceEngine",
    "NamedTensorsUpdateRequest",
    "SamplingSettings",
    "cpu_engine_actor_class",
    "create_ray_wrapped_cpu_engines",
]
