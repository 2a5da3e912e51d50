"""Everything our workers, losses and engines take from skyrl-train: the host's classes and helpers,
looked up in one place (imports inside each function, so importing this module imports no host code).

This is the lowest layer that knows the host; `host.py` (activation, Ray, compatibility fixes,
validation, running the experiment) builds on it, and so do `workers/`, `compute/losses.py` and
`engines/`, which therefore never import `host.py`.
"""

from __future__ import annotations


def standalone_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                             group_name=None, pg_options=None):
    """A process group of its own (not a subgroup of the default world): trainer rank 0 + engines."""
    from torch.distributed import PrefixStore, rendezvous
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world, default_pg_timeout

    timeout = timeout or default_pg_timeout
    if store is None:
        store, rank, world_size = next(rendezvous(init_method or "env://", rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend or "undefined"), store,
        group_name=group_name, backend_options=pg_options, timeout=timeout,
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


standalone_process_group._skyrl_megatron_fixed = True  # type: ignore[attr-defined]


def worker_bases():
    """(PolicyWorkerBase, RefWorkerBase, CriticWorkerBase): the host's worker contract."""
    from skyrl_train.workers.worker import CriticWorkerBase, PolicyWorkerBase, RefWorkerBase

    return PolicyWorkerBase, RefWorkerBase, CriticWorkerBase


def make_mesh_rank(*, dp: int, cp: int, tp: int, pp: int, world_size: int, dp_size: int, pp_size: int):
    """The host's MeshRank; the host collects from ``sp == 0``, so a Megatron rank puts its CP rank there."""
    from skyrl_train.distributed.dispatch import MeshRank

    return MeshRank(dp=dp, sp=cp, tp=tp, pp=pp, world_size=world_size, dp_size=dp_size, pp_size=pp_size)


def training_output(tensors: dict | None = None, metadata: dict | None = None):
    from skyrl_train.training_batch import TrainingOutputBatch

    out = TrainingOutputBatch(tensors or {})
    out.metadata = metadata or {}
    return out


def policy_loss_function(name: str):
    """The host's registered policy loss `name` (regular, dual_clip, gspo, cispo, ... or a user's)."""
    from skyrl_train.utils.ppo_utils import PolicyLossRegistry

    return PolicyLossRegistry.get(name)


def critic_loss_function():
    """The host's value loss, ``ppo_critic_loss(values, old_values, returns, config, loss_mask)``."""
    from skyrl_train.utils.ppo_utils import ppo_critic_loss

    return ppo_critic_loss


def masked_mean(tensor, mask, dim=None):
    from skyrl_train.utils.ppo_utils import masked_mean as host_masked_mean

    return host_masked_mean(tensor, mask, dim=dim)


def approx_kl(log_probs, base_log_probs, loss_mask, estimator: str):
    """The host's KL estimator *with* gradients.

    Host 0.3.1 wraps `compute_approx_kl` in ``torch.no_grad()``, so its KL loss trains nothing. We
    call the undecorated function (kept by functools.wraps as ``__wrapped__``) so the KL term
    actually regularises the policy.
    """
    from skyrl_train.utils.ppo_utils import compute_approx_kl

    fn = getattr(compute_approx_kl, "__wrapped__", compute_approx_kl)
    return fn(log_probs, base_log_probs, loss_mask=loss_mask, kl_estimator_type=estimator)


def weight_chunk(bucket):
    """The host's ``WeightChunk`` for a :class:`skyrl_megatron.weights.WeightBucket` (the same four fields)."""
    from skyrl_train.weight_sync import WeightChunk

    return WeightChunk(names=bucket.names, dtypes=bucket.dtypes, shapes=bucket.shapes, tensors=bucket.tensors)


def inference_engine_interface():
    """The host's ``InferenceEngineInterface``: what its InferenceEngineClient and generators drive."""
    from skyrl_train.inference_engines.base import InferenceEngineInterface

    return InferenceEngineInterface


def weight_update_request_base():
    """The host's ``WeightUpdateRequest`` (names, dtypes, shapes), base of every weight-sync request."""
    from skyrl_train.weight_sync.base import WeightUpdateRequest

    return WeightUpdateRequest


def lora_load_request_class():
    """The host's ``LoraLoadRequest`` (load adapters from disk instead of receiving tensors)."""
    from skyrl_train.weight_sync.base import LoraLoadRequest

    return LoraLoadRequest


def ray_wrapped_inference_engine(actor):
    """The host's ``RayWrappedInferenceEngine`` around an engine actor handle (how the host holds engines)."""
    from skyrl_train.inference_engines.ray_wrapped_inference_engine import RayWrappedInferenceEngine

    return RayWrappedInferenceEngine(actor)


def broadcast_init_info_class():
    """The host's ``BroadcastInitInfo``: where and how its broadcast weight sender meets the engines."""
    from skyrl_train.weight_sync import BroadcastInitInfo

    return BroadcastInitInfo


def broadcast_update_request_class():
    """The host's ``BroadcastWeightUpdateRequest``: names, dtypes, shapes; the tensors follow by broadcast."""
    from skyrl_train.weight_sync import BroadcastWeightUpdateRequest

    return BroadcastWeightUpdateRequest


def join_weight_broadcast_group(init_info):
    """Join the host's weight-broadcast group as an engine of one rank (rank ``init_info.rank_offset``).

    The group lives outside the engine's own default process group (there is none on the CPU engine),
    exactly as the host's receivers create it.
    """
    from skyrl_train.utils import get_tcp_url

    return standalone_process_group(
        backend=init_info.backend,
        init_method=get_tcp_url(init_info.master_addr, init_info.master_port),
        world_size=init_info.world_size,
        rank=init_info.rank_offset,
        group_name=init_info.group_name,
    )


def weight_sync_bucket_bytes(cfg, strategy_cls) -> int:
    """How many bytes of weights go into one ``WeightChunk`` for the host's transfer strategy.

    The broadcast sender takes exactly one tensor per chunk (a 1-byte budget puts every tensor in a
    bucket of its own); CUDA IPC packs a chunk into one buffer, sized by the host's threshold.
    """
    from skyrl_train.weight_sync import CudaIpcTransferStrategy

    if strategy_cls is CudaIpcTransferStrategy:
        return max(1, int(float(cfg.generator.weight_transfer_threshold_cuda_ipc_GB) * 2**30))
    return 1


def generator_dtype(cfg):
    """The dtype the inference engines hold their weights in (``generator.model_dtype``)."""
    from skyrl_train.utils import str_to_torch_dtype

    return str_to_torch_dtype(cfg.generator.model_dtype)
