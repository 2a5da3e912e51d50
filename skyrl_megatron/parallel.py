"""Process groups for one worker role, and the host's view of a rank (MeshRank).

All parallel groups (TP, PP, VPP, CP, EP, ETP, DP) are created here, in one visible place, from a
:class:`ParallelConfig`. Everything else asks Megatron's `parallel_state` for ranks and groups.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from skyrl_megatron.runtime import Runtime, activate_runtime


@dataclass(frozen=True)
class ParallelConfig:
    tensor: int = 1
    pipeline: int = 1
    virtual_pipeline: int | None = None
    context: int = 1
    expert: int = 1
    expert_tensor: int | None = None
    sequence_parallel: bool = False

    @property
    def model_parallel(self) -> int:
        return self.tensor * self.pipeline * self.context

    def data_parallel(self, world_size: int) -> int:
        return world_size // self.model_parallel


@dataclass(frozen=True)
class MeshCoordinates:
    """This rank's coordinates in each parallel dimension (what the host's MeshRank is built from)."""

    dp: int
    cp: int
    tp: int
    pp: int
    world_size: int
    dp_size: int
    pp_size: int


# How long a collective may wait during start-up (conversion cache, whose lock may wait for another job's
# conversion) and checkpoints (one rank writes or reads while its peers wait): torch's own default.
# Steady-state calls get the role's `collective_timeout_s` instead (`set_collective_timeout`).
LONG_COLLECTIVE_TIMEOUT_S = 30 * 60.0


def init_distributed(runtime_request: str | None = None, timeout_s: float = LONG_COLLECTIVE_TIMEOUT_S) -> Runtime:
    """Start torch.distributed from the standard env vars (RANK, WORLD_SIZE, MASTER_*) if needed."""
    runtime = activate_runtime(runtime_request)
    if not dist.is_initialized():
        dist.init_process_group(
            backend=runtime.backend,
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return runtime


_collective_timeout_s = LONG_COLLECTIVE_TIMEOUT_S  # what this process last set (groups start with this)


def set_collective_timeout(seconds: float) -> float:
    """Make every process group of this rank (the default one and Megatron's, gloo and NCCL alike) give
    up on a collective after `seconds`, from the next collective on; the timeout set before."""
    global _collective_timeout_s
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=seconds)
    for group in list(c10d._world.pg_map):
        try:
            c10d._set_pg_timeout(timeout, group)
        except (ValueError, AssertionError, RuntimeError):  # not a member, or a backend without a timeout
            continue
    previous, _collective_timeout_s = _collective_timeout_s, seconds
    return previous


@contextlib.contextmanager
def collective_timeout(seconds: float):
    """`set_collective_timeout(seconds)` for the block, the previous timeout after it."""
    previous = set_collective_timeout(seconds)
    try:
        yield
    finally:
        set_collective_timeout(previous)


def initialize_model_parallel(config: ParallelConfig, seed: int = 1234) -> MeshCoordinates:
    """Create Megatron's parallel groups for `config` on the already-started default group."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    runtime = activate_runtime()
    world = dist.get_world_size()
    if world % config.model_parallel:
        raise ValueError(
            f"world size {world} is not divisible by tensor x pipeline x context = {config.model_parallel}"
        )
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=config.tensor,
        pipeline_model_parallel_size=config.pipeline,
        virtual_pipeline_model_parallel_size=config.virtual_pipeline,
        context_parallel_size=config.context,
        expert_model_parallel_size=config.expert,
        expert_tensor_parallel_size=config.expert_tensor,
        # the distributed optimizer's state (de)serialisation runs over gloo groups
        create_gloo_process_groups=True,
    )
    # The inference tracker keeps Megatron's RNG forks off the CUDA generator, which the CPU mode
    # lacks. Dropout is 0 in RL fine-tuning, so TP-decorrelated dropout streams are not needed there.
    model_parallel_cuda_manual_seed(seed, inference_rng_tracker=runtime.is_cpu)
    torch.manual_seed(seed)
    return mesh_coordinates()


def mesh_coordinates() -> MeshCoordinates:
    from megatron.core import parallel_state as ps

    return MeshCoordinates(
        dp=ps.get_data_parallel_rank(),
        cp=ps.get_context_parallel_rank(),
        tp=ps.get_tensor_model_parallel_rank(),
        pp=ps.get_pipeline_model_parallel_rank(),
        world_size=dist.get_world_size(),
        dp_size=ps.get_data_parallel_world_size(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
    )


def destroy_model_parallel() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
