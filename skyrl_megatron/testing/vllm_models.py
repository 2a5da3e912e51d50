"""vLLM's own model classes built on a CPU, for checking what our weight stream does to them.

The vLLM wheel the CPU environment installs is its CUDA build: without a GPU it resolves no platform,
and a model's attention layers refuse to be built. :func:`vllm_model_on_cpu` installs vLLM's CPU
platform as the current one (a stand-in for the GPU platform, for building and loading only: nothing
here runs a forward) and builds the model class vLLM picks for a checkpoint, its tensor parallel
group over gloo spanning the calling ranks. Call it in processes of their own (``run_on_ranks(..., n)``:
tensor parallelism n): vLLM keeps its configuration and groups in globals.
"""

from __future__ import annotations

import os

import torch


def vllm_model_on_cpu(hf_dir: str, dtype: torch.dtype, expert_parallel: bool = False) -> torch.nn.Module:
    """The vLLM model for the checkpoint at `hf_dir`, its parameters allocated on the CPU in `dtype`
    (not loaded: feed it through ``load_weights``), each rank of the default process group one rank of
    the engine's tensor parallelism (sharded as vLLM shards it); with `expert_parallel`, a MoE model's experts
    are split over those ranks instead (vLLM's ``enable_expert_parallel``)."""
    import torch.distributed as dist
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform

    vllm.platforms.current_platform = CpuPlatform()
    from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import get_model_architecture

    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    model_config = ModelConfig(model=hf_dir, tokenizer=hf_dir, dtype=dtype, enforce_eager=True)
    config = VllmConfig(model_config=model_config, device_config=DeviceConfig(device="cpu"),
                        parallel_config=ParallelConfig(tensor_parallel_size=world, enable_expert_parallel=expert_parallel))
    with set_current_vllm_config(config):
        # reuses the default group of the calling processes
        init_distributed_environment(
            world_size=world, rank=rank, local_rank=rank, backend="gloo",
            distributed_init_method=f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '29500')}",
        )
        initialize_model_parallel(world, 1)
        model_class, _ = get_model_architecture(model_config)
        with torch.device("cpu"):
            model = model_class(vllm_config=config)
    return model.to(dtype)
