"""What Megatron's `dist_checkpointing` saves and loads for a training state, and how.

The sharded state dict of model chunks (all weights, or LoRA adapters only), optimizer, scheduler and
per-rank RNG; a load strategy that reads each replicated shard once per replica group and fails on
every rank when it fails on one; and the workarounds Megatron-Core 0.19.2's distributed optimizer needs
on torch's Adam (no state before the first step, `step` missing from its checkpoint, one shared step
tensor after loading).
"""

from __future__ import annotations

import contextlib
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from skyrl_megatron.checkpoint.errors import CheckpointError, CheckpointMismatchError, CorruptCheckpointError
from skyrl_megatron.checkpoint.integrity import MODEL_STATE_ADAPTERS, MODEL_STATE_FULL, unwrap
from skyrl_megatron.checkpoint.optimizer_state import state_without_gather
from skyrl_megatron.compact_adam import initial_adam_step
from skyrl_megatron.dist_io import replica_group
from skyrl_megatron.master_weights import chained_parts
from skyrl_megatron.model.adapters.lora import is_adapter_name
from skyrl_megatron.optim import torch_optimizers, use_fused_torch_adam

# The distributed optimizer's one format in Megatron 0.19.2 that reshards across TP and PP
# ("fully_sharded_model_space" rejects its own flattened tensors; "dp_reshardable" is DP-only).
# It stores the state per model parameter, which costs host memory: saving gathers a model-parallel
# shard's full optimizer state (12 bytes a parameter) on DP rank 0, which alone writes it (the other
# replicas take the model weights); loading has each replica read a share and broadcast it, so
# every rank holds the full state before it keeps its slice.
OPTIMIZER_SHARDING_TYPE = "fully_reshardable"


# ----------------------------------------------------------------------------------------------
# How Megatron reads
# ----------------------------------------------------------------------------------------------


def load_strategy(what: str):
    """Megatron's default load strategy; where ranks replicate shards, each replica reads a share and
    broadcasts it to the others, instead of every replica reading everything (in the distributed
    optimizer's `fully_reshardable` format, every rank reads its model-parallel shard's whole state).

    That exchange is a collective after dist_checkpointing's checks and the reads, where a rank that
    failed in either would leave its peers waiting. So the load, and each read in it, is one step
    of all ranks: entered together, and failing on all when it fails on one (CorruptCheckpointError
    with `what`, as the outer `agree_on_all_ranks` raises it)."""
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    strategy = get_default_load_sharded_strategy()
    replicas = replica_group()
    if replicas is None:
        return strategy
    parallel = FullyParallelLoadStrategyWrapper(_AllRanksTogether(strategy, what), replicas)
    return _AllRanksTogether(parallel, what)


class _AllRanksTogether:
    """A load strategy whose `load` the ranks enter together and leave together: a rank that failed
    before it (in checks of `dist_checkpointing.load` that may fail on one rank alone) or inside it
    makes every rank raise. Anything else is the wrapped strategy's."""

    def __init__(self, strategy, what: str):
        self._strategy = strategy
        self._what = what

    def load(self, sharded_state_dict, checkpoint_dir, *args, **kwargs):
        # a rank that failed on the way here is waiting for its peers in `agree_on_all_ranks` already
        agree_on_all_ranks(lambda: None, self._what)
        return agree_on_all_ranks(
            lambda: self._strategy.load(sharded_state_dict, checkpoint_dir, *args, **kwargs), self._what
        )

    def __getattr__(self, name: str):
        return getattr(self._strategy, name)


# ----------------------------------------------------------------------------------------------
# The sharded state
# ----------------------------------------------------------------------------------------------


def agree_on_all_ranks(read, what: str):
    """Run `read` on every rank; if any rank failed, raise on all of them (nobody goes on to copy
    a partial state while a peer bails out). Calls nest: a CorruptCheckpointError out of `read` was
    agreed on inside it, by every rank, and passes on without another collective."""
    from torch.distributed.checkpoint.api import CheckpointException

    error: str | None = None
    result = None
    try:
        result = read()
    except CorruptCheckpointError:
        raise
    # torch.distributed.checkpoint reports read failures as a BaseException subclass
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - reported below, on every rank
        error = _describe_read_error(exc)
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failures = [f"rank {rank}: {message}" for rank, message in enumerate(errors) if message]
    if failures:
        raise CorruptCheckpointError(f"{what}: " + "; ".join(failures))
    return result


def _describe_read_error(exc: BaseException) -> str:
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException):  # its str() is a traceback per rank: keep the causes
        exc = next(iter(exc.failures.values()))[0]
    return f"{type(exc).__name__}: {exc}"




# ----------------------------------------------------------------------------------------------
# The sharded state
# ----------------------------------------------------------------------------------------------


def sharded_training_state(
    chunks, optimizer, scheduler, *, is_loading: bool, with_rng: bool, model_state: str
) -> dict:
    """Megatron's sharded state dict: model chunks (all weights, or only the LoRA adapters), optimizer,
    scheduler and this rank's RNG."""
    from megatron.core import parallel_state as ps

    metadata = {
        "distrib_optim_sharding_type": OPTIMIZER_SHARDING_TYPE,
        # gather on DP rank 0 over gloo: one full copy per DP group at save, not one per rank
        "distrib_optim_fully_reshardable_mem_efficient": True,
        # no `chained_<i>.` key prefixes: they would tie the optimizer keys to the chain's shape
        "chained_optim_avoid_prefix": True,
        "singleton_local_shards": False,
        "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
    }
    state: dict[str, Any] = {}
    for index, chunk in enumerate(chunks):
        chunk_state = unwrap(chunk).sharded_state_dict(metadata=metadata)
        if model_state == MODEL_STATE_ADAPTERS:
            chunk_state = {key: value for key, value in chunk_state.items() if is_adapter_name(key)}
        state[f"model{index}"] = chunk_state
    if optimizer is not None:
        _materialise_adam_state(optimizer)
        # the optimizer finds its parameters through the model's sharded tensors
        with contextlib.nullcontext() if is_loading else state_without_gather(optimizer):
            state["optimizer"] = optimizer.sharded_state_dict(dict(state), is_loading=is_loading, metadata=metadata)
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    if with_rng:
        state["rng_state"] = _rng_sharded_object(None if is_loading else _capture_rng())
    return state


def model_state_of(chunks) -> str:
    """MODEL_STATE_ADAPTERS when the model carries LoRA adapters. Collective: a pipeline stage may hold
    none of the adapted modules, and all ranks must save and load the same kind of state."""
    local = any(is_adapter_name(name) for chunk in chunks for name, _ in chunk.named_parameters())
    return MODEL_STATE_ADAPTERS if on_any_rank(local) else MODEL_STATE_FULL


def on_any_rank(flag: bool) -> bool:
    """Whether `flag` holds on some rank (collective)."""
    value = torch.tensor([int(flag)], dtype=torch.int32, device=_collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def load_model_state(model: torch.nn.Module, state: dict, model_state: str, *, strict: bool) -> None:
    if model_state == MODEL_STATE_FULL:
        model.load_state_dict(state, strict=strict)
        return
    # Adapters only: the frozen base stays as built. Megatron-Bridge's adapter wrappers name the base
    # weights differently in state_dict() and in the module tree, so a strict load cannot be used;
    # every adapter tensor was requested from the checkpoint, which dist_checkpointing enforced.
    result = model.load_state_dict(state, strict=False)
    missing_adapters = [key for key in result.missing_keys if is_adapter_name(key)]
    if strict and (missing_adapters or result.unexpected_keys):
        raise CheckpointMismatchError(
            f"adapter state does not fit the model: missing {missing_adapters}, unexpected {result.unexpected_keys}"
        )


def _collective_device() -> torch.device:
    from skyrl_megatron.runtime import current_runtime

    return current_runtime().torch_device


def _materialise_adam_state(optimizer) -> None:
    """Give torch Adam parameters without state (no step taken yet) their initial state.

    torch's Adam creates state lazily at the first step, but Megatron's distributed optimizer,
    when it runs on torch Adam (no TE or Apex), can only describe its state once every parameter
    has a `step`. Zero moments at step 0 are exactly what the first step would create, so an
    optimizer given them behaves as a fresh one.
    """
    for torch_optimizer in torch_optimizers(optimizer):
        if not isinstance(torch_optimizer, torch.optim.Adam | torch.optim.AdamW):
            continue
        for group in torch_optimizer.param_groups:
            for param in group["params"]:
                if not torch_optimizer.state[param]:
                    torch_optimizer.state[param] = {
                        "step": initial_adam_step(param, group),
                        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                    }


def load_optimizer_state(optimizer, state) -> None:
    """`optimizer.load_state_dict(state)`, working around two Megatron 0.19.2 bugs in the
    distributed optimizer on torch's Adam (no TE or Apex), whose per-parameter state holds a
    `step` tensor:
    - `_set_main_param_and_optimizer_states` asks the checkpoint for a `step` entry it never
      stores (KeyError), so the steps are set aside while the parameter state is copied in;
    - `load_state_dict` hands every parameter the same step tensor, which Adam then increments
      in place once per parameter (the resumed run's bias corrections drift), so each parameter
      gets its own copy back.
    """
    from megatron.core.optimizer import DistributedOptimizer

    parts = chained_parts(optimizer)
    # a chain of one is saved as its only member's state; longer chains by position
    states = [state] if len(parts) == 1 else [state[index] for index in range(len(parts))]
    for part, part_state in zip(parts, states):
        if not isinstance(part, DistributedOptimizer):
            part.load_state_dict(part_state)
            continue
        param_state = part_state.pop("param_state")
        sharding_type = part_state.pop("param_state_sharding_type")
        if sharding_type != OPTIMIZER_SHARDING_TYPE:
            raise CheckpointError(f"unexpected distributed optimizer sharding type {sharding_type!r}")
        part.load_state_dict(part_state)  # param groups (lr, step), grad scaler
        adam_state = part.optimizer.state
        steps = {param: state.pop("step") for param, state in adam_state.items() if "step" in state}
        try:
            part.load_parameter_state_from_fully_reshardable(param_state)
        finally:
            for param, step in steps.items():
                adam_state[param]["step"] = step.clone()
    if len(parts) > 1:
        optimizer._synchronize_steps()
    use_fused_torch_adam(optimizer)


def use_fresh_buffers(sharded: dict) -> None:
    """Point every sharded tensor at a new host buffer, so a failed read leaves the live tensors
    untouched; `load_state_dict` copies the values over afterwards. Host memory, because the
    transient second copy of the model and optimizer shards must not cost device memory."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for value in nested_values(sharded):
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and value.data is not None:
            value.data = torch.empty_like(value.data, device="cpu")


def _rng_sharded_object(rng_state: dict | None):
    """This rank's RNG states as a ShardedObject of a (world_size,) global object."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject("rng_state", rng_state, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


def _capture_rng() -> dict[str, Any]:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from skyrl_megatron.runtime import current_runtime

    on_gpu = not current_runtime().is_cpu
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if on_gpu else None,
        # Megatron's named states (TP-decorrelated streams); empty in the CPU runtime's tracker
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def restore_rng(rng_state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(rng_state["python"])
    np.random.set_state(rng_state["numpy"])
    torch.set_rng_state(rng_state["torch"])
    if rng_state["cuda"] is not None:
        torch.cuda.set_rng_state(rng_state["cuda"])
    get_cuda_rng_tracker().set_states(rng_state["tracker"])


def optimizer_kind(optimizer) -> str:
    return "distributed" if optimizer.config.use_distributed_optimizer else "plain"


def describe_optimizer(kind: str | None) -> str:
    return {
        "distributed": "distributed-optimizer state",
        "plain": "plain (non-distributed) optimizer state",
        None: "no optimizer state",
    }[kind]


